"""`goodput`: the batch that makes the most progress per second, from throughputs measured while training.

Goodput (Pollux / AdaptDL) is samples per second times the statistical efficiency of the batch, the progress a
sample makes at batch B relative to a small batch: efficiency(B) = (gns + B0) / (gns + B), from the gradient
noise scale the Monitor estimates (`pdv_ext.policy.gns`), for SGD with the LR fitted to each batch. Under the
sqrt LR rule, Adam's rule, it is the square root of that (`efficiency: auto`, `gns.adam_sqrt_efficiency`):
Adam's per-coordinate normalisation keeps a sample's progress while the noise dominates and loses it as
1 / sqrt(B), not 1 / B, once the signal does. Unlike `gns_batch_size`, which predicts every
throughput from a formula fitted to the step times, this policy trusts a throughput only where it measured it:

- each batch's seconds per step are smoothed (`time_ema`) over the steps run at it, the first step after a
  change left out (it pays for new buffers); a throughput counts once `measure_steps` steps were timed at it;
- every `interval` steps it compares the current batch with its neighbours (one `factor` up or down, within
  `min_batch_size`..`max_batch_size`): a measured neighbour whose goodput is `min_gain` higher is taken;
  a neighbour not measured yet is *probed* (run for `measure_steps` + 1 steps, then compared and kept or left)
  when the most it could give beats the current goodput by `min_gain` (a bigger batch at most multiplies the
  samples per second by the batch ratio, a smaller one does not raise them);
- it grows and shrinks (the noise scale falls as well as rises), and a probe that did not pay is left at once;
- a throughput is forgotten after `stale_after` steps, and all of them when another policy changed the data
  shares, moved the pipeline, or a checkpoint or recovery changed the plan (`on_change`): they were measured
  under another split. The runner keeps the shares in proportion across a batch change, so `rebalance` and
  this policy do not undo each other.

With `plateau_steps` it also grows where the training loss has stopped falling at this batch: the mean loss of
the last `plateau_steps` steps is not `plateau_z` standard errors below the mean of the `plateau_steps` before
(a statistical stationarity test, as SASA decays an LR on one). At a constant LR that is the batch's noise
floor, which goodput's efficiency cannot see: the noise-scale model assumes the LR suits every batch. A bigger
batch in place of an LR decay (Smith et al. 2018, "Don't decay the learning rate, increase the batch size")
lowers the floor; a batch reached this way is not shrunk below again.

The batch grows in micro-batches per step (`grow: micro_batches`, what shrinks a pipeline's bubble) or in the
micro-batch size. The LR follows `lr_rule` (None: `pdv.policy.lr_scaling`). Every decision is one log line
(batch before -> after, the samples/s of both and whether measured, the efficiencies and the noise scale),
and is kept in `decisions`.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import Field, model_validator

from ...config_base import StrictModel
from ...log import logger
from ..base import Action, Change, LRRule, Policy, SetBatchSize, TrainContext, register_policy
from ..gns import adam_sqrt_efficiency, statistical_efficiency


@register_policy("goodput")
class Goodput(Policy):

    class Options(StrictModel):
        #: the batch's bounds in global samples (per step, over all replicas)
        min_batch_size: int = Field(1, ge=1)
        max_batch_size: int = Field(1024, ge=1)
        grow: Literal["micro_batches", "micro_batch_size"] = "micro_batches"
        #: a neighbour is this factor up or down (rounded to whole micro-batches)
        factor: float = Field(2.0, gt=1.0)
        #: steps between decisions (at a batch it has just moved to: measure_steps + 1 at least)
        interval: int = Field(10, ge=1)
        #: no decision before this step (the noise-scale estimate needs some steps)
        warmup_steps: int = Field(20, ge=0)
        #: steps timed at a batch before its throughput counts (the first step after a change is not timed)
        measure_steps: int = Field(3, ge=1)
        #: relative goodput gain a change (or a probe's best case) must promise
        min_gain: float = Field(0.05, ge=0.0)
        #: weight of the past in each batch's smoothed step time
        time_ema: float = Field(0.7, ge=0.0, lt=1.0)
        #: steps after which a batch's measured throughput is forgotten (the current batch's never is)
        stale_after: int = Field(300, ge=1)
        lr_rule: Optional[LRRule] = None
        #: steps per window of the plateau test (None: no growth on a plateau)
        plateau_steps: Optional[int] = Field(None, ge=2)
        #: standard errors the last window's mean loss must fall below the window before to count as progress
        plateau_z: float = Field(1.0, ge=0.0)
        #: the statistical efficiency's model: `sgd` (gns + B0) / (gns + B) (Pollux, SGD at its best LR per batch),
        #: `adam_sqrt` its square root (Adam-like optimizers under the sqrt LR rule), `auto` adam_sqrt where the
        #: LR follows the sqrt rule (`lr_rule`, else `pdv.policy.lr_scaling`), sgd otherwise
        efficiency: Literal["auto", "sgd", "adam_sqrt"] = "auto"

        @model_validator(mode="after")
        def _bounds(self) -> "Goodput.Options":
            if self.max_batch_size < self.min_batch_size:
                raise ValueError(f"max_batch_size {self.max_batch_size} is below min_batch_size "
                                 f"{self.min_batch_size}")
            return self

    def __init__(self, options: Any = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        #: global batch -> {"t": smoothed seconds per step, "n": steps timed, "step": last step timed}
        self.measured: Dict[int, Dict[str, float]] = {}
        self.last_change = 0
        #: a probe in progress: {"batch", "back", "back_mb", "back_mbs"} (the batch it left and its geometry)
        self.probe: Optional[Dict[str, int]] = None
        self.decisions: List[Dict[str, Any]] = []
        self._pending = False  # this policy's own batch change, announced by the runner
        #: training losses at the current batch since its first timed step (the plateau test's windows)
        self.losses: List[float] = []
        #: the smallest batch allowed: one the plateau test grew to (smaller ones stalled at this LR)
        self.floor = 0
        #: the efficiency model in use (`efficiency`, `auto` resolved at the start of training)
        self.model = "adam_sqrt" if self.options.efficiency == "adam_sqrt" else "sgd"

    def on_train_begin(self, ctx: TrainContext) -> None:
        self.last_change = max(self.last_change, int(ctx.step))
        if self.options.efficiency == "auto":
            rule = self.options.lr_rule or ctx.extra.get("lr_scaling")
            self.model = "adam_sqrt" if rule == "sqrt" else "sgd"

    def on_change(self, change: Change) -> None:
        """A change of shares or plan (another policy's, a checkpoint's, a recovery) makes every throughput
        stale; a batch change restarts the timing at the new batch (its first step is not timed)."""
        if change.kind == "batch_size":
            self.last_change = change.step
            self.losses = []
            if change.source != (getattr(self, "plugin_name", None) or "goodput"):
                self.probe = None  # another policy set the batch: a probe of ours is over
        elif change.moves_work:
            self.measured.clear()
            self.probe = None
            self.last_change = change.step
            self.losses = []

    # ---- measuring --------------------------------------------------------------------------------
    def throughput(self, batch: int, step: int) -> Optional[float]:
        """Samples/s measured at `batch` (None: not measured enough, or stale)."""
        m = self.measured.get(batch)
        if m is None or m["n"] < self.options.measure_steps or step - m["step"] > self.options.stale_after:
            return None
        return batch / m["t"]

    def _time(self, batch: int, step: int, seconds: float) -> None:
        m = self.measured.get(batch)
        if m is None or step - m["step"] > self.options.stale_after:
            self.measured[batch] = {"t": seconds, "n": 1, "step": step}
            return
        a = self.options.time_ema
        m["t"], m["n"], m["step"] = a * m["t"] + (1 - a) * seconds, m["n"] + 1, step

    # ---- geometry ---------------------------------------------------------------------------------
    def neighbours(self, m: Dict[str, Any]) -> List[Tuple[int, int, int]]:
        """(global batch, micro_batches, micro_batch_size) one `factor` below and above the current batch,
        within the bounds (the nearest whole number of micro-batches or samples, at least one step away)."""
        mbs, mb, dp = int(m["micro_batch_size"]), int(m["micro_batches"]), int(m["dp_size"])
        unit = mbs * dp if self.options.grow == "micro_batches" else mb * dp  # samples per +1
        k = mb if self.options.grow == "micro_batches" else mbs
        out = []
        for target in (max(1, min(k - 1, int(round(k / self.options.factor)))),
                       max(k + 1, int(round(k * self.options.factor)))):
            batch = target * unit
            if target != k and max(self.options.min_batch_size, self.floor) <= batch <= self.options.max_batch_size:
                out.append((batch, target, mbs) if self.options.grow == "micro_batches" else (batch, mb, target))
        return out

    # ---- deciding ---------------------------------------------------------------------------------
    def efficiency(self, gns: float, batch: int, base: int) -> float:
        fn = adam_sqrt_efficiency if self.model == "adam_sqrt" else statistical_efficiency
        return fn(gns, base, batch)

    def plateau(self) -> Optional[Tuple[float, float, float]]:
        """(mean loss of the window before, of the last window, their standard error) when the last window is
        not `plateau_z` standard errors lower; None while it is, or before two windows were seen."""
        n = self.options.plateau_steps
        if not n or len(self.losses) < 2 * n:
            return None
        last, before = self.losses[-n:], self.losses[-2 * n:-n]

        def mean_var(xs: List[float]) -> Tuple[float, float]:
            mu = sum(xs) / len(xs)
            return mu, sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)

        (ma, va), (mb, vb) = mean_var(last), mean_var(before)
        se = math.sqrt(va / n + vb / n)
        return None if mb - ma > self.options.plateau_z * se else (mb, ma, se)

    def after_step(self, m: Dict[str, Any]) -> List[Action]:
        step, batch = int(m["step"]), int(m["batch_size"])
        if step > self.last_change + 1:  # the first step at a new batch pays for its buffers
            self._time(batch, step, float(m["step_time"]))
            loss = m.get("loss")
            if self.options.plateau_steps and loss is not None and math.isfinite(float(loss)):
                self.losses = (self.losses + [float(loss)])[-2 * self.options.plateau_steps:]
        gns = m.get("gns")
        settle = self.options.measure_steps + 1
        due = (step - self.last_change >= settle) if self.probe else \
            (step % self.options.interval == 0 and step - self.last_change >= max(settle, self.options.interval))
        if step >= self.options.warmup_steps and due and not self.probe:
            flat = self.plateau()
            up = [c for c in self.neighbours(m) if c[0] > batch]
            if flat is not None and up:
                c, nmb, nmbs = up[0]
                reason = (f"plateau: training loss {flat[0]:.5g} -> {flat[1]:.5g} over the last "
                          f"{2 * self.options.plateau_steps} steps (standard error {flat[2]:.2g}): this batch's "
                          f"floor at this LR; a bigger batch in place of an LR decay")
                self.decisions.append({"step": step, "from": batch, "to": c, "kind": "plateau",
                                       "loss": [flat[0], flat[1]], "se": flat[2]})
                logger.info("goodput: step %d: batch %d -> %d, %s", step, batch, c, reason)
                self.last_change, self.floor, self.losses = step, c, []
                return [SetBatchSize(micro_batches=nmb, micro_batch_size=nmbs, lr_rule=self.options.lr_rule,
                                     reason=reason)]
        if step < self.options.warmup_steps or not due or gns is None or self.throughput(batch, step) is None:
            return []
        gns = max(float(gns), 0.0)
        base = self.options.min_batch_size
        now_sps = self.throughput(batch, step)
        now = now_sps * self.efficiency(gns, batch, base)
        best: Optional[Tuple[float, int, int, int, float, str]] = None  # goodput, batch, mb, mbs, sps, how
        probe: Optional[Tuple[float, int, int, int, float, str]] = None
        for c, nmb, nmbs in self.neighbours(m):
            sps = self.throughput(c, step)
            if sps is not None:
                g = sps * self.efficiency(gns, c, base)
                if g > now * (1 + self.options.min_gain) and (best is None or g > best[0]):
                    best = (g, c, nmb, nmbs, sps, "measured")
            else:  # the most it could give: samples/s in proportion to the batch when growing, none more when not
                bound = now_sps * (c / batch if c > batch else 1.0)
                g = bound * self.efficiency(gns, c, base)
                if g > now * (1 + self.options.min_gain) and (probe is None or g > probe[0]):
                    probe = (g, c, nmb, nmbs, bound, "at most")
        was_probe = self.probe
        self.probe = None
        back = self.throughput(was_probe["back"], step) if was_probe else None
        if was_probe and back is not None and was_probe["back"] >= self.floor and \
                back * self.efficiency(gns, was_probe["back"], base) > now:
            c = was_probe["back"]  # the probe did not pay: back at once, whatever the margin
            best = (back * self.efficiency(gns, c, base), c, was_probe["back_mb"], was_probe["back_mbs"], back,
                    "measured")
        if best is None and probe is not None and was_probe is None:
            best, self.probe = probe, {"batch": probe[1], "back": batch, "back_mb": int(m["micro_batches"]),
                                       "back_mbs": int(m["micro_batch_size"])}
        elif best is None:
            return []
        g, c, nmb, nmbs, sps, how = best
        kind = "probe" if self.probe else "move"
        reason = (f"{kind}: samples/s {now_sps:.1f} (measured) -> {sps:.1f} ({how}), {self.model} efficiency "
                  f"{self.efficiency(gns, batch, base):.3f} -> {self.efficiency(gns, c, base):.3f} at noise scale "
                  f"{gns:.1f}, goodput {now:.1f} -> {g:.1f}{' (best case)' if self.probe else ''}")
        self.decisions.append({"step": step, "from": batch, "to": c, "kind": kind, "samples_per_s": [now_sps, sps],
                               "how": how, "gns": gns, "goodput": [now, g], "efficiency_model": self.model})
        logger.info("goodput: step %d: batch %d -> %d, %s", step, batch, c, reason)
        self.last_change = step
        return [SetBatchSize(micro_batches=nmb, micro_batch_size=nmbs, lr_rule=self.options.lr_rule, reason=reason)]

    def state_dict(self) -> Dict[str, Any]:
        return {"measured": {int(k): dict(v) for k, v in self.measured.items()}, "last_change": self.last_change,
                "probe": dict(self.probe) if self.probe else None, "decisions": list(self.decisions),
                "losses": list(self.losses), "floor": self.floor}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.measured = {int(k): {kk: float(vv) for kk, vv in v.items()} for k, v in state["measured"].items()}
        self.last_change = int(state["last_change"])
        self.probe = dict(state["probe"]) if state.get("probe") else None
        self.decisions = list(state.get("decisions", []))
        self.losses = [float(x) for x in state.get("losses", [])]
        self.floor = int(state.get("floor", 0))
