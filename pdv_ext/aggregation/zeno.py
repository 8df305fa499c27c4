"""`zeno`: keep the candidates that descend on trusted validation data (Zeno / Zeno++, first-order form).

Each rank scores every candidate of its group with  score_i = gamma <v, g_i> - rho |g_i|^2,  v being its
own gradient on validation data, keeps the m - b best and averages them. The scores are averaged over
the group (one all-reduce of m floats) before choosing, so every replica keeps the same candidates and
replicas stay identical even when each rank's validation batch differs (averaging scores is scoring
with the group's mean validation gradient). Candidates with NaN/Inf score -inf and are always dropped.

Where v comes from: `set_validation_grads(list)` (the pipeline engine does this every `refresh_every`
steps from one extra forward/backward micro-batch of `validation_iter`), or a `validation_fn` callable
returning the list (standalone). Between refreshes the last v is reused (Zeno++'s stale validation).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from pydantic import Field, model_validator

from ..comm.base import Comm
from ..config_base import ConfigError, StrictModel
from .base import register_aggregator
from .. import kernels
from .robust import RobustAggregator, bad_ranks, flat_dtype, flatten_as, require_some_finite, write_back


@register_aggregator("zeno")
class Zeno(RobustAggregator):
    """Validation-scored selection: drops the `b` lowest-scoring ranks each step."""

    needs_validation = True

    class Options(StrictModel):
        #: step size assumed by the score gamma <v, g> - rho |g|^2 (only rho / gamma matters for the choice)
        gamma: float = Field(1.0, gt=0)
        #: penalty on the candidate's squared norm
        rho: float = Field(0.05, ge=0)
        #: candidates dropped each step (the Byzantine ranks tolerated); alias `byzantine`
        b: Optional[int] = Field(None, ge=0)
        byzantine: Optional[int] = Field(None, ge=0)
        #: recompute the validation gradient every this many steps (pipeline engine / validation_fn)
        refresh_every: int = Field(1, ge=1)

        @model_validator(mode="after")
        def _one_b(self):
            if self.b is not None and self.byzantine is not None and self.b != self.byzantine:
                raise ValueError("give either b or its alias byzantine, not two different values")
            return self

        @property
        def dropped(self) -> int:
            return self.b if self.b is not None else (self.byzantine if self.byzantine is not None else 1)

    def __init__(self, options=None, validation_fn: Optional[Callable[[], List[torch.Tensor]]] = None, **kw):
        super().__init__(options, **kw)
        self.validation_fn = validation_fn
        self._v: Optional[torch.Tensor] = None
        self._v_step = -1

    def set_validation_grads(self, grads: List[torch.Tensor]) -> None:
        """Hand over this rank's validation gradient (same tensors/order as the gradients aggregated)."""
        self._v = flatten_as([g.detach() for g in grads], flat_dtype(grads))  # scored in float64 (kernels)
        self._v_step = self.step

    def needs_refresh(self) -> bool:
        return self._v is None or self.step - self._v_step >= self.options.refresh_every

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        opt, m = self.options, comm.size
        b = opt.dropped
        if b >= m:
            raise ConfigError([f"pdv.aggregation.b: dropping {b} candidates needs a data-parallel group of more "
                               f"than {b} ranks; this group has {m}"])
        if self.validation_fn is not None and self.needs_refresh():
            self.set_validation_grads(self.validation_fn())
        if self._v is None:
            raise RuntimeError("zeno: no validation gradient; pass validation_iter to pdv_ext.initialize, or call "
                               "set_validation_grads()/give validation_fn when using the aggregator standalone")
        stack, finite = self.gather(grads, comm)
        if stack.shape[1] != self._v.numel():
            raise ValueError(f"zeno: validation gradient has {self._v.numel()} elements, gradients {stack.shape[1]}")
        require_some_finite(finite, "zeno", self.step)
        v = self._v.to(stack.dtype)
        # <v, g_i> and |g_i|^2 of each finite candidate in one float64-accumulating pass (pdv_ext.kernels)
        good = torch.nonzero(finite).flatten()
        dot, g2, _ = kernels.adasum_dots([stack[i] for i in good.tolist()], [v] * len(good))
        scores = torch.zeros(m, dtype=torch.float64)
        scores[good] = opt.gamma * dot - opt.rho * g2
        # a score that over/underflowed counts as the worst finite score; agree on one choice by averaging
        # the scores over the group (the finite mask is identical everywhere: it comes from the gather)
        scores = torch.nan_to_num(scores, nan=-1e300, posinf=-1e300, neginf=-1e300)
        scores = torch.where(finite, scores, torch.zeros_like(scores))
        comm.all_reduce(scores, "sum")
        scores = torch.where(finite, scores / m, torch.full_like(scores, float("-inf")))
        n_keep = max(1, min(m - b, int(finite.sum())))
        order = torch.argsort(scores, descending=True, stable=True)
        keep, drop = order[:n_keep], order[n_keep:]
        out = stack[int(keep[0])].clone()  # the mean of the kept rows, without copying them out first
        for i in keep[1:].tolist():
            out.add_(stack[i])
        out.div_(n_keep)
        self.report = {"dropped": sorted(int(i) for i in drop), "nonfinite": bad_ranks(finite),
                       "scores": [float(x) for x in scores]}
        return write_back(out, grads)

    def state_dict(self):
        return {**super().state_dict(), "v": self._v, "v_step": self._v_step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._v = state.get("v")
        self._v_step = int(state.get("v_step", -1))
