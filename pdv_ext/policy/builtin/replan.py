"""`replan`: re-plan the pipeline while training when a device's measured speed leaves the plan's assumption.

The start-up mapper chose stage boundaries and rank placement for the cluster as described (or probed). When
a device slows down for good (it throttles, a neighbour's job shares it), that plan is wrong for the rest of
the job: in a pipeline the slow stage holds back every micro-batch of every replica. Per agreement step the
policy compares each rank's measured compute time per micro-batch with what the cost model predicts for its
layers on its device (the layer profile over the device's throughput): the median ratio calibrates the model
to this run (the profile's device is not these devices), and a rank whose ratio stays off the median by more
than `threshold` for `patience` agreement steps makes its device's throughput in the cluster model follow the
measurement. Before it plans, the measured step time says how slow that device is in effect: a slowed
device's communication and optimizer step slow down too, so when the step is slower than the model makes it
with the compute times' speeds, the device is slowed further, as the step sees it (`step_factor`, fitted to
the step). Then the same solver as start-up plans again - at the same pipeline depth, and (`change_depth`) at
every other depth the ranks and the global batch divide into - and the policy compares:

- the step the re-plan predicts with the step the current plan now gets (both from the cost model, in this
  run's seconds: scaled by how the measured step compared with the model's while the model held, when that
  is beyond `calib_band`), times the remaining steps (`total_steps`), against the cost of moving (the last
  move's measured seconds; before any move `move_cost_steps` x the step time): it acts only when the saving
  is larger (the log line gives both numbers) and the predicted step is at least `min_gain` faster (less is
  within the model's accuracy: as likely a loss);
- with data-parallel replicas, a data-share split alone (`pdv_ext.policy.shares`, no move): when that
  predicts a step within `shares_margin` of the best re-plan's, it is chosen instead (no move, no cost);
- another depth is trusted only as far as the model ranks depths on the cluster as described: the start-up
  depth is taken to be the best there (the user or the mapper chose it), so another depth's prediction counts
  at least its described-cluster ratio to the start-up depth's. A calm cluster never changes depth, and a
  change of depth is made for the slowdown, not for the model's own preferences (a pipe 2 x data 2 plan with
  one slow device moves to pipe 4 when the slow device then carries only a light stage).

When the slowdown ends the measured speed comes back above the model's and the same rule moves the
pipeline back, with two guards against re-planning back and forth: a device is never modelled faster than
the cluster description says (a faster reading there is the profile's and the measurement's noise), and a
device measured slow is measured again only while it carries at least `confirm_load` of the work it was
slow under (a throttled device given little work can run at full speed - a CPU quota or a power cap that
the light load never reaches - and taking that for a recovery moves the work back where it is slow again;
or a millisecond of work waits for the next quota period, and taking that for a further slowdown moves
what little it has for nothing).
The plan in force follows every applied move or shares change, whoever decided it (`on_change`), and the
measurements taken under the old work restart.
`decisions` records every choice with its predicted step times (calibrated seconds).
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
from ...placement.plan import Layout
from ...placement.solvers import solve
from ..base import Action, Change, Policy, Replan, SetDataShares, TrainContext, register_policy
from ..shares import best_shares
from ..smoothing import ema, patient


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
        #: a change must predict a step at least this fraction faster than the step now (the cost model's
        #: accuracy: a smaller predicted gain is as likely a loss, and a move costs steps)
        min_gain: float = Field(0.1, ge=0.0, lt=1.0)
        #: whether a data-share split may be chosen at all (needs data-parallel replicas)
        allow_shares: bool = True
        #: after a change, a measured step above the model's prediction by more than this factor (for `patience`
        #: agreement steps) fits the slow devices' speed to the step and plans again
        step_tolerance: float = Field(1.1, gt=1.0)
        #: whether a re-plan may change the pipeline depth (number of stages; the global batch is kept)
        change_depth: bool = True
        #: a device measured slow is measured again (recovered or slower) only while it carries at least this
        #: fraction of the work (its layers' profiled time) it was slow under
        confirm_load: float = Field(0.5, ge=0.0, le=1.0)
        #: the calm steps' median ratio to the cost model's step within this fraction of 1 is taken for the model's
        #: accuracy and the machine's drift, and the profile's seconds are used as they are; beyond it (a profile
        #: of another device, a predicted one, work the model leaves out) the ratio calibrates the model
        calib_band: float = Field(0.25, ge=0.0)
        #: the latest calm agreement steps that ratio is the median of
        calib_window: int = Field(32, ge=1)
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
        #: measured step time / the cost model's step time while the model held (the latest `calib_window`)
        self.calm_ratios: List[float] = []
        #: device -> the work per micro-batch (profile seconds) it carried when measured slow
        self.slow_load: Dict[int, float] = {}
        #: smoothed measured step time (this run's seconds) since the last change
        self.step_ema: Optional[float] = None
        #: device -> how much slower the step sees it than its compute times do (<= 1; fitted to the step)
        self.step_factor: Dict[int, float] = {}
        #: the depth of the start-up plan, and each depth's best predicted step on the cluster as described
        self.start_stages: Optional[int] = None
        self.described: Dict[int, float] = {}
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
            self.plan = Layout.from_dict(pl).to_dict()
        if self.start_stages is None:
            self.start_stages = len(self.plan["rank_mapping"])

    def _load(self) -> None:
        if self.cluster is not None:
            return
        pl = self.placement or {}
        cluster, profile = self.options.cluster or pl.get("cluster"), self.options.profile or pl.get("profile")
        if not cluster or not profile:
            raise ValueError("replan: needs the cluster YAML and the layer profile of the start-up plan "
                             "(pdv.placement.cluster and .profile, or the policy's cluster/profile options)")
        self.cluster, self.profile = Cluster.load(cluster), Profile.load(profile)
        names = pl.get("devices")  # the device under each rank (a restart on the devices left: fewer)
        if names and [d.name for d in self.cluster.devices] != list(names):
            where = self.cluster.devices_named(list(names))
            if where is None:
                raise ValueError(f"replan: the ranks' devices {list(names)} are not all in {cluster}")
            self.cluster = self.cluster.subset(where, source=f"{cluster} (the devices under the ranks)")
        if self.throughputs is None:
            self.throughputs = [float(d.throughput) for d in self.cluster.devices]

    def _effective(self, throughputs: List[float]) -> List[float]:
        """The devices' speeds as the whole step sees them: the compute view times the step's own factor."""
        return [t * self.step_factor.get(r, 1.0) for r, t in enumerate(throughputs)]

    def _cluster_now(self) -> Cluster:
        """The cluster model that plans: the measured throughputs, as the step sees them."""
        return self.cluster.with_throughputs(self._effective(self.throughputs), source="replan's cluster model")

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

    def _no_evidence(self, off: List[float]) -> List[bool]:
        """Per rank: its reading says nothing here - measured faster than the model while the device is at its
        described speed already (the policy follows slowdowns and recoveries, never beyond the cluster's
        description: a faster reading there is the profile's and the measurement's noise), or the device was
        measured slow and now carries too little work for its compute time to show its speed, either way (see
        the module docstring: a light load can escape a quota, or wait a whole quota period for a millisecond
        of work; the step-time check still sees what such a device costs the step)."""
        loads = self._loads(self.plan)
        return [(f < 1.0 and self.throughputs[r] >= self.cluster.devices[r].throughput)
                or (r in self.slow_load and loads[r] < self.options.confirm_load * self.slow_load[r])
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
        # compute against compute: the throughputs as the compute times measured them (no step factor)
        pred = self._stage_compute(self.cluster.with_throughputs(self.throughputs), self.plan)
        ratios = [compute[r] / shares[replica_of[r]] / pred[r] for r in range(len(compute))]
        self.seen += 1
        if self.seen <= self.options.warmup_steps:
            self.ratios = self.step_ema = None
            return []
        self.ratios = ema(self.ratios, ratios, self.options.ema)
        step_time = float(metrics.get("step_time") or 0.0)
        if step_time > 0:
            self.step_ema = ema(self.step_ema, step_time, self.options.ema)
        calib = statistics.median(self.ratios)  # the model's seconds -> this run's seconds
        off = [rho / calib for rho in self.ratios]
        lim = math.log(self.options.threshold)
        off = [1.0 if skip else f for f, skip in zip(off, self._no_evidence(off))]
        # off only while the latest reading agrees (the smoothing would stretch a short blip past `patience`)
        off = [f if abs(math.log(f)) <= lim or (abs(math.log(rho / calib)) > lim and (rho / calib > 1) == (f > 1))
               else 1.0 for f, rho in zip(off, ratios)]
        if not any(abs(math.log(f)) > lim for f in off):
            model_step = self._model_step(self._effective(self.throughputs), shares)
            if not self.slow_load:
                self.streak = 0
                # while the cluster is as described: how this run's whole step relates to the cost model's
                # (the profile's device is not these devices, and the model leaves some per-step work out)
                if step_time > 0:
                    self.calm_ratios = (self.calm_ratios + [step_time / model_step])[-self.options.calib_window:]
                return []
            # a device is modelled slow: does the model explain the measured step? (a slow device costs more
            # than its compute where its communication and optimizer step slow down too)
            if (self.step_calib is None or self.step_ema is None
                    or self.step_ema <= model_step * self.step_calib * self.options.step_tolerance):
                self.streak = 0
                return []
            self.streak, act = patient(self.streak, self.options.patience)
            if not act:
                return []
            before = self._effective(self.throughputs)
            self._fit_step(sorted(self.slow_load), shares)
            return self._choose(metrics, list(self.throughputs), self.step_calib, before)
        self.streak, act = patient(self.streak, self.options.patience)
        if not act:
            return []
        # the cluster model follows the measurement for the devices that are off
        measured = [min(t / f, float(d.throughput)) if abs(math.log(f)) > lim else t
                    for t, f, d in zip(self.throughputs, off, self.cluster.devices)]
        loads = self._loads(self.plan)
        before = self._effective(self.throughputs)
        slower = [r for r, (m, t) in enumerate(zip(measured, self.throughputs)) if m < t]
        for r, (m, t) in enumerate(zip(measured, self.throughputs)):
            if m != t:
                self.step_factor.pop(r, None)  # a new reading: the step's view is checked again from here
            if m < t:
                self.slow_load[r] = loads[r]  # what it was slow under (a recovery must be seen under as much)
            elif m > t:
                self.slow_load.pop(r, None)
        self.throughputs = measured
        if slower and self.step_calib is not None and self.step_ema is not None:
            self._fit_step(slower, shares)  # how slow the newly slow devices are as the step sees them
        return self._choose(metrics, measured, self.step_calib or calib, before)

    @property
    def step_calib(self) -> Optional[float]:
        """The cost model's seconds -> this run's, from the calm steps (None before any): their median ratio,
        or 1 within `calib_band` of 1. A short calm stretch on a machine whose speed wanders (the emulated
        cluster's drifts 10-20% over a minute with nothing changed) would carry its passing state into every
        later prediction; the profile, measured on these devices, is the steadier guess unless the run says it
        is far off."""
        if not self.calm_ratios:
            return None
        med = statistics.median(self.calm_ratios)
        return 1.0 if abs(math.log(med)) <= math.log1p(self.options.calib_band) else med

    def _model_step(self, throughputs: List[float], shares: List[int]) -> float:
        """The cost model's step time (its seconds) for the plan in force with these (effective) throughputs
        and data `shares` (micro-batches per replica). Unequal shares: every replica's pipeline on its own with
        its share, the slowest one, then the step's tail (gradient reduction and optimizer step) of the whole
        plan."""
        pl = self.placement
        cluster = self.cluster.with_throughputs(throughputs, source="replan's cluster model")
        b, rows = self.plan["boundaries"], self.plan["rank_mapping"]
        sched, agg = pl.get("schedule", "1f1b"), pl.get("aggregator", "mean")
        whole = evaluate(self.profile, cluster, b, rows, max(1, int(sum(shares)) // len(shares)), sched, agg)
        if len(set(shares)) == 1:
            return whole.step_time
        pipes = [evaluate(self.profile, cluster, b, [[row[d]] for row in rows], int(n), sched, agg).pipeline_time
                 for d, n in enumerate(shares)]
        return max(pipes) + whole.tail_time

    def _fit_step(self, devices: List[int], shares: List[int]) -> None:
        """Slow `devices` further, as the step sees them (`step_factor`, one common factor), until the model's
        step for the plan in force, in this run's seconds, is the measured one: the compute times say which
        device is slow, the step says how slow it is in effect (its p2p and optimizer step included)."""
        target = self.step_ema / self.step_calib
        base = self._effective(self.throughputs)

        def scaled(k: float) -> List[float]:
            return [t * k if r in devices else t for r, t in enumerate(base)]

        if self._model_step(base, shares) >= target:
            return
        lo, hi = 0.05, 1.0
        if self._model_step(scaled(lo), shares) <= target:  # slower than the model can say: as slow as it goes
            k = lo
        else:
            for _ in range(40):  # the model's step falls as the devices get faster
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if self._model_step(scaled(mid), shares) > target else (lo, mid)
            k = hi
        for r in devices:
            self.step_factor[r] = self.step_factor.get(r, 1.0) * k

    def _solve(self, cluster: Cluster, stages: int, total: int):
        """The start-up solver's plan for `cluster` at `stages` stages, the global batch's `total` micro-batches
        split over the replicas that depth leaves."""
        pl = self.placement
        mb = total // (len(self.cluster) // stages)
        return solve(pl.get("solver", "dp"), self.profile, cluster, stages, mb, schedule=pl.get("schedule", "1f1b"),
                     aggregator=pl.get("aggregator", "mean"), **pl.get("solver_options", {}))

    def _depths(self, total: int) -> List[int]:
        """The pipeline depths a re-plan may use: every rank busy (the depth divides the ranks), the global batch
        of `total` micro-batches kept (it divides into the replicas), at least one layer per stage."""
        stages = len(self.plan["rank_mapping"])
        if not self.options.change_depth:
            return [stages]
        n = len(self.cluster)
        return [s for s in range(1, min(n, len(self.profile)) + 1)
                if (n % s == 0 and total % (n // s) == 0) or s == stages]

    def _depth_trust(self, stages: int, total: int) -> float:
        """>= 1, the factor on another depth's predicted step: the start-up depth is taken to be the best on the
        cluster as described, so where the model prefers `stages` there, its preference is not believed."""
        start = self.start_stages or len(self.plan["rank_mapping"])
        if stages == start:
            return 1.0
        for s in (start, stages):
            if s not in self.described:
                self.described[s] = self._solve(self.cluster, s, total).predicted_step_time
        return max(1.0, self.described[start] / self.described[stages])

    def _choose(self, metrics: Dict[str, Any], measured: List[float], calib: float,
                before: List[float]) -> List[Action]:
        """`calib`: the cost model's seconds -> this run's (the step calibration, else the compute one);
        `before`: the devices' effective speeds the plan in force was chosen for."""
        o = self.options
        cluster = self._cluster_now()
        stages, replicas = len(self.plan["rank_mapping"]), len(self.plan["rank_mapping"][0])
        total = int(sum(metrics["data_shares"]))
        mb = total // replicas
        step = int(metrics["step"])
        remaining = (o.total_steps - step) if o.total_steps is not None else o.horizon_steps
        now = self._model_step(self._effective(measured), list(metrics["data_shares"])) * calib
        # the best plan at every depth allowed (same depth: as predicted; another: discounted, see _depth_trust)
        options = []
        for s in self._depths(total):
            plan = self._solve(cluster, s, total)
            options.append((plan.predicted_step_time * calib * self._depth_trust(s, total), s, plan))
        after, depth, new = min(options, key=lambda x: (x[0], x[1] != stages))
        last = metrics.get("last_move") or {}
        step_time = float(metrics.get("step_time") or now)
        cost = float(last["seconds"]) if last.get("seconds") else o.move_cost_steps * step_time
        cost_kind = "measured" if last.get("seconds") else f"estimated as {o.move_cost_steps:g} steps"
        saving = (now - after) * max(remaining, 0)
        slow = [f"{self.cluster.devices[r].name} {m / t:.2f}x" for r, (m, t)
                in enumerate(zip(self._effective(measured), before)) if m != t]
        record = {"step": step, "predicted_before": now, "predicted_after": after, "saving": saving, "calib": calib,
                  "move_cost": cost, "throughputs": self._effective(measured), "remaining_steps": remaining,
                  "stages": depth}
        # the data-share alternative (no move): the best split for the replicas' speeds (the data-share formula),
        # its step from the cost model; taken when within `shares_margin` of the best move
        if o.allow_shares and replicas > 1:
            split = best_shares(self._replica_times(cluster, self.plan), total, stages)
            by_shares = self._model_step(self._effective(measured), split) * calib
            if (by_shares <= after * (1.0 + o.shares_margin) and split != list(metrics["data_shares"])
                    and by_shares < now * (1.0 - o.min_gain)):
                record.update(kind="shares", shares=split, stages=stages, predicted_after=by_shares)
                self.decisions.append(record)
                self.seen, self.step_ema = 0, None
                return [SetDataShares(None if len(set(split)) == 1 else tuple(split))]
        same = (new.boundaries == self.plan["boundaries"] and new.rank_mapping == self.plan["rank_mapping"])
        if same or saving <= cost or after >= now * (1.0 - o.min_gain):
            if not same:
                record.update(kind="kept", boundaries=new.boundaries, rank_mapping=new.rank_mapping)
                self.decisions.append(record)
            return []
        deeper = f"pipeline depth {stages} -> {depth} stages; " if depth != stages else ""
        reason = (f"measured speeds {', '.join(slow)} of the model's; {deeper}predicted step {now:.3f} s -> "
                  f"{after:.3f} s, saving {saving:.1f} s over {remaining} steps > move cost {cost:.1f} s ({cost_kind})")
        record.update(kind="replan", boundaries=new.boundaries, rank_mapping=new.rank_mapping, reason=reason)
        self.decisions.append(record)
        self.plan = new.layout.to_dict()
        self.ratios, self.seen, self.step_ema = None, 0, None  # new layers on every device: measure afresh
        # the new plan was chosen for equal shares (a move to another depth starts from them anyway)
        equal = [SetDataShares(None)] if len(set(metrics["data_shares"])) > 1 and depth == stages else []
        return equal + [Replan(tuple(new.boundaries), tuple(tuple(r) for r in new.rank_mapping), reason=reason)]

    # ---- one adaptive system -----------------------------------------------------------------------
    def on_change(self, change: Change) -> None:
        """Any applied move, data-share or batch change (another policy's, this one's, a checkpoint's other
        plan): the plan in force is the change's, and what was measured under the old work restarts - the
        per-rank ratios, the step's EMA, the streak and the warm-up. What the devices were measured to be
        (throughputs, step factors, slow loads) and the calm steps' calibration stay: they describe the
        devices and the model, not the plan. After a `recovery` (a restart on other devices) they go too:
        rank r is on another device, and the cluster model is reloaded for the devices under the ranks."""
        if not change.moves_work:
            return
        if change.plan is not None:
            self.plan = change.plan
        self.ratios, self.step_ema, self.seen, self.streak = None, None, 0, 0
        if change.kind == "recovery":  # other devices under the ranks: what was measured per rank is theirs no more
            self.cluster, self.throughputs, self.calm_ratios = None, None, []
            self.step_factor, self.slow_load = {}, {}
            self.start_stages = len(self.plan["rank_mapping"]) if self.plan else self.start_stages

    # ---- state -------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"plan": self.plan, "ratios": self.ratios, "seen": self.seen, "streak": self.streak,
                "throughputs": self.throughputs, "calm_ratios": list(self.calm_ratios),
                "decisions": list(self.decisions),
                "slow_load": dict(self.slow_load), "step_ema": self.step_ema, "step_factor": dict(self.step_factor),
                "start_stages": self.start_stages}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.plan, self.ratios = state.get("plan"), state.get("ratios")
        self.seen, self.streak = int(state.get("seen", 0)), int(state.get("streak", 0))
        self.throughputs = state.get("throughputs")
        self.calm_ratios = [float(x) for x in state.get("calm_ratios") or []]
        self.decisions = list(state.get("decisions", []))
        self.slow_load = {int(r): float(w) for r, w in (state.get("slow_load") or {}).items()}
        self.step_ema = state.get("step_ema")
        self.step_factor = {int(r): float(f) for r, f in (state.get("step_factor") or {}).items()}
        self.start_stages = state.get("start_stages")
