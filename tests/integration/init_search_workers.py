"""Rank-side functions of the init-search integration tests (run through pdv_ext.spawn.run_ranks)."""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn


def search_both(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Both scenarios in one set of rank processes (process start-up dominates the test time)."""
    return {"standalone": search_standalone(cfg), "pipeline": search_pipeline(cfg)}


def search_standalone(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """search_init over TorchComm with a model seeded differently on each rank and rank-local data."""
    import deepspeed
    import torch.distributed as dist

    from pdv_ext.comm import TorchComm
    from pdv_ext.init_search import search_init
    from pdv_ext.models import synthetic_batches

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # different starting weights per rank: the search must make them one
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = search_init(model, nn.functional.cross_entropy, synthetic_batches(16, 4, 8, seed=rank), TorchComm(), cfg)
    return {"rank": rank, "report": report, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def search_pipeline(cfg: Dict[str, Any], steps: int = 2) -> Dict[str, Any]:
    """pdv_ext.initialize with `pdv.init_search` on a 2-stage MLP pipeline; returns this stage's weights and the
    full winner model the search produced (captured by wrapping search_init)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    import torch.distributed as dist

    import pdv_ext
    import pdv_ext.init_search as init_search
    from pdv_ext.models import mlp_layers, seed_layer, synthetic_batches

    from .workers import ds_config

    captured: Dict[str, Any] = {}
    original = init_search.search_init

    def recording(model, *args, **kwargs):
        report = original(model, *args, **kwargs)
        captured["full"] = {k: v.clone() for k, v in model.state_dict().items()}
        return report

    init_search.search_init = recording
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers=mlp_layers(4, 16, 16, 4), num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer, base_seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine, _, _, _ = pdv_ext.initialize(
        model=model, config=ds_config(4, 2, 1, pdv={"init_search": {"enabled": True, **cfg}}),
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        init_search_iter=synthetic_batches(16, 4, 8, seed=11))
    stage = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    data = synthetic_batches(16, 4, 4, seed=5)
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(steps)]
    return {"rank": dist.get_rank(), "stage_id": engine.stage_id, "report": engine.init_search_report,
            "before": before, "stage": stage, "full": captured["full"], "losses": losses}
