"""The `goodput` batch policy (issue #36) on simulated steps: step times from a throughput curve, a noise scale
that changes over the run. Each test fails when the behaviour it names is removed."""
import copy

import pytest

from pdv_ext.policy.base import Change, SetBatchSize, build_policy


def run(pol, steps, step_time, gns, mb=1, mbs=4, dp=2, start=1, on_step=None, loss=None):
    """Drive `pol` as the runner would: its batch changes applied and announced. Returns the batch per step."""
    batches = []
    for step in range(start, start + steps):
        batch = mb * mbs * dp
        batches.append(batch)
        m = {"step": step, "batch_size": batch, "micro_batches": mb, "micro_batch_size": mbs, "dp_size": dp,
             "step_time": step_time(batch), "gns": gns(step)}
        if loss is not None:
            m["loss"] = loss(step, batch)
        for a in pol.after_step(m):
            assert isinstance(a, SetBatchSize)
            mb, mbs = a.micro_batches, a.micro_batch_size
            pol.on_change(Change(kind="batch_size", step=step, source="goodput", micro_batches=mb,
                                 micro_batch_size=mbs, dp_size=dp))
        if on_step:
            on_step(step, pol)
    return batches


def pipeline(batch):  # a large fixed part: the batch decides the speed (0.2 s + 2 ms a sample)
    return 0.2 + 0.002 * batch


def compute_bound(batch):  # no fixed part: a bigger batch buys no throughput
    return 0.004 * batch


def test_grows_as_the_noise_scale_grows_and_logs_each_decision(caplog):
    pol = build_policy({"name": "goodput", "max_batch_size": 256, "warmup_steps": 10, "interval": 10})
    with caplog.at_level("INFO", logger="pdv_ext"):
        batches = run(pol, 400, pipeline, lambda s: 5.0 + s)  # 5 -> 405 samples
    assert batches[0] == 8 and batches[-1] >= 128, batches[::20]

    def true_goodput(b, s):
        g = 5.0 + s
        return b / pipeline(b) * (g + 8) / (g + b)

    # outside its probes, the batch it runs at is within 10% of the best power of two's goodput (the
    # optimum moves from ~16 samples to ~280 over the run)
    probing = {s for d in pol.decisions if d["kind"] == "probe" for s in range(d["step"] + 1, d["step"] + 6)}
    for s, b in enumerate(batches, start=1):
        if s > 20 and s not in probing:
            best = max(true_goodput(2 ** k, s) for k in range(3, 9))
            assert true_goodput(b, s) >= 0.9 * best, (s, b, best)
    assert any(d["kind"] == "probe" for d in pol.decisions)
    assert any(d["kind"] == "move" and d["how"] == "measured" for d in pol.decisions)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("goodput:")]
    assert len(lines) == len(pol.decisions) > 0
    assert all("samples/s" in x and "efficiency" in x and "->" in x for x in lines), lines[:3]


def test_a_probe_that_does_not_pay_goes_back_at_once():
    pol = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10, "measure_steps": 3})
    batches = run(pol, 200, compute_bound, lambda s: 40.0)
    probes = [d for d in pol.decisions if d["kind"] == "probe"]
    assert probes, pol.decisions
    back = [d for d in pol.decisions if d["kind"] == "move"]
    # every probe is followed by the move back to where it came from
    assert len(back) == len(probes) and all(b["to"] == p["from"] for p, b in zip(probes, back))
    assert batches[-1] == 8
    # measured once, the larger batch is not probed again until its measurement is stale (300 steps)
    assert len(probes) == 1


def test_shrinks_when_the_noise_scale_falls():
    pol = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10, "min_batch_size": 8})
    batches = run(pol, 300, pipeline, lambda s: 400.0 if s < 150 else 2.0)
    assert max(batches[:150]) >= 64
    assert batches[-1] < max(batches[:150]) and batches[-1] <= 16, batches[140::10]


def test_never_leaves_the_bounds():
    pol = build_policy({"name": "goodput", "warmup_steps": 5, "interval": 5, "min_batch_size": 16,
                        "max_batch_size": 64})
    batches = run(pol, 300, pipeline, lambda s: 1e4, mb=2)
    assert min(batches) >= 16 and max(batches) <= 64 and batches[-1] == 64


def test_another_policy_s_change_of_shares_or_plan_forgets_the_throughputs():
    pol = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10})
    run(pol, 60, pipeline, lambda s: 100.0)
    assert pol.measured
    pol.on_change(Change(kind="shares", step=60, source="rebalance", shares=(3, 1), micro_batches=2, dp_size=2))
    assert pol.measured == {} and pol.probe is None and pol.last_change == 60
    pol.on_change(Change(kind="lr", step=61, source="x"))
    assert pol.last_change == 60  # an LR change leaves the timings alone


