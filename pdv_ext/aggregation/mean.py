"""`mean`: the plain average, reproducing DeepSpeed's own data-parallel reduction bit for bit.

DeepSpeed flattens the gradients of each dtype into buckets of at most `bucket_elements`, all-reduces
each bucket (SUM) and then scales by 1/world (postscale, its default) or scales first (`prescale`); we do
exactly the same operations in the same order, so losses and weights match vanilla DeepSpeed exactly.

Data shares ("weight"): with unequal per-rank sample counts each rank's bucket is first multiplied by
m x its share of the step's samples, so the average becomes the sample-weighted mean - the exact mean over
every sample of the step, whatever the split (one more rounded product per element). Equal shares take the
path above unchanged: bit-identical to DeepSpeed.

Small groups: defined for every group; a group of one is the identity (the sum of one, times 1/1).
Devices: element-wise adds in the comm's order and one rounded scale, so CPU and CUDA give the same bits
for the same reduction order. Host syncs on CUDA: one per bucket (one bucket unless the gradients exceed
`bucket_elements`), the non-finite check of the reduced buffer (`base.sums_finite`), which decides whether
ranks are asked who sent NaN/Inf; a second one only when that sum is not finite (the exact check of the
buffer and of this rank's input together, `base.finite_flags`).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..comm.base import Comm
from ..config_base import StrictModel
from .base import (Aggregator, BufferCache, finite_flags, flatten, group_by_dtype, register_aggregator, sums_finite,
                   unflatten_into)


@register_aggregator("mean")
class Mean(Aggregator):
    """Average of all replicas' gradients (DeepSpeed's default reduction)."""

    #: a NaN/Inf in any rank's input reaches the reduced buffer, so one sum over it (contiguous) checks
    #: every rank; the inputs are still intact then, so the culprit can be named
    checks_nonfinite = True
    shares = "weight"

    class Options(StrictModel):
        #: scale before the all-reduce instead of after (DeepSpeed's `prescale_gradients`)
        prescale: bool = False
        #: DeepSpeed's `gradient_predivide_factor` (postscale only)
        predivide_factor: float = 1.0
        #: elements per flattened bucket (DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE)
        bucket_elements: int = 500_000_000

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffers = BufferCache()
        self._factor: Optional[float] = None
        self.nonfinite_local_ok: Optional[bool] = None  # flat bucket buffers kept across steps (same arithmetic as a fresh one)

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        opt = self.options
        self.nonfinite_local_ok = None
        self._factor = self.share_factor(comm)  # None: equal shares, DeepSpeed's arithmetic exactly
        for idx in group_by_dtype(grads).values():
            bucket: List[torch.Tensor] = []
            numel = 0
            for i in idx:
                bucket.append(grads[i])
                numel += grads[i].numel()
                if numel > opt.bucket_elements:
                    self._reduce_bucket(bucket, comm)
                    bucket, numel = [], 0
            if bucket:
                self._reduce_bucket(bucket, comm)
        return grads

    def _reduce_bucket(self, bucket: List[torch.Tensor], comm: Comm) -> None:
        opt, world = self.options, comm.size
        buf = flatten(bucket, out=self._buffers.get(bucket))
        weight = 1.0 if self._factor is None else self._factor  # m x this rank's share of the samples
        if opt.prescale:
            buf.mul_(weight / world)
            comm.all_reduce(buf, "sum")
        else:
            if opt.predivide_factor != 1.0 or weight != 1.0:
                buf.mul_(weight / opt.predivide_factor)
            comm.all_reduce(buf, "sum")
        # DeepSpeed's postscale (buf *= predivide / world), fused into the copy back: the same rounding per
        # element, one pass over the bucket fewer. A factor above 1 could overflow a finite sum, so then
        # the bucket is scaled first and the finite check sees the scaled values.
        scale = 1.0 if opt.prescale or opt.predivide_factor == world else opt.predivide_factor / world
        if scale > 1.0:
            buf.mul_(scale)
            scale = 1.0
        if not sums_finite([buf]):  # some rank's input (or the sum) may not be finite
            # the exact check of the reduced buffer and of this rank's input (not yet overwritten) in one read
            flags = finite_flags([buf] + bucket)
            if not flags[0]:
                mine = all(flags[1:])
                self.nonfinite_local_ok = mine if self.nonfinite_local_ok is None else (self.nonfinite_local_ok and mine)
        unflatten_into(buf, bucket, scale)
