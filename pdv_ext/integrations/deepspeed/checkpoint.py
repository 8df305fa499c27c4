"""A checkpoint that outlives its plan: the layer-keyed form PDVPipelineEngine.save_checkpoint writes.

DeepSpeed's pipeline checkpoint keeps the weights by layer (`layer_NN-model_states.pt`) but the optimizer
by stage and data-parallel rank (`mp_rank_*`, `zero_pp_rank_*`): a stage that holds other layers, or a
ZeRO / BF16 partition of another width, cannot load it. Beside it, in `<save_dir>/<tag>/pdv_layers/`:

- `layer_NN.pt`, one per pipeline layer with parameters or buffers (written by replica 0 of the stage
  that holds it): for each of its parameters and buffers, by name, the weight, the fp32 master copy,
  the optimizer state as whole tensors (Adam's moments and step), and for every data-parallel replica
  its per-parameter aggregator state (gossip's residuals, zeno's validation gradient). Where replicas
  hold different weights (gossip in fp32), each replica's weights and optimizer state.
- `meta.pt` (written by the rank of stage 0, replica 0): the plan it was written under, step counters,
  LR schedule, optimizer hyper-parameters, loss scaler, pdv's aggregator, batch, data and policy state.

`load_layer_checkpoint` restores it into an engine of any plan over the same layers: each rank reads
the files of its own layers and keeps the fragments its partition owns. PDVPipelineEngine.load_checkpoint
takes this path by itself when the checkpoint's plan differs from the engine's.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from ...config_base import ConfigError
from ...placement.layer_state import ParamState, is_aggregator_key, local_names
from . import internals
from .layer_state import (apply_global_state, apply_params, collect_params, global_state, join_aggregator_state,
                          layers_of, split_aggregator_state)
from .pdv_state import apply_state, state_of
from .safe_io import load_plain, save_plain
from .topology import current_mapping, module_layout

FORMAT = "pdv-layer-state"
VERSION = 1
SUBDIR = "pdv_layers"


def plan_of(engine: Any) -> Dict[str, Any]:
    """The engine's plan: stage boundaries (DeepSpeed's `parts`) and rank mapping `[stage][replica]`."""
    return module_layout(engine.module).to_dict()


def replicas_differ(engine: Any) -> bool:
    """Whether the replicas of a stage hold different weights (gossip applies different updates; under
    BF16_Optimizer and ZeRO the partitioned step gathers the same weights everywhere)."""
    return getattr(engine, "reduce_mode", "engine") == "engine" and not getattr(engine.aggregator,
                                                                             "replicas_identical", True)


def resolve_tag(load_dir: str, tag: Any) -> Optional[str]:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


class CheckpointNotFound(ConfigError):
    """`engine.load_checkpoint(dir)` found nothing to load (DeepSpeed's own loader logs a warning and starts
    from scratch: a mistyped path lost the run without a word). A ConfigError: uncaught, its lines once and
    exit 2 (user_errors.py)."""

    heading = "pdv_ext: no checkpoint to load (fix the path, or pass missing_ok=True to start from scratch):"


def missing_checkpoint(load_dir: Any, tag: Any = None, latest: str = "latest") -> Optional[str]:
    """Why `load_dir` (with `tag`, or the tag its `latest` file names) holds no checkpoint to load, or None
    when there is one to try. `latest` is DeepSpeed's tag file (`latest_universal` for universal checkpoints)."""
    where = os.fspath(load_dir)
    if not os.path.isdir(where):
        return f"load_checkpoint: {where!r} does not exist" + (" (or is not a folder)" if os.path.exists(where) else "")
    if tag is None:
        if not os.path.isfile(os.path.join(where, latest)):
            return (f"load_checkpoint: {where!r} has no {latest!r} file naming the checkpoint to load "
                    "(pass tag=... to load a named one)")
        with open(os.path.join(where, latest), encoding="utf-8") as f:
            tag = f.read().strip()
        if not os.path.isdir(os.path.join(where, tag)):
            return f"load_checkpoint: {os.path.join(where, latest)!r} names {tag!r}, but {where!r} has no such folder"
        return None
    if not os.path.isdir(os.path.join(where, str(tag))):
        return f"load_checkpoint: {where!r} has no checkpoint {str(tag)!r} (no folder {os.path.join(where, str(tag))!r})"
    return None


def layer_dir(ckpt_dir: str, tag: Any) -> str:
    return os.path.join(ckpt_dir, str(tag), SUBDIR)


def _replica_part(st: ParamState, whole: bool) -> Dict[str, Any]:
    """What replica d > 0 adds to replica 0's entry: its aggregator state (and, where replicas differ,
    everything)."""
    if whole:
        return {"tensors": st.tensors(), "scalars": st.scalars()}
    return {"tensors": {k: v for k, v in st.tensors().items() if is_aggregator_key(k)},
            "scalars": {k: v for k, v in st.scalars().items() if is_aggregator_key(k)}}


