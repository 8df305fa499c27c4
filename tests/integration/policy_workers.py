"""Rank-side functions of the policy integration tests (run through pdv_ext.spawn.run_ranks)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from pdv_ext.policy import Policy, SetBatchSize


class Boom(Policy):
    """A broken plugin: raises at step 3 (the runner must report and disable it on every rank)."""

    def after_step(self, metrics):
        if metrics["step"] == 3:
            raise RuntimeError("boom")
        return []


#: batch changes exercised by the tests (micro-batches and micro-batch size, LR rules)
CHANGES = [{"step": 2, "micro_batches": 3, "lr_rule": "linear"},
           {"step": 4, "micro_batch_size": 2, "lr_rule": "sqrt"},
           {"step": 6, "micro_batches": 2, "micro_batch_size": 3, "lr_rule": "none"}]


def policy_config(plugins: List[Dict[str, Any]], out_dir: Optional[str] = None, micro_batch: int = 4,
                  grad_acc: int = 2, dp: int = 2, lr: float = 1e-2) -> dict:
    return {
        "train_batch_size": micro_batch * grad_acc * dp,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_acc,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "steps_per_print": 10 ** 9,
        "pdv": {"policy": {"plugins": plugins, "monitor": {"output_dir": out_dir, "ema": 0.5}}},
    }


def train_and_resume(ckpt_dir: str, steps: int = 8, save_at: int = 5, out_dir: Optional[str] = None) -> Dict[str, Any]:
    """One uninterrupted run saving a checkpoint at `save_at`, then (same processes, fresh model and
    engine) a run resumed from that checkpoint: two engines for one process start-up."""
    full = train_policy(steps, ckpt_dir=ckpt_dir, save_at=save_at, out_dir=out_dir)
    resumed = train_policy(steps, ckpt_dir=ckpt_dir, resume=True)
    return {"full": full, "resumed": resumed}


def train_policy(steps: int = 8, ckpt_dir: Optional[str] = None, save_at: Optional[int] = None,
                 resume: bool = False, out_dir: Optional[str] = None, n_samples: int = 100,
                 seed: int = 3) -> Dict[str, Any]:
    """MLP pipeline (2 stages x 2 replicas on 4 ranks) with the `schedule` policy changing the batch
    geometry, a broken plugin, and ElasticBatches recording every stream position it hands out."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    torch.manual_seed(seed)
    deepspeed.init_distributed(dist_backend="gloo")
    model = PipelineModule(layers=mlp_layers(6, 16, 8, 4), num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer, base_seed=seed)
    plugins = [{"name": "schedule", "changes": CHANGES}, {"name": "tests.integration.policy_workers:Boom"}]
    cfg = policy_config(plugins, out_dir)
    eng, _, _, _ = pdv_ext.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_samples, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    data = ElasticBatches.for_engine(eng, (x, y), seed=seed, record=True)
    start = 0
    if resume:
        eng.load_checkpoint(ckpt_dir)
        start = eng.global_steps
    losses, lrs, geometry = {}, {}, {}
    for step in range(start, steps):
        losses[step + 1] = float(eng.train_batch(data_iter=data))
        lrs[step + 1] = eng.optimizer.param_groups[0]["lr"]
        geometry[step + 1] = (eng.train_micro_batch_size_per_gpu(), eng.micro_batches, eng.train_batch_size())
        if save_at is not None and step + 1 == save_at:
            eng.save_checkpoint(ckpt_dir)
    runner = eng.pdv_policy.runner
    eng.pdv_policy.close()
    return {"rank": dist.get_rank(), "stage": eng.stage_id, "dp_rank": eng.grid.get_data_parallel_id(),
            "losses": losses, "lrs": lrs, "geometry": geometry, "action_log": runner.action_log,
            "errors": runner.errors, "disabled": runner.disabled, "seen": data.seen,
            "ids": data.indices(0, data.position).tolist(), "position": data.position,
            "metrics": eng.pdv_policy.last_metrics, "rows": eng.pdv_policy.monitor.rows,
            "host_groups": [eng.pdv_policy.comm.host_group is not None, eng.dp_comm.host_group is not None]}
