"""pdv.faults: schema, built-in and user attacks, and the non-finite guard."""
import pytest
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.aggregation.faults import FaultInjector, NonFiniteGradients, NonFiniteGuard
from pdv_ext.config import validate_pdv

from tests.threadcomm import run_threads


def grads(rank):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(30, generator=g), torch.randn(2, 5, generator=g)]


def user_attack(ctx):
    """A user attack: the negated gradient of the next rank (needs the omniscient view)."""
    other = ctx.all_grads[(ctx.rank + 1) % ctx.size]
    return [-t + ctx.options.get("shift", 0.0) for t in other]


def test_schema_errors():
    errs = validate_pdv({"faults": {"attack": "gausian", "byzantine_ranks": [-1], "flip_prob": 2}})[1]
    joined = "\n".join(errs)
    assert "pdv.faults.attack" in joined and "did you mean 'gaussian'" in joined
    assert "pdv.faults.byzantine_ranks" in joined and "pdv.faults.flip_prob" in joined
    assert not validate_pdv({"faults": {"attack": "mypkg.attacks:evil", "byzantine_ranks": [1]}})[1]


def corrupt_all(cfg, m=4, step=0):
    def fn(comm):
        inj = FaultInjector(cfg, global_rank=comm.rank)
        return [t.clone() for t in inj.corrupt(grads(comm.rank), comm, step)]
    return run_threads(m, fn)


def test_builtin_attacks_touch_only_byzantine_ranks():
    honest = [grads(r) for r in range(4)]
    out = corrupt_all({"byzantine_ranks": [1], "attack": "sign_flip"})
    assert torch.equal(out[1][0], -honest[1][0]) and torch.equal(out[0][0], honest[0][0])
    out = corrupt_all({"byzantine_ranks": [2], "attack": "scaled"})
    mean = sum(h[1] for h in honest) / 4
    assert torch.allclose(out[2][1], -10 * mean) and torch.equal(out[3][1], honest[3][1])
    out = corrupt_all({"byzantine_ranks": [0], "attack": "gaussian", "sigma": 5})
    assert (out[0][0] - honest[0][0]).std() > 2
    out = corrupt_all({"byzantine_ranks": [3], "attack": "bit_flip", "flip_prob": 0.5})
    changed = (out[3][0] != honest[3][0]).float().mean()
    assert 0.2 < changed < 0.8
    out = corrupt_all({"byzantine_ranks": [3], "attack": "nan"})
    assert not torch.isfinite(out[3][0]).any()
    out = corrupt_all({"byzantine_ranks": [1], "attack": "sign_flip", "start_step": 5}, step=4)
    assert torch.equal(out[1][0], honest[1][0])


def test_user_attack_gets_context_with_all_grads():
    honest = [grads(r) for r in range(3)]
    out = corrupt_all({"byzantine_ranks": [0], "attack": "tests.unit.test_agg_faults:user_attack",
                       "options": {"shift": 1.0}}, m=3)
    assert torch.allclose(out[0][0], -honest[1][0] + 1.0)
    assert torch.equal(out[2][0], honest[2][0])


def test_label_flip_is_a_data_hook():
    inj = FaultInjector({"byzantine_ranks": [1], "attack": "label_flip", "num_classes": 10}, global_rank=1)
    y = torch.tensor([0, 3, 9])
    assert inj.flip_labels(y, 0).tolist() == [9, 6, 0]
    assert FaultInjector(inj.config, global_rank=0).flip_labels(y, 0).tolist() == [0, 3, 9]
    batches = list(inj.wrap_data_iter(iter([(torch.zeros(3), y)])))
    assert batches[0][1].tolist() == [9, 6, 0]