def local_entries(engine: Any, copy: bool = True) -> Tuple[Dict[str, ParamState], Dict[str, Any]]:
    """This rank's parameters, whole, with its replica's aggregator state, and its pdv state without
    the per-parameter part (collective over the stage's data-parallel group). `copy=False`: the live tensors
    where they are whole (`collect_params`), for a caller that copies them before the next step."""
    states = collect_params(engine, copy=copy)
    pdv = state_of(engine)
    pdv["aggregator_state"], per = split_aggregator_state(engine)
    for name, agg in per.items():
        states[name].aggregator = agg
    return states, pdv


def stage_layer_entries(engine: Any, copy: bool = True) -> Tuple[Dict[int, Dict[str, Any]], Dict[str, Any], bool]:
    """What the layer files of this rank's stage hold ({layer: {name: entry}}), this rank's pdv state and
    whether replicas differ. Collective over the stage's data-parallel group (each replica's own part is
    gathered where replicas differ or keep aggregator state); every replica gets the same entries.
    `copy=False`: see `local_entries`."""
    states, pdv = local_entries(engine, copy)
    grid = engine.grid
    dp_group, dp_size = grid.get_data_parallel_group(), grid.get_data_parallel_world_size()
    whole = replicas_differ(engine)
    mine = {n: _replica_part(s, whole) for n, s in states.items()}
    replicas: List[Dict[str, Any]] = [mine]
    if dp_size > 1 and (whole or any(s.aggregator for s in states.values())):
        replicas = [None] * dp_size  # type: ignore[list-item]
        dist.all_gather_object(replicas, mine, group=dp_group)
    module = engine.module
    start, stop = module.parts[engine.stage_id], module.parts[engine.stage_id + 1]
    by_layer: Dict[int, Dict[str, Any]] = {}
    dp_id = grid.get_data_parallel_id()
    for name, st in states.items():
        if dp_id == 0 or len(replicas) == 1:  # (one part only: the replicas hold the same state)
            tensors, scalars = st.tensors(), st.scalars()
        elif whole:  # another replica writes replica 0's entry as replica 0 would
            tensors, scalars = replicas[0][name]["tensors"], replicas[0][name]["scalars"]
        else:  # identical replicas: this replica's weights and optimizer state, replica 0's aggregator part
            tensors = {**{k: v for k, v in st.tensors().items() if not is_aggregator_key(k)},
                       **replicas[0][name]["tensors"]}
            scalars = {**{k: v for k, v in st.scalars().items() if not is_aggregator_key(k)},
                       **replicas[0][name]["scalars"]}
        entry = {"tensors": tensors, "scalars": scalars, "replicas": [None] + [r.get(name) for r in replicas[1:]]}
        for layer in layers_of(module, name):
            if start <= layer < stop:
                by_layer.setdefault(layer, {})[name] = entry
    return by_layer, pdv, whole


def meta_of(engine: Any, pdv: Dict[str, Any], whole: bool, client_state: Any = None) -> Dict[str, Any]:
    """The layer-keyed form's `meta.pt` (from the rank of stage 0, replica 0)."""
    return {"format": FORMAT, "version": VERSION, "plan": plan_of(engine), "world_size": dist.get_world_size(),
            "num_layers": int(internals.num_layers(engine.module)),
            "replicas": engine.grid.get_data_parallel_world_size(), "replicas_differ": whole,
            "global": global_state(engine), "pdv": pdv, "client_state": client_state,
            "precision": {"bf16": bool(engine.bfloat16_enabled()), "fp16": bool(engine.fp16_enabled()),
                          "zero_stage": int(engine.zero_optimization_stage())}}


def save_layer_checkpoint(engine: Any, save_dir: str, tag: Any = None, client_state: Any = None) -> int:
    """Write the layer-keyed form of `engine`'s state (collective: every rank calls it after DeepSpeed's
    save_checkpoint). Returns the bytes this rank wrote."""
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    out = layer_dir(save_dir, tag)
    by_layer, pdv, whole = stage_layer_entries(engine)
    written = 0
    if engine.grid.get_data_parallel_id() == 0:
        os.makedirs(out, exist_ok=True)
        for layer, entries in sorted(by_layer.items()):
            written += save_plain(entries, os.path.join(out, f"layer_{layer:02d}.pt"), f"layer {layer}")
    if current_mapping(engine.module)[0][0] == engine.global_rank:
        os.makedirs(out, exist_ok=True)
        written += save_plain(meta_of(engine, pdv, whole, client_state), os.path.join(out, "meta.pt"), "meta")
    return written


