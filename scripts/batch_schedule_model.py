#!/usr/bin/env python3
"""What a batch-size schedule can gain over the best fixed batch, on a model where the answer is exact (issue #36).

Noisy linear regression (isotropic Gaussian inputs in `--dim` dimensions, label noise of variance 1), trained by
SGD to an excess loss `--target` times the initial one. In expectation, with e = E|w - w*|^2, one step of batch B and
learning rate eta gives  e' = (1 - eta)^2 e + eta^2 / B ((d + 1) e + d),  so every run below is computed, not
sampled. A step of B samples takes k + B time units (`--knee` k: the fixed part of a step, in samples; a pipeline's
bubble or a slow link's exchange makes it large). The gradient noise scale here is about d / e: it grows without
bound as the run nears the noise floor, which is the regime where a growing batch is said to pay.

Three ways to the target, each with the learning rates that suit it best:
- `fixed_one_lr`: the best fixed batch, with the best constant learning rate for that batch;
- `fixed_lr_decay`: the best fixed batch with the best learning rate at every step (greedy: the most progress
  per time unit; an ideal decay);
- `schedule`: the batch free to change at every step, chosen with its learning rate the same greedy way.
`schedule_vs_fixed_lr_decay` says what a batch schedule adds to a good LR schedule; the greedy choice is not
optimal, so a ratio a few percent above 1 means "nothing".

    python scripts/batch_schedule_model.py --json
"""
from __future__ import annotations

import argparse
import json
import math
from typing import List, Optional, Tuple

ETAS = [10 ** (-4 + 4 * i / 120) for i in range(120)]  # learning rates tried, 1e-4 .. ~0.93
BATCHES = [2 ** i for i in range(13)]  # 1 .. 4096


def step(e: float, batch: int, eta: float, d: int) -> float:
    return (1 - eta) ** 2 * e + eta * eta / batch * ((d + 1) * e + d)


def fixed_one_lr(batch: int, target: float, d: int, e0: float) -> float:
    """Steps to the target at one batch and its best constant learning rate (inf: never)."""
    best = math.inf
    for eta in ETAS:
        e, n = e0, 0
        while e > target and n < 200000:
            e2 = step(e, batch, eta, d)
            if e2 >= e:  # the noise floor of this (batch, lr) is above the target
                n = 200000
                break
            e, n = e2, n + 1
        if e <= target:
            best = min(best, n)
    return best


def greedy(batches: List[int], target: float, d: int, e0: float, knee: float) -> Tuple[float, List[int]]:
    """Time to the target when each step takes the (batch, lr) with the most log-progress per time unit."""
    e, t, trace = e0, 0.0, []
    while e > target:
        best: Optional[Tuple[float, int, float]] = None
        for b in batches:
            for eta in ETAS:
                e2 = step(e, b, eta, d)
                if e2 < e:
                    r = math.log(e / e2) / (knee + b)
                    if best is None or r > best[0]:
                        best = (r, b, e2)
        if best is None:
            return math.inf, trace
        t, e = t + knee + best[1], best[2]
        trace.append(best[1])
    return t, trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--knee", type=float, nargs="+", default=[16.0, 64.0])
    ap.add_argument("--target", type=float, nargs="+", default=[1e-3, 1e-4],
                    help="excess loss to reach, as a fraction of the initial one")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    a = ap.parse_args()
    e0 = float(a.dim)  # |w*|^2 = d: the noise scale starts near 1 sample
    rows = []
    for knee in a.knee:
        for frac in a.target:
            target = e0 * frac
            one = {b: fixed_one_lr(b, target, a.dim, e0) * (knee + b) for b in BATCHES}
            decay = {b: greedy([b], target, a.dim, e0, knee)[0] for b in BATCHES}
            sched, trace = greedy(BATCHES, target, a.dim, e0, knee)
            b_one, b_decay = min(one, key=one.get), min(decay, key=decay.get)
            rows.append({"knee": knee, "target": frac,
                         "fixed_one_lr": {"batch": b_one, "time": one[b_one]},
                         "fixed_lr_decay": {"batch": b_decay, "time": decay[b_decay]},
                         "schedule": {"time": sched, "first_batch": trace[0], "last_batch": trace[-1]},
                         "schedule_vs_fixed_one_lr": round(sched / one[b_one], 3),
                         "schedule_vs_fixed_lr_decay": round(sched / decay[b_decay], 3)})
            r = rows[-1]
            print(f"knee {knee:g}, excess to {frac:g}: fixed batch {b_one} at one LR {one[b_one]:.0f}; fixed batch "
                  f"{b_decay} with the best LR each step {decay[b_decay]:.0f}; batch schedule ({trace[0]} -> "
                  f"{trace[-1]}) {sched:.0f}: {r['schedule_vs_fixed_one_lr']} of the first, "
                  f"{r['schedule_vs_fixed_lr_decay']} of the second", flush=True)
    if a.json:
        print(json.dumps({"dim": a.dim, "runs": rows}))


if __name__ == "__main__":
    main()
