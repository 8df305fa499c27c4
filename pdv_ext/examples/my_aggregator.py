"""Template for your own aggregator: copy this file (`pdv example plugins DIR`), rename the class, change
`aggregate`.

Use it from the config without packaging anything (the module is looked up on sys.path, then in the
working directory):

    "pdv": {"aggregation": {"type": "my_aggregator:NormFilteredMean", "max_norm": 50.0}}

(`configs/my_plugins.json` does; in place, without copying, the name is
`pdv_ext.examples.my_aggregator:NormFilteredMean`), or give it a short name with `@pdv_ext.aggregation.register_aggregator("norm_filtered_mean")` above the
class (the name is then known once the module is imported: `--import my_aggregator.py`), or register a
name for it in your package's pyproject.toml:

    [project.entry-points."pdv_ext.aggregators"]
    norm_filtered_mean = "my_pkg.my_aggregator:NormFilteredMean"

An aggregator is configuration plus a little state. Every rank of a pipeline stage's data-parallel group
calls `aggregate(grads, comm)` with same-shaped tensors (one per parameter, the sum over this rank's
micro-batches); it returns the averaged-scale tensors every replica applies. Talk to other ranks only
through `comm` (the same class then runs under DeepSpeed and Horovod). See docs/plugins.md.
"""
from __future__ import annotations

from typing import List

import torch
from pydantic import Field

from pdv_ext.aggregation import Aggregator
from pdv_ext.config_base import StrictModel


class NormFilteredMean(Aggregator):
    """Mean over the replicas whose gradient norm is at most `max_norm` (a toy robust mean)."""

    class Options(StrictModel):  # your config keys; unknown or ill-typed keys are config errors
        max_norm: float = Field(10.0, gt=0.0)

    def aggregate(self, grads: List[torch.Tensor], comm) -> List[torch.Tensor]:
        norm = torch.stack([(g.double() ** 2).sum() for g in grads]).sum().sqrt().reshape(1)
        norms = torch.cat(comm.all_gather(norm))  # every replica's norm, on every rank
        keep = (norms <= self.options.max_norm).tolist()
        for g in grads:
            if not keep[comm.rank]:
                g.zero_()
            comm.all_reduce(g, "sum")
            g.div_(max(sum(keep), 1))
        self.report = {"dropped": [r for r, k in enumerate(keep) if not k]}  # the Monitor's `dropped` column
        return grads
