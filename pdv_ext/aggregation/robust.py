"""`median` and `trimmed_mean`: the classic coordinate-wise robust baselines, plus the candidate plumbing
(gather every rank's gradient, set aside non-finite candidates) shared by the robust aggregators.

Every rank all-gathers the flattened candidates of its group and computes the same statistic, so all
replicas end identical. A candidate holding NaN/Inf is excluded before any arithmetic: non-finite values
never reach the weights through a robust aggregator.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from pydantic import Field

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, register_aggregator


def flat_dtype(grads: List[torch.Tensor]) -> torch.dtype:
    """float64 when any gradient is float64, else float32 (half precision is widened for scoring)."""
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def flatten_as(grads: List[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One 1-D `dtype` buffer holding all `grads` (any dtypes) in order."""
    if not grads:
        return torch.empty(0, dtype=dtype)
    return torch.cat([g.reshape(-1).to(dtype) for g in grads])


def write_back(flat: torch.Tensor, grads: List[torch.Tensor]) -> List[torch.Tensor]:
    """Copy `flat` into `grads` in place (casting per tensor); returns `grads`."""
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset: offset + n].view_as(g))
        offset += n
    return grads


def gather_candidates(grads: List[torch.Tensor], comm: Comm) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stack, finite): every rank's flattened gradient as an (m, n) tensor and a bool mask of the rows
    without NaN/Inf. Identical on every rank of `comm`."""
    flat = flatten_as(grads, flat_dtype(grads))
    stack = torch.stack(comm.all_gather(flat)) if comm.size > 1 else flat.unsqueeze(0)
    finite = torch.isfinite(stack).all(dim=1) if stack.shape[1] else torch.ones(stack.shape[0], dtype=torch.bool)
    return stack, finite


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


@register_aggregator("median")
class Median(RobustAggregator):
    """Coordinate-wise median of the group's gradients (mean of the two middle values for even counts).
    Tolerates up to half the ranks being Byzantine, at the price of a noisier estimate than the mean."""

    class Options(StrictModel):
        pass

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        stack, finite = gather_candidates(grads, comm)
        require_some_finite(finite, "median", self.step)
        self.report = {"dropped": bad_ranks(finite), "nonfinite": bad_ranks(finite)}
        return write_back(kernels.coordinate_median(stack[finite]), grads)


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
        stack, finite = gather_candidates(grads, comm)
        require_some_finite(finite, "trimmed_mean", self.step)
        good = stack[finite]
        # a non-finite candidate was already removed: it used up one of the trims on its side
        trim = min(b, (good.shape[0] - 1) // 2)
        self.report = {"dropped": bad_ranks(finite), "nonfinite": bad_ranks(finite), "trim": trim}
        return write_back(kernels.trimmed_mean(good, trim), grads)
