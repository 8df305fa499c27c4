"""`suspicion`: robust averaging without validation data (pipeDejavu's variant of Zeno).

Every rank gets all candidates' entries of its 1/m slice (robust.RobustAggregator.slices), the partial
Gram matrices of the slices are summed in rank order (identical everywhere), and from them every rank
computes, identically:
  s_i = |g_i - mean(g)|                       (suspicion: distance from the plain mean)
  the k most suspicious candidates are replaced by the plain mean of the rest,
  out = sum_i w_i g'_i / sum_i w_i,  w_i = alpha / (alpha + s_i)
where a replaced candidate gets the average weight of the rest; each rank forms `out` on its slice and an
all-gather rebuilds it. `alpha` defaults to the median suspicion
of the step, which makes the weights scale-free. Non-finite candidates are always among the replaced.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from pydantic import Field

from ..comm.base import Comm
from ..config_base import ConfigError, StrictModel
from .base import register_aggregator
from .robust import RobustAggregator, bad_ranks, require_some_finite, sum_partials

#: columns per float64 block of the Gram matrix: never an (m, n) float64 copy of the candidates
BLOCK = 1 << 16


def gram64(stack: torch.Tensor) -> torch.Tensor:
    """stack @ stack.T (m x m) accumulated in float64, one column block at a time: one read of the
    candidates, whatever their dtype."""
    m, n = stack.shape
    g = torch.zeros(m, m, dtype=torch.float64, device=stack.device)
    buf = torch.empty(m, min(BLOCK, n), dtype=torch.float64, device=stack.device)
    for lo in range(0, n, BLOCK):
        blk = buf[:, : min(BLOCK, n - lo)]
        blk.copy_(stack[:, lo:lo + BLOCK])
        g.addmm_(blk, blk.t())
    return g


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
        rows, finite = self.slices(grads, comm)  # every candidate's entries of this rank's slice
        require_some_finite(finite, "suspicion", self.step)
        m = comm.size
        dev = rows.device
        good = torch.nonzero(finite).flatten()
        if not bool(finite.all()):
            rows[~finite.to(dev)] = 0  # our own copy: the bad rows get weight 0 below, and 0 * NaN is NaN
        # s_i = |g_i - mean of the finite g| from their Gram matrix G (float64, partial sums over the
        # slices added in rank order): |g_i - mu|^2 = G_ii - 2 mean_j G_ij + mean_jk G_jk over finite j, k
        gg = sum_partials(gram64(rows), comm).cpu()[good][:, good]
        s2 = (gg.diagonal() - 2.0 * gg.mean(dim=1) + gg.mean()).clamp_(min=0.0)
        s = torch.full((m,), float("inf"), dtype=torch.float64)
        s[good] = s2.sqrt()
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
        # sum_rest w_i g_i + n_replace w_rep mean(rest), over the total weight: one coefficient per kept row,
        # 0 for the replaced (and non-finite) rows; then one matrix-vector product over the candidates
        coef = torch.zeros(m, dtype=torch.float64).index_copy_(
            0, rest, (w + n_replace * w_rep / len(rest)) / (w.sum() + n_replace * w_rep))
        out = torch.mv(rows.t(), coef.to(device=dev, dtype=rows.dtype))
        self.report = {"dropped": sorted(int(i) for i in replaced), "nonfinite": bad_ranks(finite),
                       "suspicion": [float(x) for x in s]}
        return self.finish_slices(out, grads, comm)
