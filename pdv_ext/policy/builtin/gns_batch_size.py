"""`gns_batch_size`: grow the batch as the gradient noise scale grows (AdaptDL-style goodput).

goodput(B) = throughput(B) x efficiency(B), with efficiency(B) = (gns + B0) / (gns + B) (progress per
sample relative to the start batch B0) and throughput(B) = B / T(B). T(B) = a + b*B is fitted by least
squares to the step times seen so far (an EMA per batch size) once they span `fit_span` (the largest
measured batch at least that many times the smallest); before, the fixed part `a` comes from the pipeline
formula ((stages - 1) micro-batch times of bubble) or `prior_overhead` x the measured step time, whichever
is larger. (Two sizes close together make the slope noise: at 16 and 26 samples, step times that swing
+-15% on a shared machine fitted T(B) as nearly proportional to B, and growing never looked worth it.)
Every `interval` steps after `warmup_steps`, the policy moves to the candidate batch with the best
predicted goodput if it beats the current one by `min_gain`. Candidates: the micro-batches per step (`grow: micro_batches`) or the micro-batch size
(`grow: micro_batch_size`) up to `max_batch_size` global samples; growing only, unless `allow_shrink`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import Field

from ...config_base import StrictModel
from ..base import Action, LRRule, Policy, SetBatchSize, TrainContext, register_policy
from ..gns import statistical_efficiency


@register_policy("gns_batch_size")
class GNSBatchSize(Policy):

    class Options(StrictModel):
        #: largest global batch (samples per step over all replicas)
        max_batch_size: int = Field(1024, ge=1)
        grow: Literal["micro_batches", "micro_batch_size"] = "micro_batches"
        #: decide every N steps
        interval: int = Field(10, ge=1)
        #: no change before this step (the noise-scale EMA needs some steps)
        warmup_steps: int = Field(20, ge=0)
        #: relative goodput gain required to switch
        min_gain: float = Field(0.05, ge=0.0)
        #: at most this factor of growth per decision
        max_step_factor: float = Field(2.0, gt=1.0)
        allow_shrink: bool = False
        #: LR rule for the changes (None: pdv.policy.lr_scaling)
        lr_rule: Optional[LRRule] = None
        #: fixed share of the step time assumed before two batch sizes were measured
        prior_overhead: float = Field(0.5, ge=0.0, lt=1.0)
        #: EMA factor for the per-batch-size step times
        time_ema: float = Field(0.8, ge=0.0, lt=1.0)
        #: fit T(B) to the measured times only when their batch sizes span this factor (else the prior)
        fit_span: float = Field(2.0, ge=1.0)

    def __init__(self, options: Any = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        self.base_batch: Optional[int] = None
        self.stages = 1
        self.times: Dict[int, float] = {}  # global batch -> EMA step time
        self.last_change = 0

    def on_train_begin(self, ctx: TrainContext) -> None:
        if self.base_batch is None:
            self.base_batch = ctx.batch_size
        self.stages = int(ctx.extra.get("stages", self.stages))

    # ---- model ----------------------------------------------------------------------------------
    def _fit(self, batch: int, mb: int) -> Tuple[float, float]:
        """(a, b) of T(B) = a + b B."""
        pts = sorted(self.times.items())
        if len(pts) >= 2 and pts[-1][0] >= self.options.fit_span * pts[0][0]:
            n = len(pts)
            mx = sum(p[0] for p in pts) / n
            my = sum(p[1] for p in pts) / n
            sxx = sum((p[0] - mx) ** 2 for p in pts)
            b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
            a = my - b * mx
            if b > 0 and a >= 0:
                return a, b
            b = max(b, 1e-12)
            return max(a, 0.0), b
        t = self.times[batch]
        pipe = t * (self.stages - 1) / (mb + self.stages - 1) if self.options.grow == "micro_batches" else 0.0
        a = max(pipe, self.options.prior_overhead * t)
        return a, (t - a) / batch

    def goodput(self, batch: int, gns: Optional[float], a: float, b: float) -> float:
        assert self.base_batch is not None
        return batch / (a + b * batch) * statistical_efficiency(gns, self.base_batch, batch)

    def candidates(self, m: Dict[str, Any]) -> List[Tuple[int, int, int]]:
        """(global batch, micro_batches, micro_batch_size) reachable in one decision."""
        mbs, mb, dp = m["micro_batch_size"], m["micro_batches"], m["dp_size"]
        out = []
        limit = self.options.max_step_factor
        for k in range(1, 1 + 4096):
            nmb, nmbs = (k, mbs) if self.options.grow == "micro_batches" else (mb, k)
            batch = nmb * nmbs * dp
            if batch > self.options.max_batch_size:
                break
            cur = mb * mbs * dp
            if batch > cur * limit or (batch < cur and (not self.options.allow_shrink or batch * limit < cur)):
                continue
            out.append((batch, nmb, nmbs))
        return out

    # ---- decision -------------------------------------------------------------------------------
    def after_step(self, m: Dict[str, Any]) -> List[Action]:
        batch, step = int(m["batch_size"]), int(m["step"])
        if self.base_batch is None:
            self.base_batch = batch
        t = float(m["step_time"])
        if step > self.last_change + 1:  # the first step after a change pays for buffer re-allocation
            old = self.times.get(batch)
            self.times[batch] = t if old is None else self.options.time_ema * old + (1 - self.options.time_ema) * t
        gns = m.get("gns")
        if (step < self.options.warmup_steps or step % self.options.interval or gns is None
                or batch not in self.times or step - self.last_change < self.options.interval):
            return []
        a, b = self._fit(batch, int(m["micro_batches"]))
        now = self.goodput(batch, gns, a, b)
        best = max(self.candidates(m), key=lambda c: self.goodput(c[0], gns, a, b), default=None)
        if best is None or best[0] == batch or self.goodput(best[0], gns, a, b) < now * (1 + self.options.min_gain):
            return []
        self.last_change = step
        return [SetBatchSize(micro_batches=best[1], micro_batch_size=best[2], lr_rule=self.options.lr_rule)]

    def state_dict(self) -> Dict[str, Any]:
        return {"base_batch": self.base_batch, "times": dict(self.times), "last_change": self.last_change,
                "stages": self.stages}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.base_batch = state["base_batch"]
        self.times = {int(k): float(v) for k, v in state["times"].items()}
        self.last_change = int(state["last_change"])
        self.stages = int(state.get("stages", self.stages))
