"""Rank-side functions of the aggregation integration tests (run through pdv_ext.spawn.run_ranks)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch


def rank_grads(rank: int, step: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    base = torch.Generator().manual_seed(step)
    return [torch.randn(33, generator=base) + 0.1 * torch.randn(33, generator=g),
            torch.randn(4, 5, generator=base) + 0.1 * torch.randn(4, 5, generator=g)]


def torch_aggregators(specs: List[Dict[str, Any]], byzantine: int = 1, steps: int = 3) -> Dict[str, Any]:
    """Every spec over a real gloo TorchComm, with `byzantine` running the omniscient `scaled` attack."""
    import torch.distributed as dist

    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.aggregation.faults import FaultInjector, NonFiniteGradients, NonFiniteGuard
    from pdv_ext.comm import TorchComm
    from pdv_ext.spawn import init_torch_distributed

    init_torch_distributed()
    comm = TorchComm()
    injector = FaultInjector({"byzantine_ranks": [byzantine], "attack": "scaled"}, dist.get_rank())
    results: Dict[str, Any] = {}
    for spec in specs:
        agg = build_aggregator(dict(spec))
        if getattr(agg, "needs_validation", False):
            agg.validation_fn = lambda: rank_grads(50 + comm.rank)
        outs, reports = [], []
        for s in range(steps):
            g = injector.corrupt(rank_grads(comm.rank, s), comm, s)
            outs.append(torch.cat([t.reshape(-1) for t in NonFiniteGuard().run(agg, g, comm)]))
            reports.append(dict(agg.report))
        results[spec["type"]] = {"outs": outs, "reports": reports,
                                 "residual": getattr(agg, "residual", None)}
    # NaN from one rank with mean: a clear error on every rank
    g = rank_grads(comm.rank)
    if comm.rank == comm.size - 1:
        g[0][3] = float("nan")
    try:
        NonFiniteGuard().run(build_aggregator("mean"), g, comm, step=11)
        results["nan_error"] = None
    except NonFiniteGradients as exc:
        results["nan_error"] = str(exc)
    return results


def teacher_batches(seed: int, micro_batch: int = 4, d_in: int = 16, d_out: int = 4):
    """Endless (x, label) micro-batches of one fixed teacher (shared by every replica and the validation
    data); `seed` only changes the inputs drawn."""
    teacher = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + seed)
    while True:
        x = torch.randn(micro_batch, d_in, generator=g)
        yield x, (x @ teacher).argmax(-1)


def pipeline_zeno(steps: int = 4, refresh_every: int = 2) -> Dict[str, Any]:
    """2 stages x 2 replicas; replica 1 (global ranks 1 and 3) flips its gradients' sign; zeno drops it.
    Then the same engine switches to mean with a NaN attack and must raise, naming the rank."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.aggregation.faults import BUILTIN, NonFiniteGradients
    from pdv_ext.models import mlp_layers, seed_layer

    from .workers import ds_config

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers=mlp_layers(4, 32, 16, 4), num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer, base_seed=0)
    pdv = {"aggregation": {"type": "zeno", "b": 1, "refresh_every": refresh_every},
           "faults": {"byzantine_ranks": [1, 3], "attack": "sign_flip", "scale": 4.0}}
    cfg = ds_config(micro_batch=64, grad_acc=2, dp=2, lr=1e-2, pdv=pdv)
    eng, _, _, _ = pdv_ext.initialize(model=model, config=cfg, model_parameters=list(model.parameters()),
                                      validation_iter=teacher_batches(99, 64))
    data = teacher_batches(1 + eng.grid.get_data_parallel_id(), 64)
    losses, dropped = [], []
    for _ in range(steps):
        losses.append(float(eng.train_batch(data_iter=data)))
        dropped.append(list(eng.aggregator.report["dropped"]))
    weights = torch.cat([p.detach().reshape(-1).clone() for p in eng.module.parameters()])
    calls = eng.pdv_runtime.validation.calls
    eng.set_aggregator("mean")
    eng.pdv_faults.attack = BUILTIN["nan"]
    error = None
    try:
        eng.train_batch(data_iter=data)
    except NonFiniteGradients as exc:
        error = str(exc)
    return {"losses": losses, "dropped": dropped, "weights": weights, "stage": eng.stage_id, "rank": dist.get_rank(),
            "host_group": eng.dp_comm.host_group is not None,
            "validation_calls": calls, "error": error}


