"""Rank-side functions for the multi-process tests (run through pdv_ext.spawn.run_ranks)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch


def ds_config(micro_batch: int = 4, grad_acc: int = 2, dp: int = 2, lr: float = 1e-3, pdv: Optional[dict] = None) -> dict:
    cfg = {
        "train_batch_size": micro_batch * grad_acc * dp,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_acc,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if pdv is not None:
        cfg["pdv"] = pdv
    return cfg


def train_mlp(engine: str = "pdv", steps: int = 3, stages: int = 2, layers: int = 8, hidden: int = 32,
              pdv: Optional[dict] = None, seed: int = 7, micro_batch: int = 4, grad_acc: int = 2) -> Dict[str, Any]:
    """Train an MLP pipeline with vanilla DeepSpeed (`engine="vanilla"`) or pdv_ext; return losses,
    the local stage's final weights by global layer index, and the groups this rank is in."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    import torch.distributed as dist

    import pdv_ext
    from pdv_ext.integrations.deepspeed.internals import missing_instance_names
    from pdv_ext.models import mlp_layers, seed_layer, synthetic_batches

    torch.manual_seed(seed)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    model = PipelineModule(layers=mlp_layers(layers, hidden, 16, 4), num_stages=stages,
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer, base_seed=seed)
    cfg = ds_config(micro_batch, grad_acc, world // stages, pdv=pdv)
    init = deepspeed.initialize if engine == "vanilla" else pdv_ext.initialize
    if engine == "vanilla":
        cfg.pop("pdv", None)
    eng, _, _, _ = init(model=model, config=cfg, model_parameters=[p for p in model.parameters() if p.requires_grad])
    data = synthetic_batches(16, 4, micro_batch, seed=seed + eng.grid.get_data_parallel_id())
    initial = {name: p.detach().clone() for name, p in eng.module.named_parameters()}
    losses = [float(eng.train_batch(data_iter=data)) for _ in range(steps)]
    weights = {name: p.detach().clone() for name, p in eng.module.named_parameters()}
    return {"losses": losses, "weights": weights, "initial": initial, "stage": eng.stage_id, "parts": list(eng.module.parts),
            "dp_ranks": sorted(eng.grid.dp_group), "rank": dist.get_rank(),
            "engine": type(eng).__name__, "aggregator": getattr(getattr(eng, "aggregator", None), "name", None),
            "missing_internals": missing_instance_names(eng)}


class CountingSum:
    """Test aggregator given as "module:Class": sums instead of averaging and counts its calls, so a test
    can tell that the engine really routes ReduceGrads through the configured aggregator."""

    calls = 0

    def __new__(cls, **options):
        from pdv_ext.aggregation import Aggregator

        class _Sum(Aggregator):
            name = "counting_sum"

            def aggregate(self, grads, comm):
                CountingSum.calls += 1
                for g in grads:
                    comm.all_reduce(g, "sum")
                return grads

        return _Sum(options)


def train_mlp_counting(**kwargs):
    out = train_mlp(**kwargs)
    out["aggregate_calls"] = CountingSum.calls
    return out
