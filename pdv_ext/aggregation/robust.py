"""`median` and `trimmed_mean`: the classic coordinate-wise robust baselines, plus the candidate plumbing
(slices of every rank's gradient, the non-finite candidates set aside) shared by the robust aggregators.

Every rank receives all candidates' entries of its 1/m slice (an all-to-all) and computes there: a
coordinate-wise statistic directly; a statistic over whole candidates (zeno's scores, suspicion's
distances) from partial sums of the slices, added in rank order after a small all-gather, so every rank
takes the same decision. An all-gather of the finished slices rebuilds the result on every rank: an
all-reduce's bytes instead of m - 1 gradients per rank, 1/m of the work per rank, and all replicas end
identical (each slice is computed by one rank). A candidate holding NaN/Inf anywhere is excluded (by
every rank alike) before any arithmetic: non-finite values never reach the weights.

Data shares ("count"): `median` and `trimmed_mean` count every replica once, whatever its share of the
step's samples. Their guarantee is stated in replicas (b Byzantine of m), and a share is granted to the
replica that reports itself fast (the `rebalance` policy): weighting by it would let one replica with a
large share move the statistic alone (a weighted median follows any replica holding half the weight).
Each replica's gradient is still the mean over its own samples, an unbiased estimate of the same gradient.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from pydantic import Field

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, all_finite, register_aggregator
from .groups import SmallGroups


def flat_dtype(grads: List[torch.Tensor]) -> torch.dtype:
    """float64 when any gradient is float64, else float32 (half precision is widened for scoring)."""
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def flatten_as(grads: List[torch.Tensor], dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One 1-D `dtype` buffer holding all `grads` (any dtypes) in order. Written into `out` when it fits
    (size, dtype, device): a buffer reused step after step is not allocated and faulted in again."""
    n = sum(g.numel() for g in grads)
    device = grads[0].device if grads else torch.device("cpu")
    if out is None or out.numel() != n or out.dtype != dtype or out.device != device:
        out = torch.empty(n, dtype=dtype, device=device)
    if grads:
        torch.cat([g.reshape(-1).to(dtype) for g in grads], out=out)
    return out


def write_back(flat: torch.Tensor, grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """Copy `flat` into `grads` in place (casting per tensor); returns `grads`."""
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset: offset + n].view_as(g))
        offset += n
    return grads


#: "auto": CPU tensors take the host-friendly paths (branches on host values cost nothing there), other
#: devices the sync-free ones; "device": every tensor takes the device paths (the tests run them on CPU)
PATHS = "auto"


def device_path(t: torch.Tensor) -> bool:
    return PATHS == "device" or t.device.type != "cpu"


def finite_rows(stack: torch.Tensor) -> torch.Tensor:
    """Bool mask (on `stack`'s device) of the rows of a 2-D `stack` without NaN/Inf.

    CPU: `all_finite` per row (a sum per row, the element-wise check only for a row whose sum overflows;
    host branches cost nothing there, and a sum is ~9x cheaper than a min/max reduction on CPU). Other
    devices: one pass and no host sync - a row's min and max are both finite exactly when every entry is
    (NaN propagates through both, +-inf shows in one), and unlike a sum they cannot overflow."""
    if not device_path(stack):
        return torch.tensor([all_finite([row]) for row in stack], dtype=torch.bool)
    if stack.shape[1] == 0:
        return torch.ones(stack.shape[0], dtype=torch.bool, device=stack.device)
    lo, hi = torch.aminmax(stack, dim=1)
    return torch.isfinite(lo) & torch.isfinite(hi)


