"""DeepSpeed's pipeline topology as pdv_ext places it: an explicit (stage, replica) -> rank mapping, and the
layers of one stage built (again) under new boundaries.

Kept apart from the engine (integrations/deepspeed.py) so that what only reads a plan - the cross-plan
checkpoint, the move - needs no engine import.
"""
from __future__ import annotations

from typing import List, Sequence

from deepspeed.accelerator import get_accelerator
from torch import nn

from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology


class MappedTopology(ProcessTopology):
    """A pipe x data topology whose (stage, replica) -> global rank mapping is given explicitly.

    `rank_mapping[stage][replica] = global rank`. DeepSpeed builds its pipe and data-parallel groups
    from `mapping`, so any one-to-one assignment works (every stage has the same replica count).
    """

    def __init__(self, rank_mapping: Sequence[Sequence[int]]):
        rows = [list(map(int, r)) for r in rank_mapping]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("rank_mapping needs one equally long list of ranks per stage")
        flat = sorted(r for row in rows for r in row)
        if flat != list(range(len(flat))):
            raise ValueError(f"rank_mapping must use each rank 0..{len(flat) - 1} exactly once (got {rows})")
        super().__init__(axes=["pipe", "data"], dims=[len(rows), len(rows[0])])
        self.mapping = {self.ProcessCoord(pipe=s, data=d): r for s, row in enumerate(rows) for d, r in enumerate(row)}
        self.rank_mapping = rows


def row_major_mapping(num_stages: int, world_size: int) -> List[List[int]]:
    """DeepSpeed's default placement (PipeDataParallelTopology): stage s holds ranks s*D .. s*D+D-1."""
    dp = world_size // num_stages
    return [[s * dp + d for d in range(dp)] for s in range(num_stages)]


def current_mapping(module: PipelineModule) -> List[List[int]]:
    """The module's rank mapping, `[stage][replica] -> global rank`."""
    topo = module._topo
    p, d = topo.get_dim("pipe"), topo.get_dim("data")
    return [[topo.get_rank(pipe=s, data=r) for r in range(d)] for s in range(p)]


def build_stage_layers(module: PipelineModule, parts: List[int], stage: int) -> None:
    """The local half of `_rebuild` (no communication): drop the local layers, build those of `stage`."""
    for name in [n for n in module._modules if n.isdigit()]:
        del module._modules[name]
    module.tied_modules = nn.ModuleDict()
    module.tied_weight_attrs = {}
    module.forward_funcs = []
    module.fwd_map = {}
    module.is_checkpointable_results = []
    module.is_checkpointable_results_interval = None
    module.stage_id = stage
    module.parts = list(parts)
    module._set_bounds(start=parts[stage], stop=parts[stage + 1])
    module._build()
    module.to(get_accelerator().device_name(module.local_rank))


def link_tied_layers(module: PipelineModule) -> None:
    """The collective half of `_rebuild`: the tied layers' groups (collective over the world), their weights
    made equal from the first stage that holds them."""
    module.tied_comms = module._index_tied_modules()
    module._synchronize_tied_weights()
