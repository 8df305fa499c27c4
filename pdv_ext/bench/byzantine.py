"""`pdv bench byzantine`: held-out accuracy of data-parallel training under Byzantine ranks, per aggregator.

8 plain torch.distributed (gloo) ranks train a small MLP on scikit-learn's digits (plain SGD, LR decayed
linearly to zero), each on its own shard;
Q of them run an attack from `pdv.faults` (all built-in ones by default, or `--attack module:function`).
Every configuration (attack x Q x aggregator, plus the clean baseline) runs inside one 8-rank job, so
process start-up is paid once. Zeno scores with gradients of a trusted validation split carved out of the
training set; it, suspicion and trimmed_mean are told Q (b = k = Q), as in the literature. A run whose
aggregator meets NaN/Inf it cannot filter (mean, adasum) stops with the guard's error: its accuracy is
reported as null with the error.

Output: {"clean_accuracy", "results": [{"attack", "byzantine", "aggregator", "accuracy"[, "error"]}, ...],
"ranks", "steps"}.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from .common import check_ranges, emit, log, parser

ATTACKS = ["sign_flip", "gaussian", "bit_flip", "scaled", "label_flip"]
RANKS = 8


def aggregator_spec(name: str, q: int) -> Dict[str, Any]:
    if name == "zeno":
        return {"type": "zeno", "b": max(q, 1)}
    if name == "suspicion":
        return {"type": "suspicion", "k": max(q, 1)}
    if name == "trimmed_mean":
        return {"type": "trimmed_mean", "b": max(q, 1)}
    return {"type": name}


def _model(seed: int, hidden: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _accuracy(model, x, y) -> float:
    import torch

    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def rank_main(configs: List[Dict[str, Any]], steps: int, batch: int, lr: float, hidden: int,
              seed: int = 0) -> Optional[List[Dict[str, Any]]]:
    """Runs every configuration on this rank; rank 0 returns the results."""
    import torch
    import torch.nn.functional as F

    from ..aggregation import build_aggregator
    from ..aggregation.faults import FaultInjector, NonFiniteGradients, NonFiniteGuard
    from ..comm import TorchComm
    from ..models import digits_data
    from ..spawn import init_torch_distributed

    init_torch_distributed()
    comm = TorchComm()
    rank, world = comm.rank, comm.size
    x_tr, y_tr, x_te, y_te = digits_data(seed=seed)
    n_val = len(x_tr) // 10  # trusted validation split (Zeno), never trained on
    x_val, y_val = x_tr[:n_val], y_tr[:n_val]
    x_sh, y_sh = x_tr[n_val:][rank::world], y_tr[n_val:][rank::world]
    out: List[Dict[str, Any]] = []
    for ci, cfg in enumerate(configs):
        t0 = time.perf_counter()
        model = _model(seed, hidden)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=lr)
        agg = build_aggregator(cfg["spec"])
        faults = cfg.get("faults")
        injector = FaultInjector(faults, rank) if faults else None
        guard = NonFiniteGuard()
        gen = torch.Generator().manual_seed(1000 * ci + rank + 7)
        vgen = torch.Generator().manual_seed(1000 * ci + rank + 99991)
        if getattr(agg, "needs_validation", False):
            def validation_fn():
                idx = torch.randint(0, n_val, (batch,), generator=vgen)
                loss = F.cross_entropy(model(x_val[idx]), y_val[idx])
                return list(torch.autograd.grad(loss, params))
            agg.validation_fn = validation_fn
        error = None
        for step in range(steps):
            idx = torch.randint(0, len(x_sh), (batch,), generator=gen)
            y = y_sh[idx]
            if injector is not None:
                y = injector.flip_labels(y, step)
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x_sh[idx]), y).backward()
            grads = [p.grad for p in params]
            if injector is not None:
                injector.corrupt(grads, comm, step)
            try:
                out_grads = guard.run(agg, grads, comm, step=step)
            except NonFiniteGradients as exc:
                error = str(exc)
                break
            for p, g in zip(params, out_grads):
                if g is not p.grad:
                    p.grad.copy_(g)
            for group in opt.param_groups:  # linear decay to zero: the final accuracy is less noisy
                group["lr"] = lr * (1 - step / steps)
            opt.step()
        acc = None if error else _accuracy(model, x_te, y_te)
        if acc is not None and not all(bool(torch.isfinite(p).all()) for p in params):
            acc, error = None, "weights became non-finite"
        row = {k: cfg[k] for k in ("attack", "byzantine", "aggregator")}
        row["accuracy"] = acc
        if error:
            row["error"] = error.split(";")[0]
        out.append(row)
        if rank == 0:
            log(f"[{ci + 1}/{len(configs)}] {row['attack']:<10} Q={row['byzantine']} {row['aggregator']:<12} "
                f"acc={acc if acc is None else round(acc, 4)}  ({time.perf_counter() - t0:.1f}s)")
    return out if rank == 0 else None


def build_configs(attacks: List[str], qs: List[int], aggregators: List[str]) -> List[Dict[str, Any]]:
    configs = [{"attack": "none", "byzantine": 0, "aggregator": "mean", "spec": {"type": "mean"}, "faults": None}]
    for attack in attacks:
        for q in qs:
            byz = list(range(1, 1 + q))
            for name in aggregators:
                configs.append({"attack": attack, "byzantine": q, "aggregator": name,
                                "spec": aggregator_spec(name, q),
                                "faults": {"byzantine_ranks": byz, "attack": attack, "seed": q}})
    return configs


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("byzantine", __doc__)
    ap.add_argument("--attack", action="append", help="attack name or module:function (repeatable; default: all built-in)")
    ap.add_argument("--byzantine", type=int, action="append", help="Byzantine ranks out of 8 (repeatable; default 1, 2, 3)")
    ap.add_argument("--aggregators", default=None, help="comma-separated (default: mean,adasum,zeno,suspicion,median,trimmed_mean)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 attacks, Q=1, 3 aggregators, 30 steps")
    ap.add_argument("--ranks", type=int, default=RANKS, help="data-parallel ranks (8 for the reported numbers)")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    # 3 ranks at least: one Byzantine rank must be a minority (and checked before any rank starts)
    check_ranges(ap, args, {"--ranks": 3, "--steps": 1, "--batch": 1, "--hidden": 1}, ["--lr", "--timeout"])

    from ..aggregation import AGGREGATORS
    from ..aggregation.faults_config import FaultsConfig
    from ..config_base import ConfigError
    from ..spawn import run_ranks

    default_aggs = ["mean", "adasum", "zeno", "suspicion", "median", "trimmed_mean"]
    aggs = args.aggregators.split(",") if args.aggregators else [a for a in default_aggs if a in AGGREGATORS.names()]
    attacks = args.attack or (["sign_flip", "gaussian"] if args.quick else ATTACKS)
    qs = args.byzantine or ([1] if args.quick else [1, 2, 3])
    steps = 30 if args.quick and args.steps == 60 else args.steps
    if args.quick and not args.aggregators:
        aggs = ["mean", "zeno", "median"]
    errors = []
    for a in attacks:  # clear errors before any rank starts
        try:
            FaultsConfig(attack=a)
        except Exception as exc:  # pydantic ValidationError
            errors.append(f"--attack: {exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}")
    for q in qs:
        if not 0 < q < args.ranks / 2:
            errors.append(f"--byzantine: {q} must be between 1 and {(args.ranks - 1) // 2}")
    for name in aggs:
        if name not in AGGREGATORS:
            errors.append(f"--aggregators: unknown aggregator '{name}'")
    if errors:
        raise SystemExit("\n".join(errors))
    configs = build_configs(attacks, qs, aggs)
    log(f"byzantine: {len(configs)} runs x {steps} steps on {args.ranks} ranks ({', '.join(aggs)})")
    t0 = time.perf_counter()
    res = run_ranks("pdv_ext.bench.byzantine:rank_main", args.ranks,
                    {"configs": configs, "steps": steps, "batch": args.batch, "lr": args.lr, "hidden": args.hidden},
                    timeout=args.timeout)[0]
    clean = res[0]["accuracy"]
    result = {"clean_accuracy": clean, "results": res[1:], "ranks": args.ranks, "steps": steps,
              "seconds": round(time.perf_counter() - t0, 1)}
    emit(result, args.json)
    return 0
