"""`replan`: re-plan the pipeline while training when a device's measured speed leaves the plan's assumption.

The start-up mapper chose stage boundaries and rank placement for the cluster as described (or probed). When
a device slows down for good (it throttles, a neighbour's job shares it), that plan is wrong for the rest of
the job: in a pipeline the slow stage holds back every micro-batch of every replica. Per agreement step the
policy compares each rank's measured compute time per micro-batch with what the cost model predicts for its
layers on its device (the layer profile over the device's throughput): the median ratio calibrates the model
to this run (the profile's device is not these devices), and a rank whose ratio stays off the median by more
than `threshold` for `patience` agreement steps makes its device's throughput in the cluster model follow the
measurement. Then the same solver as start-up plans again (same number of stages) and the policy compares:

- the step the re-plan predicts with the step the current plan now gets (both from the cost model, in this
  run's seconds: scaled by how the measured step compared with the model's while the model held), times
  the remaining steps (`total_steps`), against the cost of moving (the last move's
  measured seconds; before any move `move_cost_steps` x the step time): it acts only when the saving is
  larger (the log line gives both numbers);
- with data-parallel replicas, a data-share split alone (`pdv_ext.policy.shares`, no move): when that
  predicts a step within `shares_margin` of the re-plan's, it is chosen instead (no move, no cost).

When the slowdown ends the measured speed comes back above the model's and the same rule moves the
pipeline back - believed only when the device carries at least `confirm_load` of the work it was measured
slow under: a throttled device given little work can run at full speed (a CPU quota or a power cap that the
light load never reaches), and taking that for a recovery moves the work back onto it, where it is slow
again (a re-plan back and forth every few steps). `decisions` records every choice with its predicted step times (calibrated seconds).
Needs `pdv.placement` with a cluster and a profile (the start-up planning's), or the `cluster` and `profile`
options.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional

from pydantic import Field

from ...config_base import StrictModel
from ...placement.cluster import Cluster
from ...placement.cost import evaluate
from ...placement.profile import Profile
from ...placement.solvers import solve
from ..base import Action, Policy, Replan, SetDataShares, TrainContext, register_policy
from ..shares import best_shares, predicted_step


@register_policy("replan")
class ReplanPolicy(Policy):

    class Options(StrictModel):
        #: a device is off when its measured speed differs from the model's by more than this factor
        threshold: float = Field(1.3, gt=1.0)
        #: agreement steps in a row a device must stay off before the policy plans again
        patience: int = Field(3, ge=1)
        #: weight of the past in the smoothed measured/predicted ratio per rank
        ema: float = Field(0.3, ge=0.0, lt=1.0)
        #: agreement steps ignored at the start and after every change
        warmup_steps: int = Field(2, ge=0)
        #: the run's length in steps (the saving is counted over what remains); None: `horizon_steps`
        total_steps: Optional[int] = Field(None, ge=1)
        horizon_steps: int = Field(200, ge=1)
        #: the move's cost before one was measured, in steps of the current step time
        move_cost_steps: float = Field(3.0, ge=0.0)
        #: take a data-share split instead of a move when it predicts a step within this fraction of it
        shares_margin: float = Field(0.05, ge=0.0)
        #: whether a data-share split may be chosen at all (needs data-parallel replicas)
        allow_shares: bool = True
        #: a device measured slow is believed recovered only when measured with at least this fraction of the
        #: work (its layers' profiled time) it was slow under
        confirm_load: float = Field(0.5, ge=0.0, le=1.0)
        #: override pdv.placement's cluster YAML / profile JSON
        cluster: Optional[str] = None
        profile: Optional[str] = None

    def __init__(self, options: Any = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        self.placement: Optional[Dict[str, Any]] = None
        self.cluster: Optional[Cluster] = None
        self.profile: Optional[Profile] = None
        self.plan: Optional[Dict[str, Any]] = None  # boundaries, rank_mapping in force
        self.ratios: Optional[List[float]] = None
        self.seen = 0
        self.streak = 0
        self.throughputs: Optional[List[float]] = None  # the cluster model's, as measured so far
        #: measured step time / the cost model's step time while the model held (its seconds -> the run's)
        self.step_calib: Optional[float] = None
        #: device -> the work per micro-batch (profile seconds) it carried when measured slow
        self.slow_load: Dict[int, float] = {}
        #: every change: {"step", "kind" (replan|shares), "predicted_before", "predicted_after", "saving",
        #: "move_cost", "throughputs", ...}
        self.decisions: List[Dict[str, Any]] = []

    # ---- set-up --------------------------------------------------------------------------------------
    def on_train_begin(self, ctx: TrainContext) -> None:
        pl = ctx.extra.get("placement")
        if pl is None:
            raise ValueError("replan: this framework has no pipeline placement to re-plan")
        self.placement = dict(pl)
        if self.plan is None:
            self.plan = {"boundaries": list(pl["boundaries"]), "rank_mapping": [list(r) for r in pl["rank_mapping"]]}

    def _load(self) -> None:
        if self.cluster is not None:
            return
        pl = self.placement or {}
        cluster, profile = self.options.cluster or pl.get("cluster"), self.options.profile or pl.get("profile")
        if not cluster or not profile:
            raise ValueError("replan: needs the cluster YAML and the layer profile of the start-up plan "
                             "(pdv.placement.cluster and .profile, or the policy's cluster/profile options)")
        self.cluster, self.profile = Cluster.load(cluster), Profile.load(profile)
        if self.throughputs is None:
            self.throughputs = [float(d.throughput) for d in self.cluster.devices]

    def _cluster_now(self) -> Cluster:
        """The cluster model with the measured throughputs."""
        return self.cluster.with_throughputs(self.throughputs, source="replan's cluster model")

    # ---- the model of a plan -----------------------------------------------------------------------
    def _stage_compute(self, cluster: Cluster, plan: Dict[str, Any]) -> Dict[int, float]:
        """Predicted forward+backward seconds per micro-batch of every rank under `plan` and `cluster`."""
        fb = self.profile.arrays()["fwd_bwd"]
        b = plan["boundaries"]
        out = {}
        for s, row in enumerate(plan["rank_mapping"]):
            work = float(fb[b[s]:b[s + 1]].sum())
            for r in row:
                out[int(r)] = work / cluster.speed(int(r))
        return out

    def _loads(self, plan: Dict[str, Any]) -> Dict[int, float]:
        """The work per micro-batch of every rank's layers under `plan` (profile seconds, any device)."""
        fb = self.profile.arrays()["fwd_bwd"]
        b = plan["boundaries"]
        return {int(r): float(fb[b[s]:b[s + 1]].sum()) for s, row in enumerate(plan["rank_mapping"]) for r in row}

    def _unconfirmed(self, off: List[float]) -> List[bool]:
        """Per rank: measured faster than the model while carrying too little work to show a slowdown it was
        measured under (see the module docstring): not evidence of a recovery."""
        loads = self._loads(self.plan)
        return [f < 1.0 and r in self.slow_load and loads[r] < self.options.confirm_load * self.slow_load[r]
                for r, f in enumerate(off)]

    def _replica_times(self, cluster: Cluster, plan: Dict[str, Any]) -> List[float]:
        """Seconds per micro-batch of every replica's slowest stage (the data-share formula's input)."""
        per = self._stage_compute(cluster, plan)
        rows = plan["rank_mapping"]
        return [max(per[int(rows[s][d])] for s in range(len(rows))) for d in range(len(rows[0]))]

    # ---- the decision ------------------------------------------------------------------------------
    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        compute = metrics.get("compute_times") or []
        shares = metrics.get("data_shares")
        replica_of = metrics.get("replica_of_rank")
        if not compute or not shares or not replica_of or any(not (c > 0) for c in compute) or self.plan is None:
            return []
        self._load()
        model = self._cluster_now()
        pred = self._stage_compute(model, self.plan)
        ratios = [compute[r] / shares[replica_of[r]] / pred[r] for r in range(len(compute))]
        self.seen += 1
        if self.seen <= self.options.warmup_steps:
            self.ratios = None
            return []
        a = self.options.ema
        self.ratios = ratios if self.ratios is None else [a * o + (1 - a) * n for o, n in zip(self.ratios, ratios)]
        calib = statistics.median(self.ratios)  # the model's seconds -> this run's seconds
        off = [rho / calib for rho in self.ratios]
        lim = math.log(self.options.threshold)
        off = [1.0 if skip else f for f, skip in zip(off, self._unconfirmed(off))]
        if not any(abs(math.log(f)) > lim for f in off):
            self.streak = 0
            # while the model holds: how this run's whole step relates to the cost model's (the profile's
            # device is not these devices, and the model leaves some per-step work out)
            step_time = float(metrics.get("step_time") or 0.0)
            if step_time > 0:
                pl = self.placement
                ratio = step_time / evaluate(self.profile, model, self.plan["boundaries"], self.plan["rank_mapping"],
                                             int(sum(shares)) // len(shares), pl.get("schedule", "1f1b"),
                                             pl.get("aggregator", "mean")).step_time
                self.step_calib = ratio if self.step_calib is None else a * self.step_calib + (1 - a) * ratio
            return []
        self.streak += 1
        if self.streak < self.options.patience:
            return []
        self.streak = 0
        # the cluster model follows the measurement for the devices that are off
        measured = [t / f if abs(math.log(f)) > lim else t for t, f in zip(self.throughputs, off)]
        loads = self._loads(self.plan)
        for r, (m, t) in enumerate(zip(measured, self.throughputs)):
            if m < t:
                self.slow_load[r] = loads[r]  # what it was slow under (a recovery must be seen under as much)
            elif m > t:
                self.slow_load.pop(r, None)
        return self._choose(metrics, measured, self.step_calib or calib)

    def _choose(self, metrics: Dict[str, Any], measured: List[float], calib: float) -> List[Action]:
        """`calib`: the cost model's seconds -> this run's (the step calibration, else the compute one)."""
        o = self.options
        before = self.throughputs
        self.throughputs = measured
        cluster = self._cluster_now()
        pl = self.placement
        stages, replicas = len(self.plan["rank_mapping"]), len(self.plan["rank_mapping"][0])
        total = int(sum(metrics["data_shares"]))
        mb = total // replicas
        step = int(metrics["step"])
        remaining = (o.total_steps - step) if o.total_steps is not None else o.horizon_steps
        now = evaluate(self.profile, cluster, self.plan["boundaries"], self.plan["rank_mapping"], mb,
                       pl.get("schedule", "1f1b"), pl.get("aggregator", "mean")).step_time * calib
        new = solve(pl.get("solver", "dp"), self.profile, cluster, stages, mb, schedule=pl.get("schedule", "1f1b"),
                    aggregator=pl.get("aggregator", "mean"), **pl.get("solver_options", {}))
        after = new.predicted_step_time * calib
        last = metrics.get("last_move") or {}
        step_time = float(metrics.get("step_time") or now)
        cost = float(last["seconds"]) if last.get("seconds") else o.move_cost_steps * step_time
        cost_kind = "measured" if last.get("seconds") else f"estimated as {o.move_cost_steps:g} steps"
        saving = (now - after) * max(remaining, 0)
        slow = [f"{self.cluster.devices[r].name} {m / t:.2f}x" for r, (m, t) in enumerate(zip(measured, before))
                if m != t]
        record = {"step": step, "predicted_before": now, "predicted_after": after, "saving": saving,
                  "move_cost": cost, "throughputs": list(measured), "remaining_steps": remaining}
        # the data-share alternative (no move), compared with the re-plan in the same formula
        if o.allow_shares and replicas > 1:
            t_now = self._replica_times(cluster, self.plan)
            split = best_shares(t_now, total, stages)
            t_new = self._replica_times(cluster, {"boundaries": new.boundaries, "rank_mapping": new.rank_mapping})
            by_shares = predicted_step(split, t_now, stages)
            by_move = predicted_step([total // replicas] * replicas, t_new, stages)
            if by_shares <= by_move * (1.0 + o.shares_margin) and split != list(metrics["data_shares"]):
                record.update(kind="shares", shares=split)
                self.decisions.append(record)
                self.seen = 0
                return [SetDataShares(None if len(set(split)) == 1 else tuple(split))]
        same = (new.boundaries == self.plan["boundaries"] and new.rank_mapping == self.plan["rank_mapping"])
        if same or saving <= cost:
            if not same:
                record.update(kind="kept", boundaries=new.boundaries, rank_mapping=new.rank_mapping)
                self.decisions.append(record)
            return []
        reason = (f"measured speeds {', '.join(slow)} of the model's; predicted step {now:.3f} s -> {after:.3f} s, "
                  f"saving {saving:.1f} s over {remaining} steps > move cost {cost:.1f} s ({cost_kind})")
        record.update(kind="replan", boundaries=new.boundaries, rank_mapping=new.rank_mapping, reason=reason)
        self.decisions.append(record)
        self.plan = {"boundaries": list(new.boundaries), "rank_mapping": [list(r) for r in new.rank_mapping]}
        self.ratios, self.seen = None, 0  # new layers on every device: measure afresh
        return [Replan(tuple(new.boundaries), tuple(tuple(r) for r in new.rank_mapping), reason=reason)]

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"plan": self.plan, "ratios": self.ratios, "seen": self.seen, "streak": self.streak,
                "throughputs": self.throughputs, "step_calib": self.step_calib, "decisions": list(self.decisions),
                "slow_load": dict(self.slow_load)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.plan, self.ratios = state.get("plan"), state.get("ratios")
        self.seen, self.streak = int(state.get("seen", 0)), int(state.get("streak", 0))
        self.throughputs = state.get("throughputs")
        self.step_calib = state.get("step_calib")
        self.decisions = list(state.get("decisions", []))
        self.slow_load = {int(r): float(w) for r, w in (state.get("slow_load") or {}).items()}