def gathered_rows() -> Dict[str, Any]:
    """`TorchComm.all_gather_into` (the ring on gloo) over the world and over a sub-group of 3 ranks
    (odd, and group ranks that are not global ranks): every row as its rank wrote it."""
    import torch.distributed as dist

    from pdv_ext.comm import TorchComm

    def rows(comm: TorchComm, shape) -> bool:
        out = torch.full((comm.size, *shape), float("nan"))
        out[comm.rank] = torch.arange(float(out[0].numel())).view(shape) + 100 * comm.global_rank(comm.rank)
        comm.all_gather_into(out)
        want = torch.stack([torch.arange(float(out[0].numel())).view(shape) + 100 * comm.global_rank(r)
                            for r in range(comm.size)])
        return bool(torch.equal(out, want))

    sub = dist.new_group([1, 2, 3])  # collective: every rank creates it
    res = {"world": rows(TorchComm(), (1000, 3))}
    if dist.get_rank() in (1, 2, 3):
        res["sub"] = rows(TorchComm(sub), (7,))
    return res


def host_groups() -> Dict[str, Any]:
    """`TorchComm(group, host_group=host_twin(...))` over the groups [0, 2] and [1, 3]: CPU payloads travel
    on the twin, the aggregators' results are those of the plain comm, a twin of other ranks is refused."""
    import torch.distributed as dist

    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.comm import TorchComm, host_twin

    lists = [[0, 2], [1, 3]]
    groups = [dist.new_group(g) for g in lists]
    group = groups[dist.get_rank() % 2]
    twin = host_twin(lists, force=True)
    assert host_twin(lists, force=False) is None
    plain, comm = TorchComm(group), TorchComm(group, host_group=twin)
    used = []
    real = dist.all_reduce

    def spy(tensor, *a, group=None, **k):
        used.append("twin" if group is twin else "group" if group is group_ else "other")
        return real(tensor, *a, group=group, **k)

    group_ = group
    dist.all_reduce = spy
    try:
        scalars = comm.all_reduce_scalars([1.0, float(dist.get_rank())])
    finally:
        dist.all_reduce = real
    out = {"rank": dist.get_rank(), "scalars": scalars, "used": used, "payload_device": str(comm.payload_device),
           "objects": comm.all_gather_object({"rank": dist.get_rank()}),
           "broadcast": comm.broadcast_object("hello" if comm.rank == 1 else None, src=1)}
    for spec in ({"type": "zeno", "b": 0}, {"type": "gossip", "peers": 1, "ratio": 0.5}, {"type": "adasum"}):
        res = []
        for c in (plain, comm):
            agg = build_aggregator(dict(spec))
            if spec["type"] == "zeno":
                agg.set_validation_grads(rank_grads(99, 0))
            res.append(torch.cat([t.reshape(-1) for t in agg(rank_grads(dist.get_rank(), 0), c)]))
        out[spec["type"]] = bool(torch.equal(res[0], res[1]))
    other = dist.new_group([0, 1, 2, 3], backend="gloo")
    try:
        TorchComm(group, host_group=other)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


def gloo_suite(specs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One process group for every plain-gloo check (start-up is the expensive part): the aggregators
    under an omniscient attacker, then the rank functions of `pdv bench byzantine` and `convergence`."""
    from pdv_ext.bench import byzantine, convergence

    out = torch_aggregators(specs, byzantine=1, steps=3)
    out["rows"] = gathered_rows()
    out["host"] = host_groups()
    configs = byzantine.build_configs(["scaled"], [1], ["mean", "zeno"])
    out["byzantine"] = byzantine.rank_main(configs, steps=15, batch=32, lr=0.5, hidden=32)
    out["convergence"] = convergence.rank_main([{"aggregator": "mean", "lr": 1.0}, {"aggregator": "adasum", "lr": 1.0}],
                                               batch=64, max_steps=40, target=0.6, eval_every=1, hidden=32)
    return out


def small_groups(specs: List[Dict[str, Any]], steps: int = 2) -> Dict[str, Any]:
    """The same aggregation sections on this (small) gloo group: outputs and the group-size warnings."""
    import warnings

    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.aggregation.groups import GroupSizeWarning
    from pdv_ext.comm import TorchComm
    from pdv_ext.spawn import init_torch_distributed

    init_torch_distributed()
    comm = TorchComm()
    out: Dict[str, Any] = {}
    for spec in specs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            agg = build_aggregator(dict(spec))
            if getattr(agg, "needs_validation", False):
                agg.validation_fn = lambda: rank_grads(50 + comm.rank)
            outs = [torch.cat([t.reshape(-1) for t in agg(rank_grads(comm.rank, s), comm)]) for s in range(steps)]
        out[spec["type"]] = {"outs": outs, "warnings": [str(w.message) for w in caught
                                                        if issubclass(w.category, GroupSizeWarning)]}
    return out