def to_host(*tensors: torch.Tensor) -> List[torch.Tensor]:
    """Small device tensors (masks, scores, a Gram matrix) as float64 CPU tensors of the same shapes, in
    ONE device-to-host copy: the single host sync an aggregation call may make (CPU tensors: no sync)."""
    if not any(device_path(t) for t in tensors):
        return [t.to(torch.float64) for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu()
    out, pos = [], 0
    for t in tensors:
        out.append(flat[pos: pos + t.numel()].view(t.shape))
        pos += t.numel()
    return out


def exact(x: float, like: torch.Tensor) -> torch.Tensor:
    """`x` as a 0-dim tensor on `like`'s device (a fill, no upload). Dividing by it is a true division on
    every device; dividing a CUDA tensor by a Python number multiplies by its rounded reciprocal instead
    (torch's BinaryDivTrueKernel.cu), which can differ from the CPU's quotient in the last bit."""
    return torch.full((), x, dtype=like.dtype, device=like.device)


def host_mask(finite: torch.Tensor) -> torch.Tensor:
    """A bool mask on the host (one copy, a sync, when it is on a device)."""
    return finite if finite.device.type == "cpu" else finite.cpu()


def slice_bounds(n: int, m: int) -> List[int]:
    """Starts of the m near-equal slices of n entries (and n at the end): rank r owns [b[r], b[r+1])."""
    return [r * n // m for r in range(m + 1)]


def scatter_slices(flat: torch.Tensor, comm: Comm, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-to-all of 1/m slices: row p of the result is rank p's entries of this rank's slice of `flat`
    ((m - 1)/m of the buffer leaves and arrives on every rank: an all-reduce's reduce-scatter bytes, where
    gathering every candidate moves m - 1 times the buffer). `out` is reused when it fits."""
    m, me = comm.size, comm.rank
    b = slice_bounds(flat.numel(), m)
    lo, hi = b[me], b[me + 1]
    if out is None or out.shape != (m, hi - lo) or out.dtype != flat.dtype or out.device != flat.device:
        out = torch.empty(m, hi - lo, dtype=flat.dtype, device=flat.device)
    out[me].copy_(flat[lo:hi])
    sends = {p: flat[b[p]:b[p + 1]] for p in range(m) if p != me and b[p + 1] > b[p]}
    recvs = {p: out[p] for p in range(m) if p != me and hi > lo}
    comm.exchange(sends, recvs)
    return out


def gather_slices(flat: torch.Tensor, mine: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-gather of finished slices: this rank's `mine` goes to its slice of `flat`, every other rank's
    arrives in place in theirs. Every slice is computed by exactly one rank: all replicas end identical."""
    m, me = comm.size, comm.rank
    b = slice_bounds(flat.numel(), m)
    flat[b[me]:b[me + 1]].copy_(mine)
    sends = {p: flat[b[me]:b[me + 1]] for p in range(m) if p != me and b[me + 1] > b[me]}
    recvs = {p: flat[b[p]:b[p + 1]] for p in range(m) if p != me and b[p + 1] > b[p]}
    comm.exchange(sends, recvs)
    return flat


def agreed_finite(rows: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Bool mask over ranks (on `rows`' device, no host sync): the candidates without NaN/Inf anywhere, from
    every rank's check of its own slice (one all-reduce of m flags): identical on every rank."""
    bad = (~finite_rows(rows)).to(torch.float64)
    comm.all_reduce(bad, "sum")
    return bad == 0


def sum_partials(part: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum of every rank's `part` (partial sums over its slice), added in rank order after an all-gather:
    bitwise the same on every rank, so decisions taken from it (who is dropped) agree everywhere."""
    rows = torch.empty((comm.size,) + tuple(part.shape), dtype=part.dtype, device=part.device)
    rows[comm.rank].copy_(part)
    comm.all_gather_into(rows)
    total = rows[0].clone()
    for r in range(1, comm.size):
        total += rows[r]
    return total


def finite_stack(stack: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The finite rows of `stack`: `stack` itself when all are (no copy), else a copy of those rows. Give
    `finite` on the host (a device mask costs one sync here)."""
    fin = host_mask(finite)
    if bool(fin.all()):
        return stack
    return torch.stack([stack[i] for i in range(fin.numel()) if fin[i]])  # int indices: no index upload


def bad_ranks(finite: torch.Tensor) -> List[int]:
    return [i for i, ok in enumerate(host_mask(finite).tolist()) if not ok]


def require_some_finite(finite: torch.Tensor, name: str, step: int) -> None:
    if not bool(host_mask(finite).any()):
        raise FloatingPointError(f"{name}: every data-parallel rank sent non-finite gradients at step {step}; "
                                 "nothing to aggregate")


class RobustAggregator(SmallGroups, Aggregator):
    """Base of aggregators that tolerate Byzantine and non-finite candidates.

    Host syncs on CUDA: the statistic, the scores and the weights stay on the device; each call makes one
    device-to-host copy (`to_host`) of the few values whose host value the algorithm needs (the agreed
    finite mask: which rows to use and the report; zeno's scores, suspicion's Gram matrix: who is dropped)."""

    #: NaN/Inf from a rank are filtered out, never raised (see faults.NonFiniteGuard)
    tolerates_nonfinite = True
    #: the flat gradient and this rank's (m, n/m) slice of every candidate, reused across steps
    _flat: Optional[torch.Tensor] = None
    _rows: Optional[torch.Tensor] = None

    def alone(self, grads: List[torch.Tensor], name: str) -> List[torch.Tensor]:
        """A group of one: the statistic of one candidate is the candidate (identity), and a non-finite one
        leaves nothing to aggregate (FloatingPointError, as in a larger group where all are). One sync."""
        self._flat = flatten_as(grads, flat_dtype(grads), out=self._flat)
        fin = to_host(finite_rows(self._flat.view(1, -1)))[0] > 0
        require_some_finite(fin, name, self.step)
        self.report = {"dropped": [], "nonfinite": []}
        return grads

    def slices(self, grads: List[torch.Tensor], comm: Comm) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, finite): every candidate's entries of this rank's slice (`scatter_slices`) and the agreed
        mask of finite candidates. A coordinate-wise statistic is computed on `rows` directly; one over
        whole candidates sums partial results of the slices (`sum_partials`). Finish with
        `finish_slices`."""
        self._flat = flatten_as(grads, flat_dtype(grads), out=self._flat)
        self._rows = scatter_slices(self._flat, comm, self._rows)
        return self._rows, agreed_finite(self._rows, comm)

    def finish_slices(self, mine: torch.Tensor, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        """All-gather every rank's finished slice (`mine` is this rank's) and write the result to `grads`."""
        return write_back(gather_slices(self._flat, mine, comm), grads)


@register_aggregator("median")
class Median(RobustAggregator):
    """Coordinate-wise median of the group's gradients (mean of the two middle values for even counts).
    Tolerates up to half the ranks being Byzantine, at the price of a noisier estimate than the mean.
    Defined for every group: the candidate itself for 1, the mean of the two for 2.

    One host sync per call on CUDA: the agreed finite mask (which rows enter the median; the report)."""

    class Options(StrictModel):
        pass

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        if comm.size == 1:
            return self.alone(grads, "median")
        rows, finite = self.slices(grads, comm)
        fin = to_host(finite)[0] > 0  # the call's one host sync
        require_some_finite(fin, "median", self.step)
        self.report = {"dropped": bad_ranks(fin), "nonfinite": bad_ranks(fin)}
        return self.finish_slices(kernels.coordinate_median(finite_stack(rows, fin)), grads, comm)


@register_aggregator("trimmed_mean")
class TrimmedMean(RobustAggregator):
    """Coordinate-wise mean after dropping the `b` largest and `b` smallest values of each coordinate.
    Tolerates `b` Byzantine ranks; a group of m ranks supports b <= (m - 1) // 2 (a larger b is clamped,
    with one GroupSizeWarning: 0 for 1 or 2 ranks, the plain mean).

    One host sync per call on CUDA: the agreed finite mask (which rows are trimmed; the report)."""

    group_limits = {"b": (lambda m: (m - 1) // 2, "trimming b per side needs more than 2b ranks")}

    class Options(StrictModel):
        #: values trimmed on each side of every coordinate (the number of Byzantine ranks tolerated)
        b: int = Field(1, ge=0)

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        b = self.fit_group(comm)["b"]
        if comm.size == 1:
            return self.alone(grads, "trimmed_mean")
        rows, finite = self.slices(grads, comm)
        fin = to_host(finite)[0] > 0  # the call's one host sync
        require_some_finite(fin, "trimmed_mean", self.step)
        good = finite_stack(rows, fin)
        # a non-finite candidate was already removed: it used up one of the trims on its side
        trim = min(b, (good.shape[0] - 1) // 2)
        self.report = {"dropped": bad_ranks(fin), "nonfinite": bad_ranks(fin), "trim": trim}
        return self.finish_slices(kernels.trimmed_mean(good, trim), grads, comm)
