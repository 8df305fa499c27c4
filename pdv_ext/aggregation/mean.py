"""`mean`: the plain average, reproducing DeepSpeed's own data-parallel reduction bit for bit.

DeepSpeed flattens the gradients of each dtype into buckets of at most `bucket_elements`, all-reduces
each bucket (SUM) and then scales by 1/world (postscale, its default) or scales first (`prescale`); we do
exactly the same operations in the same order, so losses and weights match vanilla DeepSpeed exactly.
"""
from __future__ import annotations

from typing import List

import torch

from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, BufferCache, flatten, group_by_dtype, register_aggregator, unflatten_into


@register_aggregator("mean")
class Mean(Aggregator):
    """Average of all replicas' gradients (DeepSpeed's default reduction)."""

    class Options(StrictModel):
        #: scale before the all-reduce instead of after (DeepSpeed's `prescale_gradients`)
        prescale: bool = False
        #: DeepSpeed's `gradient_predivide_factor` (postscale only)
        predivide_factor: float = 1.0
        #: elements per flattened bucket (DeepSpeed's MEMORY_OPT_ALLREDUCE_SIZE)
        bucket_elements: int = 500_000_000

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffers = BufferCache()  # flat bucket buffers kept across steps (same arithmetic as a fresh one)

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        opt = self.options
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
        if opt.prescale:
            buf.mul_(1.0 / world)
            comm.all_reduce(buf, "sum")
        else:
            if opt.predivide_factor != 1.0:
                buf.mul_(1.0 / opt.predivide_factor)
            comm.all_reduce(buf, "sum")
            if opt.predivide_factor != world:
                buf.mul_(opt.predivide_factor / world)
        unflatten_into(buf, bucket)
