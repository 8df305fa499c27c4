"""`pdv bench convergence`: Adasum vs mean at a large effective batch.

8 plain torch.distributed (gloo) ranks train the same small MLP on scikit-learn's digits; every rank draws
its own batch from the same training set (effective batch = 8 x --batch). For each aggregator the same
learning-rate grid is searched (plain SGD, constant LR); a run counts the optimizer steps until the loss on
the whole training set, evaluated every --eval-every steps, reaches --target. The best LR of each
aggregator is reported. All runs share one 8-rank job.

Output: {"mean_steps_to_target", "adasum_steps_to_target", "target_loss", "mean_best_lr", "adasum_best_lr",
"grid": [{"aggregator", "lr", "steps_to_target", "final_loss"}, ...], "effective_batch", "max_steps"}
(steps_to_target is null when the target was not reached within --max-steps).
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional

from .common import check_ranges, emit, log, parser

RANKS = 8


def rank_main(runs: List[Dict[str, Any]], batch: int, max_steps: int, target: float, eval_every: int,
              hidden: int, seed: int = 0) -> Optional[List[Dict[str, Any]]]:
    import torch
    import torch.nn.functional as F

    from ..aggregation import build_aggregator
    from ..aggregation.faults import NonFiniteGradients, NonFiniteGuard
    from ..comm import TorchComm
    from ..models import digits_data
    from ..spawn import init_torch_distributed
    from .byzantine import _model

    init_torch_distributed()
    comm = TorchComm()
    x_tr, y_tr, _, _ = digits_data(seed=seed)
    out = []
    for ri, run in enumerate(runs):
        t0 = time.perf_counter()
        model = _model(seed, hidden)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=run["lr"])
        agg = build_aggregator(run["aggregator"])
        guard = NonFiniteGuard()
        gen = torch.Generator().manual_seed(1000 * ri + comm.rank + 13)
        reached, loss_now = None, float("nan")
        for step in range(1, max_steps + 1):
            idx = torch.randint(0, len(x_tr), (batch,), generator=gen)
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
            try:
                grads = guard.run(agg, [p.grad for p in params], comm, step=step)
            except NonFiniteGradients:
                loss_now = float("nan")
                break
            for p, g in zip(params, grads):
                if g is not p.grad:
                    p.grad.copy_(g)
            opt.step()
            if step % eval_every == 0:
                with torch.no_grad():  # identical on every rank: the replicas are identical
                    loss_now = float(F.cross_entropy(model(x_tr), y_tr))
                if not loss_now == loss_now or loss_now > 1e6:
                    break
                if loss_now <= target:
                    reached = step
                    break
        row = {"aggregator": run["aggregator"], "lr": run["lr"], "steps_to_target": reached,
               "final_loss": loss_now if loss_now == loss_now else None}
        out.append(row)
        if comm.rank == 0:
            log(f"[{ri + 1}/{len(runs)}] {row['aggregator']:<7} lr={row['lr']:<5} steps={reached} "
                f"loss={loss_now:.4f} ({time.perf_counter() - t0:.1f}s)")
    return out if comm.rank == 0 else None


def best(rows: List[Dict[str, Any]], name: str):
    done = [r for r in rows if r["aggregator"] == name and r["steps_to_target"] is not None]
    if not done:
        return None, None
    r = min(done, key=lambda r: (r["steps_to_target"], r["lr"]))
    return r["steps_to_target"], r["lr"]


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("convergence", __doc__)
    ap.add_argument("--lrs", default="0.5,1,2,4,8", help="comma-separated learning-rate grid (same for both)")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--target", type=float, default=0.1, help="training-set loss to reach")
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="smoke run: LRs 0.5,1; target 0.5; 60 steps")
    ap.add_argument("--ranks", type=int, default=RANKS, help="data-parallel ranks (8 for the reported numbers)")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    check_ranges(ap, args, {"--ranks": 1, "--batch": 1, "--max-steps": 1, "--eval-every": 1, "--hidden": 1},
                 ["--target", "--timeout"])
    try:
        grid = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        ap.error(f"--lrs {args.lrs!r}: expected comma-separated numbers, e.g. 0.5,1,2")
    if not all(math.isfinite(lr) and lr > 0 for lr in grid):
        ap.error(f"--lrs {args.lrs!r}: every learning rate must be a finite number > 0")

    from ..aggregation import AGGREGATORS
    from ..spawn import run_ranks

    if "adasum" not in AGGREGATORS.names():
        raise SystemExit("pdv bench convergence: the 'adasum' aggregator is not available in this build")
    lrs = [0.5, 1.0] if args.quick and args.lrs == "0.5,1,2,4,8" else grid
    target = 0.5 if args.quick and args.target == 0.1 else args.target
    max_steps = 60 if args.quick and args.max_steps == 200 else args.max_steps
    runs = [{"aggregator": a, "lr": lr} for lr in lrs for a in ("mean", "adasum")]  # alternate the two
    log(f"convergence: {len(runs)} runs, effective batch {args.ranks * args.batch}, target loss {target}")
    rows = run_ranks("pdv_ext.bench.convergence:rank_main", args.ranks,
                     {"runs": runs, "batch": args.batch, "max_steps": max_steps, "target": target,
                      "eval_every": args.eval_every, "hidden": args.hidden}, timeout=args.timeout)[0]
    m_steps, m_lr = best(rows, "mean")
    a_steps, a_lr = best(rows, "adasum")
    emit({"mean_steps_to_target": m_steps, "adasum_steps_to_target": a_steps, "target_loss": target,
          "mean_best_lr": m_lr, "adasum_best_lr": a_lr, "grid": rows, "effective_batch": args.ranks * args.batch, "ranks": args.ranks,
          "max_steps": max_steps}, args.json)
    return 0
