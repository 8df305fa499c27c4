"""`zeno`: keep the candidates that descend on trusted validation data (Zeno / Zeno++, first-order form).

Every candidate of the group is scored with  score_i = gamma <v, g_i> - rho |g_i|^2,  v being the
group's mean gradient on validation data (each rank computes its own on its validation batch; averaging
the ranks' scores is scoring with the mean), and the m - b best are averaged. Computed on slices: every
rank gets all candidates' and all validation gradients' entries of its 1/m slice (two all-to-alls), its
partial dot products and norms are summed over the slices in rank order (one all-gather of 2m floats:
the same scores, bitwise, on every rank, so every replica keeps the same candidates), it averages the
kept candidates on its slice, and an all-gather rebuilds the result. Candidates with NaN/Inf score -inf
and are always dropped.

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
from .robust import (RobustAggregator, bad_ranks, flat_dtype, flatten_as, require_some_finite, scatter_slices,
                     sum_partials)


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
        self._vrows: Optional[torch.Tensor] = None  # every rank's v on this rank's slice (scatter buffer)
        self._vsum: Optional[torch.Tensor] = None   # their sum, what the scores use; None when v changed

    def set_validation_grads(self, grads: List[torch.Tensor]) -> None:
        """Hand over this rank's validation gradient (same tensors/order as the gradients aggregated)."""
        self._v = flatten_as([g.detach() for g in grads], flat_dtype(grads))  # scored in float64 (kernels)
        self._v_step = self.step
        self._vsum = None

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
        n = sum(g.numel() for g in grads)
        if n != self._v.numel():
            raise ValueError(f"zeno: validation gradient has {self._v.numel()} elements, gradients {n}")
        rows, finite = self.slices(grads, comm)  # every candidate's entries of this rank's slice
        require_some_finite(finite, "zeno", self.step)
        # every rank's validation gradient on this slice, summed: the group's mean v, times m. Scattered
        # again only when some rank's v changed since (agreed: the scatter is collective); between
        # refreshes (Zeno++'s stale v, refresh_every > 1) the slices are reused
        stale = (self._vsum is None or self._vsum.shape != rows.shape[1:] or self._vsum.dtype != rows.dtype)
        if comm.all_reduce_scalars([float(stale)])[0] > 0:
            self._vrows = scatter_slices(self._v.to(rows.dtype), comm, self._vrows)
            self._vsum = self._vrows.sum(dim=0)
        vsum = self._vsum
        # partial <sum_r v_r, g_i> and |g_i|^2 of each finite candidate on this slice in one float64-
        # accumulating pass (pdv_ext.kernels), summed over the slices in rank order (identical everywhere)
        good = torch.nonzero(finite).flatten()
        dot, g2, _ = kernels.adasum_dots([rows[i] for i in good.tolist()], [vsum] * len(good))
        part = torch.zeros(2, m, dtype=torch.float64)
        part[0, good], part[1, good] = dot.cpu(), g2.cpu()
        dot, g2 = sum_partials(part, comm)
        # the group-averaged score gamma <mean_r v_r, g_i> - rho |g_i|^2; an over/underflowed one counts as
        # the worst finite score; non-finite candidates score -inf
        scores = torch.nan_to_num(opt.gamma * dot / m - opt.rho * g2, nan=-1e300, posinf=-1e300, neginf=-1e300)
        scores = torch.where(finite, scores, torch.full_like(scores, float("-inf")))
        n_keep = max(1, min(m - b, int(finite.sum())))
        order = torch.argsort(scores, descending=True, stable=True)
        keep, drop = order[:n_keep], order[n_keep:]
        out = rows[int(keep[0])].clone()  # the mean of the kept rows on this slice, without copying them out
        for i in keep[1:].tolist():
            out.add_(rows[i])
        out.div_(n_keep)
        self.report = {"dropped": sorted(int(i) for i in drop), "nonfinite": bad_ranks(finite),
                       "scores": [float(x) for x in scores]}
        return self.finish_slices(out, grads, comm)

    def state_dict(self):
        return {**super().state_dict(), "v": self._v, "v_step": self._v_step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._v = state.get("v")
        self._v_step = int(state.get("v_step", -1))
        self._vsum = None
