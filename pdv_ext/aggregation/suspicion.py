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
from .robust import RobustAggregator, bad_ranks, require_some_finite, write_back

#: columns per float64 block: the statistics are computed block by block, never on an (m, n) float64 copy
BLOCK = 1 << 14


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
        stack, finite = self.gather(grads, comm)
        require_some_finite(finite, "suspicion", self.step)
        m, n = stack.shape
        dev = stack.device
        all_finite = bool(finite.all())
        good = torch.nonzero(finite).flatten()
        rows = slice(None) if all_finite else good.to(dev)  # a view of the stack when every row is finite
        # s_i = |g_i - mean of the finite g|, in float64 over column blocks
        s2 = torch.zeros(len(good), dtype=torch.float64, device=dev)
        for lo in range(0, n, BLOCK):
            blk = stack[rows, lo:lo + BLOCK].double()
            s2 += (blk - blk.mean(dim=0)).square_().sum(dim=1)
        s = torch.full((m,), float("inf"), dtype=torch.float64)
        s[good] = s2.sqrt().cpu()
        s = torch.nan_to_num(s, nan=float("inf"))
        n_replace = max(k, int((~finite).sum()))
        n_replace = min(n_replace, m - 1)
        order = torch.argsort(s, descending=True, stable=True)
        replaced, rest = order[:n_replace], order[n_replace:]
        finite_s = s[rest]
        alpha = self.options.alpha if self.options.alpha is not None else float(finite_s.median())
        if alpha <= 0:  # all kept candidates identical: equal weights
            w = torch.ones_like(finite_s)
        else:
            w = alpha / (alpha + finite_s)
        w_rep = w.mean()
        # sum_rest w_i g_i + n_replace w_rep mean(rest), over the total weight: one coefficient per kept row
        coef = (w + n_replace * w_rep / len(rest)) / (w.sum() + n_replace * w_rep)
        if all_finite:  # every row, the replaced ones with coefficient 0: again a view, not a copy
            coef, rows = torch.zeros(m, dtype=torch.float64).index_copy_(0, rest, coef), slice(None)
        else:
            rows = rest.to(dev)
        coef = coef.unsqueeze(0).to(dev)
        out = torch.empty(n, dtype=stack.dtype, device=dev)
        for lo in range(0, n, BLOCK):
            out[lo:lo + BLOCK] = (coef @ stack[rows, lo:lo + BLOCK].double()).squeeze(0)
        self.report = {"dropped": sorted(int(i) for i in replaced), "nonfinite": bad_ranks(finite),
                       "suspicion": [float(x) for x in s]}
        return write_back(out, grads)
