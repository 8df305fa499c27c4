"""pdv_ext on DeepSpeed: everything that touches a DeepSpeed engine, in one package.

- engine.py: `initialize` (drop-in for `deepspeed.initialize`) and `PDVPipelineEngine`;
- topology.py: explicit stage boundaries and rank mapping on a PipelineModule;
- glue.py: the policy layer's applier and Monitor wiring for the engine; pdv_state.py: pdv's checkpoint part;
- move.py: moving a running pipeline to a new plan; checkpoint.py and layer_state.py: state keyed by layer;
- validation.py: Zeno's validation pass through the pipeline; summary.py: the start-up log;
- internals.py: the one module that names DeepSpeed's private attributes (a tested version range).
"""
from .checkpoint import CheckpointNotFound
from .engine import GradHook, PDVPipelineEngine, apply_placement, follow_rebuild, initialize, parameter_names
from .move import MoveError, MoveReport, move_engine
from .profiling import profile_pipeline
from .topology import MappedTopology, current_mapping, row_major_mapping

__all__ = ["initialize", "PDVPipelineEngine", "GradHook", "apply_placement", "follow_rebuild", "parameter_names",
           "MappedTopology", "current_mapping", "row_major_mapping", "move_engine", "MoveError", "MoveReport",
           "profile_pipeline", "CheckpointNotFound"]