def test_state_round_trips_mid_run():
    pol = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10})
    run(pol, 95, pipeline, lambda s: 5.0 + s)
    twin = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10})
    twin.load_state_dict(copy.deepcopy(pol.state_dict()))
    assert twin.state_dict() == pol.state_dict()
    mb = pol.decisions[-1]["to"] // 8 if pol.decisions else 1
    a = run(pol, 100, pipeline, lambda s: 5.0 + s, mb=mb, start=96)
    b = run(twin, 100, pipeline, lambda s: 5.0 + s, mb=mb, start=96)
    assert a == b and pol.decisions == twin.decisions


def test_bounds_that_make_no_sense_are_one_clear_error():
    with pytest.raises(Exception, match="max_batch_size 8 is below min_batch_size 16"):
        build_policy({"name": "goodput", "min_batch_size": 16, "max_batch_size": 8})
    with pytest.raises(Exception, match="factor"):
        build_policy({"name": "goodput", "factor": 1.0})


def _noisy_loss(floor_of, seed=0):
    """A training loss that falls to a floor set by the batch (1 + floor_of(batch)), with per-step noise."""
    import random

    rng = random.Random(seed)
    return lambda step, batch: 1.0 + floor_of(batch) + 2.0 * 0.97 ** step + rng.gauss(0.0, 0.01)


def test_a_plateau_grows_the_batch_and_it_is_not_shrunk_below_again():
    opts = {"name": "goodput", "warmup_steps": 10, "interval": 10, "plateau_steps": 20, "max_batch_size": 64}
    pol = build_policy(opts)
    # compute-bound with a small noise scale: goodput alone keeps the smallest batch (as the test above)...
    batches = run(pol, 400, compute_bound, lambda s: 4.0, loss=_noisy_loss(lambda b: 0.0))
    # ...but once the loss stops falling (0.97**step is below the noise from step ~150) the plateau grows it
    plateaus = [d for d in pol.decisions if d["kind"] == "plateau"]
    assert plateaus and plateaus[0]["step"] > 100, pol.decisions
    assert all(d["to"] == 2 * d["from"] for d in plateaus)
    # nothing after a plateau goes below the batch it reached (the efficiency says smaller is better here)
    first = plateaus[0]["step"]
    assert min(batches[first:]) >= plateaus[0]["to"] and pol.floor == batches[-1] == 64, batches[first::20]
    # state survives a checkpoint
    again = build_policy(opts)
    again.load_state_dict(copy.deepcopy(pol.state_dict()))
    assert again.floor == pol.floor and again.losses == pol.losses


def test_no_plateau_while_the_loss_falls_or_without_the_option():
    pol = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10, "plateau_steps": 20})
    run(pol, 100, compute_bound, lambda s: 4.0, loss=_noisy_loss(lambda b: 0.0))  # falls by far more than noise
    assert not [d for d in pol.decisions if d["kind"] == "plateau"] and pol.floor == 0
    off = build_policy({"name": "goodput", "warmup_steps": 10, "interval": 10})
    batches = run(off, 400, compute_bound, lambda s: 4.0, loss=_noisy_loss(lambda b: 0.0))
    assert not [d for d in off.decisions if d["kind"] == "plateau"] and batches[-1] == 8


def control(batch):  # pdv bench adaptive's task on 2 CPU ranks: T(B) ~ 8.5 ms + 0.26 ms x B
    return 0.0085 + 0.00026 * batch


def test_the_efficiency_model_follows_the_lr_rule():
    """`efficiency: auto`: the square root of Pollux's efficiency where the LR follows the sqrt rule (Adam's), so
    on the compute-bound control with a noise scale of 100 the batch grows past where the SGD model stops;
    `sgd` (or any other rule) keeps Pollux's; the model's name is in every decision."""
    from pdv_ext.policy.base import TrainContext
    from pdv_ext.policy.gns import adam_sqrt_efficiency, statistical_efficiency

    assert adam_sqrt_efficiency(100.0, 16, 256) == pytest.approx(((116 / 356) ** 0.5))
    assert adam_sqrt_efficiency(100.0, 16, 16) == 1.0 and statistical_efficiency(100.0, 16, 256) == 116 / 356
    ends = {}
    for rule, opts in (("sqrt", {}), ("linear", {}), ("sqrt", {"efficiency": "sgd"}), ("none", {"efficiency": "adam_sqrt"})):
        pol = build_policy({"name": "goodput", "min_batch_size": 8, "max_batch_size": 512, "warmup_steps": 10,
                            "interval": 10, **opts})
        pol.on_train_begin(TrainContext(world_size=2, dp_size=2, micro_batch_size=4, micro_batches=1, lr=1e-3,
                                        extra={"lr_scaling": rule}))
        batches = run(pol, 300, control, lambda s: 100.0)
        ends[(rule, opts.get("efficiency", "auto"))] = (pol.model, batches[-1])
        assert all(d["efficiency_model"] == pol.model for d in pol.decisions if "efficiency_model" in d)
    assert ends[("sqrt", "auto")][0] == "adam_sqrt" and ends[("linear", "auto")][0] == "sgd"
    assert ends[("sqrt", "sgd")][0] == "sgd" and ends[("none", "adam_sqrt")][0] == "adam_sqrt"
    assert ends[("sqrt", "auto")][1] > ends[("linear", "auto")][1], ends
