"""DeepSpeed's pipeline topology as pdv_ext places it: an explicit (stage, replica) -> rank mapping, and the
layers of one stage built (again) under new boundaries.

Kept apart from the engine (engine.py) so that what only reads a plan - the cross-plan checkpoint, the
move - needs no engine import. DeepSpeed's private parts are reached through internals.py.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology

from ...placement.plan import Layout, row_major_mapping  # noqa: F401  (importable from here too)
from . import internals


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


def topology_mapping(topo: ProcessTopology) -> List[List[int]]:
    """A topology's rank mapping, `[stage][replica] -> global rank`."""
    p, d = topo.get_dim("pipe"), topo.get_dim("data")
    return [[topo.get_rank(pipe=s, data=r) for r in range(d)] for s in range(p)]


def current_mapping(module: PipelineModule) -> List[List[int]]:
    """The module's rank mapping, `[stage][replica] -> global rank`."""
    return topology_mapping(internals.module_topology(module))


def module_layout(module: PipelineModule) -> Layout:
    """The plan a PipelineModule is built under: its boundaries (`parts`) and rank mapping."""
    return Layout(module.parts, current_mapping(module))


def engine_mapping(engine: Any) -> List[List[int]]:
    """A live engine's rank mapping (its grid's topology)."""
    return topology_mapping(internals.grid_topology(engine.grid))


def engine_layout(engine: Any, world: int) -> List[Tuple[int, int]]:
    """(stage, replica) of each of the `world` global ranks of a live engine."""
    topo = internals.grid_topology(engine.grid)
    return [(topo.get_coord(r).pipe, topo.get_coord(r).data) for r in range(world)]


def build_stage_layers(module: PipelineModule, parts: List[int], stage: int) -> None:
    """The local half of a re-partition (no communication): drop the local layers, build those of `stage`."""
    internals.rebuild_stage(module, parts, stage, get_accelerator().device_name(module.local_rank))


def link_tied_layers(module: PipelineModule) -> None:
    """The collective half of a re-partition: the tied layers' groups (collective over the world), their
    weights made equal from the first stage that holds them."""
    internals.link_tied(module)
