"""Rank-side functions for the move and cross-plan checkpoint tests (run through pdv_ext.spawn.run_ranks)."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import torch

from tests.integration.engine_mode_workers import input_dtype, mode_config

LAYERS, HIDDEN, D_IN, D_OUT = 8, 16, 16, 4


def dataset(mode: str, n: int = 512, seed: int = 5):
    """A fixed classification set (x, class of a random teacher), x in the mode's input dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = (x @ torch.randn(D_IN, D_OUT, generator=g)).argmax(-1)
    return x.to(input_dtype(mode)), y


def build(mode: str, plan: Dict[str, Any], pdv: Optional[dict] = None, micro_batch: int = 4, grad_acc: int = 2,
          seed: int = 3):
    """pdv_ext engine under `plan` ({"boundaries", "rank_mapping"}) and its ElasticBatches."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    deepspeed.init_distributed(dist_backend="gloo")
    stages, world = len(plan["rank_mapping"]), dist.get_world_size()
    dp = world // stages
    model = PipelineModule(layers=mlp_layers(LAYERS, HIDDEN, D_IN, D_OUT), num_stages=stages,
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer, base_seed=seed)
    cfg = mode_config(mode, micro_batch, grad_acc * 2 // dp, dp, lr=3e-3)
    cfg["gradient_clipping"] = 1.0
    cfg["pdv"] = {"placement": {"boundaries": plan["boundaries"], "rank_mapping": plan["rank_mapping"]}, **(pdv or {})}
    engine = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
    return engine, ElasticBatches.for_engine(engine, dataset(mode), seed=11)


def whole_state(engine) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every parameter of this rank's stage, whole (weight, master, optimizer state) by name."""
    from pdv_ext.placement.layer_state import collect_params

    return {n: {k: v.float().clone() for k, v in s.tensors().items()} for n, s in collect_params(engine).items()}


def train(engine, data, steps: int) -> List[float]:
    return [float(engine.train_batch(data_iter=data)) for _ in range(steps)]


def move_vs_resume(mode: str, plan_a: Dict[str, Any], plan_b: Dict[str, Any], ckpt: str, k: int = 2, n: int = 3,
                   pdv: Optional[dict] = None) -> Dict[str, Any]:
    """Train k steps under plan A and checkpoint; then (1) move to plan B and train n steps, (2) a fresh
    engine under plan B loads the checkpoint and trains n steps, (3) a fresh engine under plan A loads it
    and trains n steps (the run that did not move). Returns what each saw on this rank."""
    import torch.distributed as dist

    from pdv_ext.placement.move import move_engine

    eng, data = build(mode, plan_a, pdv)
    out: Dict[str, Any] = {"rank": dist.get_rank(), "first": train(eng, data, k)}
    eng.save_checkpoint(ckpt, tag="k")
    out["saved"] = whole_state(eng)
    ref = eng
    report = move_engine(eng, plan_b["boundaries"], plan_b["rank_mapping"])
    assert eng is ref
    out["report"] = report.to_dict()
    out["moved_state"] = whole_state(eng)
    out["moved_stage"] = (eng.stage_id, eng.grid.get_data_parallel_id(), list(eng.module.parts))
    out["moved"] = train(eng, data, n)
    out["moved_final"] = whole_state(eng)
    del eng, ref

    eng, data = build(mode, plan_b, pdv)
    eng.load_checkpoint(ckpt, tag="k")
    out["resumed_state"] = whole_state(eng)
    out["resumed"] = train(eng, data, n)
    out["resumed_final"] = whole_state(eng)
    del eng

    eng, data = build(mode, plan_a, pdv)
    eng.load_checkpoint(ckpt, tag="k")
    out["static"] = train(eng, data, n)
    out["static_final"] = whole_state(eng)
    return out
