"""pdv's own run-time state of one engine, in one object (`engine.pdv_runtime`).

A move rebuilds the engine in the same processes from what `initialize` was given; a checkpoint or a move
restores a data position that only the iterator of the next `train_batch` can take; Zeno keeps a validation
runner. These lived as loose attributes set on the engine from several files; here they are one value that
a move carries over with the rest of the engine's state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass
class EngineRuntime:
    #: what `initialize` built the engine from (args, optimizer, model_parameters, ..., the DeepSpeed config):
    #: a move builds the new engine from the same
    build: Dict[str, Any] = field(default_factory=dict)
    #: a data position (an iterator's state_dict) for the iterator of the next train_batch
    pending_data: Optional[Dict[str, Any]] = None
    #: (replica, replicas) this rank feeds after a move, for the same iterator
    pending_replica: Optional[Tuple[int, int]] = None
    #: Zeno's validation runner (validation.PipelineValidation), built at first use
    validation: Any = None
    #: in-place recovery's state (inplace.InPlace) under `pdv.snapshots.in_place`
    in_place: Any = None


def runtime_of(engine: Any) -> EngineRuntime:
    """The engine's runtime state (one made for an engine that has none yet)."""
    rt = getattr(engine, "pdv_runtime", None)
    if rt is None:
        rt = EngineRuntime()
        engine.pdv_runtime = rt
    return rt
