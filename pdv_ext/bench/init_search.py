"""`pdv bench init-search`: does a searched initialization beat the default one on the digits classifier?

For every seed, data-parallel ranks (pdv_ext.spawn.run_ranks, TorchComm, gradients averaged by the `mean`
aggregator) train an MLP on scikit-learn's digits for `--steps` steps from
(a) the model's default initialization, (b) the winner of `pdv_ext.init_search.search_init` (probe cost
counted in wall time), and (c) the default initialization trained for extra steps that take about the
probe's wall time ("same wall time" baseline). Reported: held-out loss and accuracy after `--steps`
(mean and std over seeds), the mean held-out curve at 1/8, 1/4, 1/2 and all of the steps (a searched start
can help early and fade later), probe and training seconds.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

from .common import check_ranges, emit, log, parser


def _model(seed: int, hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def _stream(x, y, batch: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(x), (batch,), generator=g)
        yield x[idx], y[idx]


def _train(model, data, steps: int, lr: float, comm, eval_at=(), evaluate=None, curve=None) -> float:
    """Data-parallel SGD: local gradient, `mean` aggregator over the ranks, step. Returns the training
    seconds (held-out evaluations at the steps in `eval_at` go to `curve` and are not timed)."""
    import torch
    from torch import nn

    from ..aggregation import build_aggregator

    agg = build_aggregator("mean")
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    seconds = 0.0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in params]
        for g, o in zip(grads, agg(grads, comm)):
            if o is not g:
                g.copy_(o)
        opt.step()
        seconds += time.perf_counter() - t0
        if step in eval_at and curve is not None:
            curve[step] = evaluate(model)
    return seconds


def _evaluate(model, x, y) -> Dict[str, float]:
    import torch
    from torch import nn

    with torch.no_grad():
        logits = model(x)
        return {"loss": float(nn.functional.cross_entropy(logits, y)), "acc": float((logits.argmax(-1) == y).float().mean())}


def rank_main(seeds: List[int], steps: int, hidden: int, batch: int, lr: float, search: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of the benchmark (called through run_ranks)."""
    import torch
    import torch.distributed as dist

    from ..comm import TorchComm
    from ..init_search import search_init
    from ..models import digits_data
    from ..spawn import init_torch_distributed

    init_torch_distributed()
    comm = TorchComm()
    xtr, ytr, xte, yte = digits_data()
    shard = torch.arange(comm.rank, len(xtr), comm.size)  # each rank its own part of the training set
    xs, ys = xtr[shard], ytr[shard]
    out: Dict[str, List[Any]] = {"default": [], "searched": [], "same_time": [], "probe_seconds": [],
                                 "train_seconds": [], "winners": [], "extra_steps": [], "default_curve": [],
                                 "searched_curve": []}
    eval_at = {max(1, steps * k // 8) for k in (1, 2, 4, 8)}
    held_out = lambda m: _evaluate(m, xte, yte)
    for i, seed in enumerate(seeds):
        data_seed = 1000 * seed + comm.rank
        arms = ["default", "searched"] if i % 2 == 0 else ["searched", "default"]  # alternate: fair timing
        for arm in arms:
            model = _model(seed, hidden)
            comm.barrier()
            if arm == "searched":
                rep = search_init(model, torch.nn.functional.cross_entropy, _stream(xs, ys, batch, data_seed + 7),
                                  comm, {**search, "seed": seed})
                out["probe_seconds"].append(rep["probe_seconds"])
                out["winners"].append(rep["winner"]["scheme"] + f"x{rep['winner']['scale']}@r{rep['winner']['round']}")
            curve: Dict[int, Dict[str, float]] = {}
            secs = _train(model, _stream(xs, ys, batch, data_seed), steps, lr, comm, eval_at, held_out, curve)
            out["train_seconds"].append(secs)
            out[f"{arm}_curve"].append(curve)
            out[arm].append(_evaluate(model, xte, yte))
        # same wall time: default init, extra steps worth the probe's time
        extra = int(round(out["probe_seconds"][-1] / (max(out["train_seconds"][-2:]) / steps)))
        extra = int(comm.all_reduce_scalars([extra], "max")[0])
        model = _model(seed, hidden)
        _train(model, _stream(xs, ys, batch, data_seed), steps + extra, lr, comm)
        out["same_time"].append(_evaluate(model, xte, yte))
        out["extra_steps"].append(extra)
        if comm.rank == 0:
            log(f"seed {seed}: default {out['default'][-1]}  searched {out['searched'][-1]} "
                f"({out['winners'][-1]}, probe {out['probe_seconds'][-1]:.1f}s)  same-time(+{extra}) "
                f"{out['same_time'][-1]}")
    out["rank"] = dist.get_rank()
    return out


def _curve(curves: List[Dict[int, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """Mean held-out loss and accuracy at each evaluated step, over seeds."""
    return {str(k): {"loss": statistics.mean(c[k]["loss"] for c in curves), "acc": statistics.mean(c[k]["acc"] for c in curves)}
            for k in sorted(curves[0])}


def _summary(runs: List[Dict[str, float]]) -> Dict[str, Any]:
    loss = [r["loss"] for r in runs]
    acc = [r["acc"] for r in runs]
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0
    return {"mean_loss": statistics.mean(loss), "std": sd(loss), "mean_acc": statistics.mean(acc), "std_acc": sd(acc),
            "losses": loss, "accs": acc}


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("init-search", __doc__)
    ap.add_argument("--quick", action="store_true", help="2 seeds, few steps: a smoke run")
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (1-8)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=160, help="training steps after initialization")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--candidates", type=int, default=4, help="pdv.init_search.candidates (per rank per round)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--probe-steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.candidates, args.probe_steps = 2, 20, 2, 3
    if not 1 <= args.ranks <= 8:
        ap.error("--ranks must be between 1 and 8")
    check_ranges(ap, args, {"--seeds": 1, "--steps": 1, "--hidden": 1, "--batch": 1, "--candidates": 1,
                            "--rounds": 1, "--probe-steps": 1}, ["--lr", "--timeout"])
    from ..spawn import run_ranks

    search = {"candidates": args.candidates, "rounds": args.rounds, "probe_steps": args.probe_steps, "lr": args.lr}
    seeds = list(range(args.seeds))
    log(f"init-search bench: {args.ranks} ranks, seeds {seeds}, {args.steps} steps, search {search}")
    out = run_ranks("pdv_ext.bench.init_search:rank_main", args.ranks,
                    {"seeds": seeds, "steps": args.steps, "hidden": args.hidden, "batch": args.batch, "lr": args.lr,
                     "search": search}, timeout=args.timeout)
    r0 = next(r for r in out if r["rank"] == 0)
    default, searched, same = _summary(r0["default"]), _summary(r0["searched"]), _summary(r0["same_time"])
    result = {
        "seeds": seeds, "ranks": args.ranks, "steps": args.steps,
        "default": default, "searched": searched, "default_same_time": {**same, "extra_steps": r0["extra_steps"]},
        "probe_seconds": statistics.mean(r0["probe_seconds"]),
        "train_seconds": statistics.mean(r0["train_seconds"]),
        "loss_gain": default["mean_loss"] - searched["mean_loss"],
        "acc_gain": searched["mean_acc"] - default["mean_acc"],
        "loss_gain_vs_same_time": same["mean_loss"] - searched["mean_loss"],
        "searched_wins": sum(s < d for s, d in zip(searched["losses"], default["losses"])),
        "curve": {"default": _curve(r0["default_curve"]), "searched": _curve(r0["searched_curve"])},
        "winners": r0["winners"], "search": search,
    }
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
