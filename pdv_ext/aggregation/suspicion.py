"""`suspicion`: robust averaging without validation data (pipeDejavu's variant of Zeno).

Every rank gathers the group's candidates and computes, identically:
  s_i = |g_i - mean(g)|                       (suspicion: distance from the plain mean)
  the k most suspicious candidates are replaced by the plain mean of the rest,
  out = sum_i w_i g'_i / sum_i w_i,  w_i = alpha / (alpha + s_i)
where a replaced candidate gets the average weight of the rest. `alpha` defaults to the median suspicion
of the step, which makes the weights scale-free. Non-finite candidates are always among the replaced.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from pydantic import Field

from ..comm.base import Comm
from ..config_base import ConfigError, StrictModel
from .base import register_aggregator
from .robust import RobustAggregator, bad_ranks, gather_candidates, require_some_finite, write_back


@register_aggregator("suspicion")
class Suspicion(RobustAggregator):
    """Suspicion-weighted mean; tolerates `k` Byzantine ranks without trusted data."""

    class Options(StrictModel):
        #: candidates replaced by the mean of the rest each step (the Byzantine ranks tolerated)
        k: int = Field(1, ge=0)
        #: weight scale: w_i = alpha / (alpha + s_i); None = the median suspicion of the step
        alpha: Optional[float] = Field(None, gt=0)

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        k = self.options.k
        if k >= comm.size:
            raise ConfigError([f"pdv.aggregation.k: replacing {k} candidates needs a data-parallel group of more "
                               f"than {k} ranks; this group has {comm.size}"])
        stack, finite = gather_candidates(grads, comm)
        require_some_finite(finite, "suspicion", self.step)
        work = stack.double()
        center = work[finite].mean(dim=0)
        s = torch.full((stack.shape[0],), float("inf"), dtype=torch.float64)
        s[finite] = (work[finite] - center).norm(dim=1)
        s = torch.nan_to_num(s, nan=float("inf"))
        n_replace = max(k, int((~finite).sum()))
        n_replace = min(n_replace, stack.shape[0] - 1)
        order = torch.argsort(s, descending=True, stable=True)
        replaced, rest = order[:n_replace], order[n_replace:]
        rest_mean = work[rest].mean(dim=0)
        finite_s = s[rest]
        alpha = self.options.alpha if self.options.alpha is not None else float(finite_s.median())
        if alpha <= 0:  # all kept candidates identical: equal weights
            w = torch.ones_like(finite_s)
        else:
            w = alpha / (alpha + finite_s)
        w_rep = w.mean()
        total = (w[:, None] * work[rest]).sum(dim=0) + n_replace * w_rep * rest_mean
        out = total / (w.sum() + n_replace * w_rep)
        self.report = {"dropped": sorted(int(i) for i in replaced), "nonfinite": bad_ranks(finite),
                       "suspicion": [float(x) for x in s]}
        return write_back(out.to(stack.dtype), grads)
