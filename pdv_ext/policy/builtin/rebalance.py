"""`rebalance`: give each data-parallel replica the share of the global batch that fits its measured speed.

Synchronous data parallelism runs at the speed of its slowest replica: when a device slows down (it
throttles, a neighbour's job shares it), every replica waits for it. From the Monitor's per-rank compute
time (forward + backward) and each replica's current share, the policy estimates every replica's time per
micro-batch (its slowest stage's), smooths it (`ema`), and computes the split of the step's micro-batches
that makes the replicas finish together (`pdv_ext.policy.shares.best_shares`). It changes the shares only
when the predicted step time drops by at least `threshold` (default 5%) on `patience` agreement steps in a
row (the split of the last of them is taken), so noise does not churn them; when the slowdown ends, the equal split wins the same way and the
shares go back. The global batch, and so the gradient, stay the same (the aggregator weighs the replicas
by their samples): only the wall time changes.

A reading `shift` off a replica's smoothed time restarts its smoothing (an event, not noise: a second
slowdown or a recovery while a split is in force moves the best split by a micro-batch or two, whose gain the
EMA's lag would hide for several agreement steps); every change of shares, plan or batch announced by the
runner (`on_change`: its own or another policy's) restarts the times and the streak.

Decisions are logged in `decisions` (step, shares, predicted step times) for benchmarks and plots.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from pydantic import Field

from ...config_base import StrictModel
from ..base import Action, Change, Policy, SetDataShares, register_policy
from ..shares import best_shares, predicted_step
from ..smoothing import ema, patient


@register_policy("rebalance")
class Rebalance(Policy):

    class Options(StrictModel):
        #: act when the predicted step time drops by at least this fraction
        threshold: float = Field(0.05, gt=0.0, lt=1.0)
        #: agreement steps in a row that must predict that gain before the shares change
        patience: int = Field(2, ge=1)
        #: weight of the past in the smoothed time per micro-batch (0: the last agreement step only)
        ema: float = Field(0.3, ge=0.0, lt=1.0)
        #: agreement steps to ignore at the start (allocator, caches and JIT warming up)
        warmup_steps: int = Field(2, ge=0)
        #: fewest micro-batches a replica keeps (a replica with none would leave its devices idle)
        min_share: int = Field(1, ge=1)
        #: a replica whose latest time per micro-batch is this factor off its smoothed one has changed speed (a
        #: slowdown or a recovery): its smoothing restarts at the reading (the EMA filters noise, not events)
        shift: float = Field(1.5, gt=1.0)

    def __init__(self, options: Any = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        self.times: Optional[List[float]] = None  # smoothed seconds per micro-batch, per replica
        #: smoothed seconds of the step that no split changes (communication, optimizer, the pipeline's waits)
        self.rest: Optional[float] = None
        self.seen = 0
        self.streak = 0
        self.wanted: Optional[List[int]] = None
        #: every change: {"step", "shares", "predicted_before", "predicted_after", "times"}
        self.decisions: List[Dict[str, Any]] = []

    def replica_times(self, metrics: Dict[str, Any]) -> Optional[List[float]]:
        """Seconds per micro-batch of every replica's slowest stage, from this window's compute times."""
        compute = metrics.get("compute_times") or []
        shares = metrics.get("data_shares")
        replica_of = metrics.get("replica_of_rank")
        if not compute or not shares or not replica_of or len(replica_of) != len(compute):
            return None
        if any(not (c > 0) for c in compute):
            return None
        times = [0.0] * len(shares)
        for r, c in enumerate(compute):
            d = replica_of[r]
            times[d] = max(times[d], c / shares[d])
        return times if all(t > 0 for t in times) else None

    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        times = self.replica_times(metrics)
        if times is None:
            return []
        self.seen += 1
        if self.seen <= self.options.warmup_steps:
            return []
        self.times = self._smooth(times)
        shares = [int(n) for n in metrics["data_shares"]]
        stages = max(metrics.get("stage_of_rank") or [0]) + 1
        best = best_shares(self.times, sum(shares), stages, self.options.min_share)
        now, then = predicted_step(shares, self.times, stages), predicted_step(best, self.times, stages)
        # what the split cannot change (communication, optimizer, the pipeline's waits) stays in the step:
        # smoothed like the times it is set against (one noisy step time must not decide the gain)
        measured = float(metrics.get("step_time") or 0.0)
        if measured > 0:
            self.rest = ema(self.rest, max(0.0, measured - predicted_step(shares, times, stages)), self.options.ema)
        rest = self.rest or 0.0
        gain = (now - then) / (now + rest) if now > 0 else 0.0
        if best == shares or gain < self.options.threshold:
            self.streak, self.wanted = 0, None
            return []
        # the streak counts agreement steps on which *a* change pays: while the smoothed times catch up with
        # a slowdown the best split may still move by a micro-batch, the latest one is taken
        self.streak, act = patient(self.streak, self.options.patience)
        self.wanted = best
        if not act:
            return []
        self.wanted = None
        self.decisions.append({"step": int(metrics["step"]), "shares": best, "predicted_before": now + rest,
                               "predicted_after": then + rest, "times": list(self.times)})
        return [SetDataShares(None if len(set(best)) == 1 else tuple(best))]

    def _smooth(self, times: List[float]) -> List[float]:
        """The EMA of the replicas' times per micro-batch, restarted at the reading for a replica whose reading
        is `shift` off its smoothed time: a slowdown or a recovery is seen at its full size on its first
        agreement step, whatever else is in force, instead of over the EMA's several."""
        if self.times is None or len(self.times) != len(times):
            return [float(t) for t in times]
        out = ema(self.times, times, self.options.ema)
        lim = math.log(self.options.shift)
        return [float(t) if abs(math.log(t / old)) > lim else o for t, old, o in zip(times, self.times, out)]

    def on_change(self, change: Change) -> None:
        """New shares, a move, a new batch or a checkpoint's other split: the per-replica times were measured
        under the old work (a replica's time per micro-batch is not the same under another share or plan), the
        streak counted gains over the old split. Both restart after `warmup_steps` readings: the first steps
        under new work carry its transients (the iterator re-sliced, buffers re-shaped), which a fresh start
        would take for the replicas' speeds."""
        if change.moves_work:
            self.times, self.rest, self.streak, self.wanted, self.seen = None, None, 0, None, 0

    def state_dict(self) -> Dict[str, Any]:
        return {"times": self.times, "rest": self.rest, "seen": self.seen, "streak": self.streak,
                "wanted": self.wanted, "decisions": list(self.decisions)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rest = state.get("rest")
        self.times, self.seen = state.get("times"), int(state.get("seen", 0))
        self.streak, self.wanted = int(state.get("streak", 0)), state.get("wanted")
        self.decisions = list(state.get("decisions", []))
