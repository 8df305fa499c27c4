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

Data shares ("count"): every replica counts once, as in `median`: the weights are a robustness measure, and
a share (granted to whoever reports itself fast) must not buy a suspicious replica back its weight.

Small groups: telling the k most suspicious apart by their distance from the mean needs a majority that is
not replaced (m - k > k; for m = 2 both are equally far from their mean), so a group of m ranks supports
k <= (m - 1) // 2; a larger k is clamped with one GroupSizeWarning (k = 0 for 2 ranks: the weighted mean of
two equally distant candidates, the plain mean). A group of one is the identity.

Host syncs on CUDA: the Gram matrix is computed and summed over the slices on the device; one device-to-
host copy per call of the (m x m) sums and the finite mask, because who is replaced is a host decision
(and the report lists it); the m weights are computed on the host in float64 (the same code on every
device), and the slice is combined on the device as sum_i (w_i g_i) in ascending rank order, one rounded
product and one rounded add per kept candidate: the same bits on CPU and CUDA for the same Gram matrix (its
sums agree between devices to float64 rounding, the matrix product's order being the device's).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from pydantic import Field

from ..comm.base import Comm
from ..config_base import StrictModel
from .base import register_aggregator
from .robust import RobustAggregator, bad_ranks, require_some_finite, sum_partials, to_host

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

    group_limits = {"k": (lambda m: (m - 1) // 2, "replacing the k most suspicious needs more than 2k ranks")}

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        k = self.fit_group(comm)["k"]
        m = comm.size
        if m == 1:
            return self.alone(grads, "suspicion")
        rows, finite = self.slices(grads, comm)  # every candidate's entries of this rank's slice
        # s_i = |g_i - mean of the finite g| from their Gram matrix G (float64, partial sums over the
        # slices added in rank order): |g_i - mu|^2 = G_ii - 2 mean_j G_ij + mean_jk G_jk over finite j, k.
        # A non-finite candidate's row and column of G are NaN/Inf; they are never read
        gg, fin = to_host(sum_partials(gram64(rows), comm), finite)  # the call's one host sync
        fin = fin > 0
        require_some_finite(fin, "suspicion", self.step)
        good = torch.nonzero(fin).flatten()
        gg = gg[good][:, good]
        s2 = (gg.diagonal() - 2.0 * gg.mean(dim=1) + gg.mean()).clamp_(min=0.0)
        s = torch.full((m,), float("inf"), dtype=torch.float64)
        s[good] = s2.sqrt()
        s = torch.nan_to_num(s, nan=float("inf"))
        n_replace = max(k, int((~fin).sum()))
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
        # (the replaced and non-finite rows are never read), rounded once to the rows' dtype on the host
        coef = ((w + n_replace * w_rep / len(rest)) / (w.sum() + n_replace * w_rep)).to(rows.dtype).tolist()
        kept = sorted(zip(rest.tolist(), coef))
        out = rows[kept[0][0]].mul_(kept[0][1])  # rows is this call's own buffer: scaled in place
        for i, c in kept[1:]:
            out.add_(rows[i].mul_(c))
        self.report = {"dropped": sorted(int(i) for i in replaced), "nonfinite": bad_ranks(fin),
                       "suspicion": [float(x) for x in s]}
        return self.finish_slices(out, grads, comm)
