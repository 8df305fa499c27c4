"""The pdv part of a DeepSpeed checkpoint: one small file per rank in the checkpoint's tag directory, with
the aggregator and its state, the batch geometry, the data shares, the policy and Monitor state and the data
position. Stored as tensors and plain types only, loaded with `weights_only=True` (a file crafted to run
code on load is refused)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional


from .glue import EngineApplier, PolicyGlue
from .runtime import runtime_of
from .safe_io import load_plain, save_plain


def _path(engine: Any, ckpt_dir: str, tag: str) -> str:
    return os.path.join(ckpt_dir, str(tag), f"pdv_state_rank{engine.global_rank:05d}.pt")


def state_of(engine: Any) -> Dict[str, Any]:
    """Everything pdv adds to a checkpoint, for this rank."""
    agg = engine.aggregator
    it = engine.data_iterator
    glue: Optional[PolicyGlue] = getattr(engine, "pdv_policy", None)
    return {
        "aggregator": {"type": agg.name, **agg.options.model_dump()},
        "aggregator_state": agg.state_dict(),
        "micro_batch_size": int(engine.train_micro_batch_size_per_gpu()),
        "micro_batches": int(engine.total_micro_batches) // int(engine.grid.get_data_parallel_world_size()),
        "data_shares": None if engine.data_shares is None else list(engine.data_shares),
        "data": it.state_dict() if hasattr(it, "state_dict") else None,
        "policy": glue.state_dict() if glue is not None else None,
    }


def save_state(engine: Any, save_dir: str, tag: Optional[str]) -> str:
    """Write this rank's pdv state next to DeepSpeed's checkpoint files (call after it saved)."""
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    path = _path(engine, save_dir, tag)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_plain(state_of(engine), path, "pdv state")
    return path


def load_state(engine: Any, load_dir: str, tag: Optional[str]) -> bool:
    """Restore this rank's pdv state (call after DeepSpeed loaded its checkpoint). Returns False when the
    checkpoint has none (e.g. written by plain DeepSpeed)."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            return False
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    path = _path(engine, load_dir, tag)
    if not os.path.isfile(path):
        return False
    # onto this rank's device (the gossip residual, zeno's validation gradient): a checkpoint written on
    # cuda:r resumes where the rank now runs, whichever GPU (or none) that is
    apply_state(engine, load_plain(path, map_location=getattr(engine, "device", "cpu")))
    return True


def apply_state(engine: Any, st: Dict[str, Any]) -> None:
    """Restore a `state_of` dict into `engine` (a checkpoint's, or one the cross-plan loader and the move
    rebuilt for this rank's new place: checkpoint.py, move.py)."""
    spec = dict(st["aggregator"])
    if spec != {"type": engine.aggregator.name, **engine.aggregator.options.model_dump()}:
        engine.set_aggregator(spec)
    engine.aggregator.load_state_dict(st["aggregator_state"])
    applier = EngineApplier(engine)
    mbs, mb, _ = applier.batch_geometry()
    if (mbs, mb) != (st["micro_batch_size"], st["micro_batches"]):
        applier.set_batch_size(st["micro_batches"], st["micro_batch_size"])
    if st.get("data_shares") != applier.data_shares():
        applier.set_data_shares(st.get("data_shares"))
    glue: Optional[PolicyGlue] = getattr(engine, "pdv_policy", None)
    if glue is not None and st.get("policy") is not None:
        glue.load_state_dict(st["policy"])
    if st.get("data") is not None:
        it = engine.data_iterator
        if hasattr(it, "load_state_dict"):
            it.load_state_dict(st["data"])
        else:  # the iterator comes with the next train_batch(data_iter=...): restore it there
            runtime_of(engine).pending_data = st["data"]
