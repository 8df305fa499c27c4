"""`median` and `trimmed_mean`: the classic coordinate-wise robust baselines, plus the candidate plumbing
(gather every rank's gradient, set aside non-finite candidates) shared by the robust aggregators.

Every rank all-gathers the flattened candidates of its group and computes the same statistic, so all
replicas end identical. A candidate holding NaN/Inf is excluded before any arithmetic: non-finite values
never reach the weights through a robust aggregator.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from pydantic import Field

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, register_aggregator


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


def finite_rows(stack: torch.Tensor) -> torch.Tensor:
    """Bool mask of the rows of `stack` without NaN/Inf. A row's plain sum is finite exactly when the
    row is, unless huge finite values overflow it: only such rows get the element-wise check
    (`isfinite` over 4 x 64 MB cost 1.1 s, the sums 60 ms)."""
    finite = torch.ones(stack.shape[0], dtype=torch.bool)
    for i in range(stack.shape[0]):
        if stack.shape[1] and not bool(torch.isfinite(stack[i].sum())):
            finite[i] = bool(torch.isfinite(stack[i]).all())
    return finite


def gather_candidates(grads: List[torch.Tensor], comm: Comm,
                      out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stack, finite): every rank's flattened gradient as an (m, n) tensor and a bool mask of the rows
    without NaN/Inf. Identical on every rank of `comm`. This rank's gradients are flattened into its own
    row and the others received into theirs (`Comm.all_gather_into`); `out`, when it has the right
    shape and dtype, is that buffer (reused step after step: no 256 MB to allocate and fault in)."""
    dtype = flat_dtype(grads)
    n = sum(g.numel() for g in grads)
    device = grads[0].device if grads else torch.device("cpu")
    if out is None or out.shape != (comm.size, n) or out.dtype != dtype or out.device != device:
        out = torch.empty(comm.size, n, dtype=dtype, device=device)
    flatten_as(grads, dtype, out=out[comm.rank])
    comm.all_gather_into(out)
    return out, finite_rows(out)


def finite_stack(stack: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """The finite rows of `stack`: `stack` itself when all are (no copy), else a copy of those rows."""
    return stack if bool(finite.all()) else stack[finite]


def bad_ranks(finite: torch.Tensor) -> List[int]:
    return [int(i) for i in torch.nonzero(~finite).flatten()]


def require_some_finite(finite: torch.Tensor, name: str, step: int) -> None:
    if not bool(finite.any()):
        raise FloatingPointError(f"{name}: every data-parallel rank sent non-finite gradients at step {step}; "
                                 "nothing to aggregate")


class RobustAggregator(Aggregator):
    """Base of aggregators that tolerate Byzantine and non-finite candidates."""

    #: NaN/Inf from a rank are filtered out, never raised (see faults.NonFiniteGuard)
    tolerates_nonfinite = True
    #: the (m, n) buffer the candidates are gathered into, reused across steps
    _stack: Optional[torch.Tensor] = None

    def gather(self, grads: List[torch.Tensor], comm: Comm) -> Tuple[torch.Tensor, torch.Tensor]:
        """`gather_candidates` into this aggregator's reused (m, n) buffer."""
        stack, finite = gather_candidates(grads, comm, self._stack)
        self._stack = stack
        return stack, finite


@register_aggregator("median")
class Median(RobustAggregator):
    """Coordinate-wise median of the group's gradients (mean of the two middle values for even counts).
    Tolerates up to half the ranks being Byzantine, at the price of a noisier estimate than the mean."""

    class Options(StrictModel):
        pass

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        stack, finite = self.gather(grads, comm)
        require_some_finite(finite, "median", self.step)
        self.report = {"dropped": bad_ranks(finite), "nonfinite": bad_ranks(finite)}
        return write_back(kernels.coordinate_median(finite_stack(stack, finite)), grads)


@register_aggregator("trimmed_mean")
class TrimmedMean(RobustAggregator):
    """Coordinate-wise mean after dropping the `b` largest and `b` smallest values of each coordinate.
    Tolerates `b` Byzantine ranks; needs a group larger than `2 b`."""

    class Options(StrictModel):
        #: values trimmed on each side of every coordinate (the number of Byzantine ranks tolerated)
        b: int = Field(1, ge=0)

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        b = self.options.b
        if 2 * b >= comm.size:
            from ..config_base import ConfigError

            raise ConfigError([f"pdv.aggregation.b: trimming {b} on each side needs a data-parallel group of more "
                               f"than {2 * b} ranks; this group has {comm.size}"])
        stack, finite = self.gather(grads, comm)
        require_some_finite(finite, "trimmed_mean", self.step)
        good = finite_stack(stack, finite)
        # a non-finite candidate was already removed: it used up one of the trims on its side
        trim = min(b, (good.shape[0] - 1) // 2)
        self.report = {"dropped": bad_ranks(finite), "nonfinite": bad_ranks(finite), "trim": trim}
        return write_back(kernels.trimmed_mean(good, trim), grads)