@pytest.mark.parametrize("spec", ["mean", {"type": "gossip", "peers": 1, "ratio": 0.5}])
def test_guard_names_rank_and_step_for_intolerant_aggregators(spec):
    def fn(comm):
        agg = build_aggregator(spec)
        agg.step = 7
        g = grads(comm.rank)
        if comm.rank == 2:
            g[1][0, 0] = float("nan")
        NonFiniteGuard().run(agg, g, comm)

    with pytest.raises(NonFiniteGradients, match=r"rank\(s\) 2 .*step 7") as info:
        run_threads(4, fn)
    assert info.value.ranks == [2] and info.value.step == 7


def test_guard_leaves_healthy_mean_bit_identical_and_robust_ones_alone():
    def fn(comm):
        plain = build_aggregator("mean")(grads(comm.rank), comm)
        guarded = NonFiniteGuard().run(build_aggregator("mean"), grads(comm.rank), comm)
        g = grads(comm.rank)
        if comm.rank == 0:
            g[0][:] = float("inf")
        robust = NonFiniteGuard().run(build_aggregator("median"), g, comm)
        return plain, guarded, robust

    for plain, guarded, robust in run_threads(3, fn):
        assert all(torch.equal(a, b) for a, b in zip(plain, guarded))
        assert all(torch.isfinite(t).all() for t in robust)


def test_all_finite_fast_path_is_exact():
    from pdv_ext.aggregation.faults import all_finite

    huge = torch.full((8,), 3e38)  # finite, but its sum overflows: the exact check must decide
    assert all_finite([huge, torch.ones(3, dtype=torch.float16), torch.empty(0)])
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(5, dtype=torch.float64)
        t[2] = bad
        assert not all_finite([torch.ones(2), t])


def test_mean_checks_its_own_buffer_overflow_and_checksum_overflow():
    """mean spots NaN/Inf on its reduced buffer: a true overflow raises naming no rank; a buffer whose
    checksum overflows but whose values are all finite passes."""
    def overflow(comm):
        NonFiniteGuard().run(build_aggregator("mean"), [torch.full((4,), 3e38)], comm, step=3)

    with pytest.raises(NonFiniteGradients, match="overflow") as info:
        run_threads(2, overflow)
    assert info.value.ranks == []

    def big_but_finite(comm):
        return NonFiniteGuard().run(build_aggregator("mean"), [torch.full((8,), 1e38)], comm)

    for out in run_threads(2, big_but_finite):
        assert torch.isfinite(out[0]).all()


def test_guard_defers_to_the_fp16_loss_scaler():
    """Under fp16 an overflow of the loss-scaled gradients is DeepSpeed's to handle (skip the step, lower
    the scale): the engine's guard lets it through; elsewhere it raises naming the rank."""
    from types import SimpleNamespace

    def step(defer):
        def fn(comm):
            agg = build_aggregator("adasum")
            engine = SimpleNamespace(aggregator=agg, dp_comm=comm, global_steps=7)
            guard = NonFiniteGuard(defer=defer)
            g = [torch.full((4,), float("inf") if comm.rank == 1 else 1.0)]
            g = guard.before(engine, g)
            out = agg(g, comm)
            guard.after(engine, out)
            return out
        return fn

    for out in run_threads(2, step(True)):
        assert not torch.isfinite(out[0]).all()  # reaches the optimizer, whose overflow check skips the step
    with pytest.raises(NonFiniteGradients) as info:
        run_threads(2, step(False))
    assert info.value.ranks == [1]


def test_bit_flip_applies_its_host_drawn_mask_on_the_gradients_device():
    """The mask is drawn by the CPU generator; on a GPU rank it must be applied on the GPU ("meta" plays it:
    mixing it with a CPU tensor raises the same device error)."""
    from pdv_ext.aggregation.faults import AttackContext, FaultsConfig, bit_flip

    g = torch.zeros(8, 3, device="meta")
    ctx = AttackContext(grads=[g], all_grads=None, step=0, rank=0, global_rank=0, size=2,
                        generator=torch.Generator().manual_seed(0),
                        config=FaultsConfig(byzantine_ranks=[0], attack="bit_flip", flip_prob=0.5), options={})
    out = bit_flip(ctx)
    assert out[0].device.type == "meta" and out[0].shape == g.shape