def read_meta(load_dir: str, tag: Any) -> Optional[Dict[str, Any]]:
    """The checkpoint's `meta.pt`, or None when it has no layer-keyed form."""
    tag = resolve_tag(load_dir, tag)
    path = os.path.join(layer_dir(load_dir, tag), "meta.pt") if tag is not None else None
    if path is None or not os.path.isfile(path):
        return None
    meta = load_plain(path)
    if meta.get("format") != FORMAT or int(meta.get("version", 0)) > VERSION:
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file")
    return meta


def replica_state(entry: Dict[str, Any], replica: int, device: Any) -> ParamState:
    """Replica `replica`'s state from a layer file entry: replica 0's, with the replica's own aggregator
    state (zeros later, for a replica the writing run did not have) or whole state (replicas differ)."""
    tensors = {k: v for k, v in entry["tensors"].items() if not is_aggregator_key(k) or replica == 0}
    scalars = {k: v for k, v in entry["scalars"].items() if not is_aggregator_key(k) or replica == 0}
    extra = entry["replicas"][replica] if 0 < replica < len(entry["replicas"]) else None
    if extra is not None:
        tensors.update(extra["tensors"])
        scalars.update(extra["scalars"])
    return ParamState.from_parts({k: v.to(device) for k, v in tensors.items()}, scalars)


def read_states(engine: Any, load_dir: str, tag: str) -> Dict[str, ParamState]:
    """This rank's parameters and buffers from the layer files of its stage."""
    module = engine.module
    start, stop = module.parts[engine.stage_id], module.parts[engine.stage_id + 1]
    d = engine.grid.get_data_parallel_id()
    folder = layer_dir(load_dir, tag)
    found: Dict[str, ParamState] = {}
    for layer in range(start, stop):
        path = os.path.join(folder, f"layer_{layer:02d}.pt")
        if not os.path.isfile(path):
            continue
        for name, entry in load_plain(path).items():
            if name not in found:
                found[name] = replica_state(entry, d, engine.device)
    return found


def rebased_pdv_state(engine: Any, pdv: Dict[str, Any], per: Dict[str, Dict[str, Any]],
                      train_batch_size: int) -> Dict[str, Any]:
    """pdv's saved state made to fit this engine's place: the aggregator state joined in this stage's
    order, and as many micro-batches per replica as keep the global batch of the run that saved it."""
    st = dict(pdv)
    st["aggregator_state"] = join_aggregator_state(engine, pdv["aggregator_state"], per)
    dp = engine.grid.get_data_parallel_world_size()
    mbs = int(pdv["micro_batch_size"])
    if train_batch_size % (mbs * dp):
        raise ConfigError([f"train_batch_size: the checkpoint's global batch {train_batch_size} is not a multiple of "
                           f"micro-batch size {mbs} x {dp} data-parallel replicas under the new plan"])
    st["micro_batches"] = train_batch_size // (mbs * dp)
    shares = st.get("data_shares")
    if shares is not None and len(shares) != dp:  # shares are per replica of the saving plan: equal split
        st["data_shares"] = None
    return st


def load_layer_checkpoint(engine: Any, load_dir: str, tag: Any = None, load_optimizer_states: bool = True,
                          load_lr_scheduler_states: bool = True, load_module_only: bool = False
                          ) -> Tuple[Optional[str], Dict[str, Any]]:
    """Restore the layer-keyed form into `engine` (any plan over the same layers). Returns DeepSpeed's
    `(load_path, client_state)`, `(None, {})` when there is no such checkpoint."""
    tag = resolve_tag(load_dir, tag)
    meta = read_meta(load_dir, tag)
    if meta is None:
        return None, {}
    if int(meta["num_layers"]) != int(internals.num_layers(engine.module)):
        raise ConfigError([f"load_checkpoint: the checkpoint has {meta['num_layers']} pipeline layers, the model "
                           f"{internals.num_layers(engine.module)}"])
    states = read_states(engine, load_dir, tag)
    missing = sorted(set(local_names(engine.module)) - set(states))
    if missing:
        raise ConfigError([f"load_checkpoint: {os.path.join(load_dir, tag, SUBDIR)} has no state for "
                           f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}"])
    keep_optimizer = load_module_only or not load_optimizer_states
    if keep_optimizer:  # weights (and fp32 masters from them), optimizer state as it is
        states = {n: ParamState(weight=s.weight, group=s.group, is_buffer=s.is_buffer, aggregator=s.aggregator)
                  for n, s in states.items()}
    apply_params(engine, states, keep_optimizer=keep_optimizer)
    if not load_module_only:
        g = dict(meta["global"])
        if not load_lr_scheduler_states:
            g["lr_scheduler"] = None
        apply_global_state(engine, g)
        per = {n: s.aggregator for n, s in states.items()}
        apply_state(engine, rebased_pdv_state(engine, meta["pdv"], per, int(g["train_batch_size"])))
    return os.path.join(load_dir, str(tag)), dict(meta.get("client_state") or {})
