"""Rank-side functions for the move and cross-plan checkpoint tests (run through pdv_ext.spawn.run_ranks).

One spawn runs several scenarios one after the other (each builds its own engines), so the whole matrix
pays the ranks' start-up once.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Dict, List, Optional

import torch

from tests.integration.engine_mode_workers import input_dtype, mode_config

LAYERS, HIDDEN, D_IN, D_OUT = 8, 16, 16, 4


def dataset(mode: str, n: int = 512, seed: int = 5):
    """A fixed classification set (x, class of a random teacher), x in the mode's input dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = (x @ torch.randn(D_IN, D_OUT, generator=g)).argmax(-1)
    return x.to(input_dtype(mode)), y


def layer_specs(tied: bool) -> list:
    """mlp_layers(8); with `tied`, blocks 1 and 6 are one tied module (a TiedLayerSpec on two stages)."""
    from deepspeed.pipe import TiedLayerSpec

    from pdv_ext.models import MLPBlock, mlp_layers

    specs = mlp_layers(LAYERS, HIDDEN, D_IN, D_OUT)
    if tied:
        for i in (1, LAYERS - 2):
            specs[i] = TiedLayerSpec("block", MLPBlock, HIDDEN, tied_weight_attr=["fc.weight", "fc.bias"])
    return specs


def build(mode: str, plan: Dict[str, Any], pdv: Optional[dict] = None, tied: bool = False, micro_batch: int = 4,
          seed: int = 3):
    """A pdv_ext engine under `plan` ({"boundaries", "rank_mapping"}), global batch 4 micro-batches of
    `micro_batch`, and its ElasticBatches."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import seed_layer
    from pdv_ext.policy.data import ElasticBatches

    deepspeed.init_distributed(dist_backend="gloo")
    stages, world = len(plan["rank_mapping"]), dist.get_world_size()
    dp = world // stages
    model = PipelineModule(layers=layer_specs(tied), num_stages=stages, loss_fn=torch.nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer, base_seed=seed)
    cfg = mode_config(mode, micro_batch, 4 // dp, dp, lr=3e-3)
    cfg["gradient_clipping"] = 1.0
    cfg["pdv"] = {"placement": {"boundaries": plan["boundaries"], "rank_mapping": plan["rank_mapping"]}, **(pdv or {})}
    engine = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
    return engine, ElasticBatches.for_engine(engine, dataset(mode), seed=11)


def whole_state(engine) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every parameter of this rank's stage, whole (weight, master, optimizer and aggregator state) by name."""
    from pdv_ext.integrations.deepspeed.checkpoint import local_entries

    states, _ = local_entries(engine)
    return {n: {k: v.float().clone() for k, v in s.tensors().items()} for n, s in states.items()}


def train(engine, data, steps: int) -> List[float]:
    return [float(engine.train_batch(data_iter=data)) for _ in range(steps)]


def tree_digest(path: str) -> str:
    """sha256 over every file's name and bytes under `path`."""
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(os.path.relpath(p, path).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def failing_moves(engine, plan_b: Dict[str, Any], failures: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Moves that fail on one rank (`{"phase", "rank", "error"}`, error "oom" or "runtime"): what each
    rank saw."""
    import torch.distributed as dist

    from pdv_ext.integrations.deepspeed.move import MoveError, move_engine

    seen = []
    for f in failures:
        def hook(phase: str, f=f) -> None:
            if phase == f["phase"] and dist.get_rank() == f["rank"]:
                if f["error"] == "oom":  # what allocating the new stage would raise
                    raise torch.OutOfMemoryError("injected: out of memory building the new stage")
                raise RuntimeError("injected: this rank died mid-move")

        try:
            move_engine(engine, plan_b["boundaries"], plan_b["rank_mapping"], on_phase=hook)
            seen.append({"error": None})
        except MoveError as exc:
            seen.append({"error": str(exc), "type": type(exc).__name__, "phase": exc.phase,
                         "failed_ranks": sorted(exc.failures)})
    return seen


def scenario(mode: str, plan_a: Dict[str, Any], plan_b: Dict[str, Any], ckpt: str, k: int = 2, n: int = 2,
             pdv: Optional[dict] = None, tied: bool = False,
             failures: Optional[List[Dict[str, Any]]] = None,
             bad_plans: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Under plan A: k steps, checkpoint "k"; optionally moves that fail (then the state must be as saved
    and the checkpoint untouched); one step, checkpoint "k1"; move to plan B; n steps ("moved").
    A fresh engine under plan B loads "k1" and trains n steps ("resumed"); a fresh engine under plan A
    loads "k" and trains 1 + n steps ("static": the run that never moved)."""
    import torch.distributed as dist

    from pdv_ext.integrations.deepspeed.move import move_engine

    eng, data = build(mode, plan_a, pdv, tied)
    out: Dict[str, Any] = {"rank": dist.get_rank()}
    out["first"] = train(eng, data, k)
    eng.save_checkpoint(ckpt, tag="k")
    saved = whole_state(eng)
    if failures:
        dist.barrier()  # every rank has written its files
        digest = tree_digest(ckpt)
        out["failures"] = failing_moves(eng, plan_b, failures)
        out["plan_after_failures"] = (list(eng.module.parts), eng.stage_id, eng.grid.get_data_parallel_id())
        now = whole_state(eng)
        out["state_kept"] = now.keys() == saved.keys() and all(
            now[n].keys() == saved[n].keys() and all(torch.equal(now[n][f], saved[n][f]) for f in saved[n])
            for n in saved)
        out["checkpoint_kept"] = tree_digest(ckpt) == digest
    if bad_plans:  # bad input: one ConfigError on every rank, nothing moved
        from pdv_ext.config_base import ConfigError

        out["bad_plans"] = []
        for plan in bad_plans:
            try:
                move_engine(eng, plan["boundaries"], plan["rank_mapping"])
                out["bad_plans"].append(None)
            except ConfigError as exc:
                out["bad_plans"].append(str(exc))
    out["after_failures"] = train(eng, data, 1)
    eng.save_checkpoint(ckpt, tag="k1")
    out["saved"] = whole_state(eng)
    ref = eng
    report = move_engine(eng, plan_b["boundaries"], plan_b["rank_mapping"])
    out["same_object"] = eng is ref
    out["report"] = report.to_dict()
    out["moved_state"] = whole_state(eng)
    out["moved"] = train(eng, data, n)
    out["moved_place"] = (list(eng.module.parts), eng.stage_id, eng.grid.get_data_parallel_id(),
                          eng.gradient_accumulation_steps(), data.dp_rank, data.dp_size)
    out["moved_final"] = whole_state(eng)
    del eng, ref

    eng, data = build(mode, plan_b, pdv, tied)
    eng.load_checkpoint(ckpt, tag="k1")
    out["resumed_state"] = whole_state(eng)
    out["resumed"] = train(eng, data, n)
    out["resumed_final"] = whole_state(eng)
    del eng

    eng, data = build(mode, plan_a, pdv, tied)
    eng.load_checkpoint(ckpt, tag="k")
    out["static"] = train(eng, data, 1 + n)
    out["static_final"] = whole_state(eng)
    return out


def scenarios(runs: List[Dict[str, Any]], ckpt_root: str) -> Dict[str, Any]:
    """`scenario(**run)` for each run (its `label` names the result; checkpoints under ckpt_root/label)."""
    out = {}
    for run in runs:
        run = dict(run)
        label = run.pop("label")
        t = time.perf_counter()
        out[label] = scenario(ckpt=os.path.join(ckpt_root, label), **run)
        out[label]["seconds"] = time.perf_counter() - t
    return out
