"""Rank-side functions of the data-share tests (run through pdv_ext.spawn.run_ranks).

Each rank trains the same seeded MLP pipeline with the global batch split equally and with unequal shares
(from the config, or set at a step boundary by a policy action), and also computes, alone, one step of
the whole model on the whole global batch: what every split must reproduce.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

D_IN, D_OUT = 16, 4


def _dataset(n: int = 512, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    return x, (x[:, :D_OUT].sum(1) > 0).long() + 2 * (x[:, D_OUT:2 * D_OUT].sum(1) > 0).long()


def _reference(layers: int, hidden: int, seed: int, lr: float, steps_idx: List[torch.Tensor]):
    """The whole model in one process: SGD on the mean loss over each step's whole global batch."""
    from pdv_ext.models import mlp_layers, seed_layer

    x, y = _dataset()
    mods = []
    for i, spec in enumerate(mlp_layers(layers, hidden, D_IN, D_OUT)):
        seed_layer(seed + i)  # PipelineModule(seed_layers=True, base_seed=seed) seeds layer i so
        mods.append(spec.build())
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    for idx in steps_idx:
        h = x[idx]
        for m in mods:
            h = m(h)
        loss = torch.nn.functional.cross_entropy(h, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {f"{i}.{n}": p.detach().clone() for i, m in enumerate(mods) for n, p in m.named_parameters()}, losses


def train_shares(mode: str, runs: List[Dict[str, Any]], steps: int = 2, stages: int = 2, layers: int = 4,
                 hidden: int = 16, micro_batch: int = 4, grad_acc: int = 3, seed: int = 7, lr: float = 0.5,
                 aggregator: str = "mean") -> Dict[str, Any]:
    """For each run ({"label", "config_shares", "set_shares": [(before step k, shares), ...]}): train
    `steps` steps with SGD; returns losses, this stage's final weights (float32), the shares in force and
    the positions the iterator handed out. Plus the one-process reference on the same global batches."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches
    from pdv_ext.integrations.deepspeed.glue import EngineApplier

    from tests.integration.engine_mode_workers import input_dtype, mode_config

    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size() // stages
    total = grad_acc * dp
    out: Dict[str, Any] = {"rank": dist.get_rank(), "runs": {}}
    dtype = input_dtype(mode)
    for run in runs:
        torch.manual_seed(seed)
        model = PipelineModule(layers=mlp_layers(layers, hidden, D_IN, D_OUT), num_stages=stages,
                               loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                               base_seed=seed, partition_method="uniform")
        cfg = mode_config(mode, micro_batch, grad_acc, dp, lr, "SGD")
        cfg["pdv"] = {"aggregation": {"type": aggregator}}
        if run.get("config_shares") is not None:
            cfg["pdv"]["data_shares"] = run["config_shares"]
        if run.get("monitor"):
            cfg["pdv"]["policy"] = {"monitor": {"enabled": True}}
        eng = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
        data = ElasticBatches.for_engine(eng, _dataset(), seed=seed, record=True)
        cast = (lambda it: ((xb.to(dtype), yb) for xb, yb in it)) if dtype != torch.float32 else (lambda it: it)
        batches = cast(data)
        changes = dict((k, s) for k, s in run.get("set_shares", []))
        losses, shares_seen = [], []
        for step in range(steps):
            if step in changes:  # what the PolicyRunner does for a SetDataShares action
                EngineApplier(eng).set_data_shares(changes[step])
                data.set_shares(eng.data_shares)
            shares_seen.append(None if eng.data_shares is None else list(eng.data_shares))
            losses.append(float(eng.train_batch(data_iter=batches)))
        out["runs"][run["label"]] = {
            "losses": losses, "shares": shares_seen, "micro_batches": int(eng.micro_batches),
            "weights": {n: p.detach().float().clone() for n, p in eng.module.named_parameters()},
            "seen": list(data.seen), "stage": eng.stage_id, "dp_id": eng.grid.get_data_parallel_id(),
            "native": eng.uses_deepspeed_reduction, "reduce_mode": eng.reduce_mode,
            "metrics": ({k: v for k, v in eng.pdv_policy.last_metrics.items()
                         if k in ("batch_size", "data_shares", "micro_batches")}
                        if eng.pdv_policy is not None else None),
        }
        del eng
    ref_it = ElasticBatches(_dataset(), micro_batch, 0, 1, seed=seed)
    steps_idx = [ref_it.indices(s * total * micro_batch, total * micro_batch) for s in range(steps)]
    out["reference"], out["reference_losses"] = _reference(layers, hidden, seed, lr, steps_idx)
    return out


def resume_with_shares(ckpt_dir: str, steps: int = 5, save_at: int = 3, stages: int = 2, micro_batch: int = 4,
                       grad_acc: int = 3, seed: int = 7) -> Dict[str, Any]:
    """Unequal shares from the config, another split set at a step boundary, a checkpoint, then a fresh
    engine built with equal shares that loads it: what the resumed steps see and compute."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches
    from pdv_ext.integrations.deepspeed.glue import EngineApplier

    from tests.integration.engine_mode_workers import mode_config

    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size() // stages
    out: Dict[str, Any] = {}
    for label in ("full", "resumed"):
        torch.manual_seed(seed)
        model = PipelineModule(layers=mlp_layers(4, 16, D_IN, D_OUT), num_stages=stages,
                               loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                               base_seed=seed, partition_method="uniform")
        cfg = mode_config("fp32", micro_batch, grad_acc, dp, 1e-2, "AdamW")
        cfg["pdv"] = {"data_shares": [5, 1] if label == "full" else "equal", "policy": {"monitor": {"enabled": True}}}
        eng = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
        data = ElasticBatches.for_engine(eng, _dataset(), seed=seed, record=True)
        start = 0
        if label == "resumed":
            eng.load_checkpoint(ckpt_dir)
            start = eng.global_steps
        losses, shares = {}, {}
        for step in range(start, steps):
            if label == "full" and step == 2:
                EngineApplier(eng).set_data_shares([2, 4])
            losses[step + 1] = float(eng.train_batch(data_iter=data))
            shares[step + 1] = None if eng.data_shares is None else list(eng.data_shares)
            if label == "full" and step + 1 == save_at:
                eng.save_checkpoint(ckpt_dir)
        out[label] = {"losses": losses, "shares": shares, "seen": list(data.seen), "position": data.position,
                      "stage": eng.stage_id, "weights": {n: p.detach().clone() for n, p in eng.module.named_parameters()}}
        del eng
    return out


class ReplanAt:
    """A user's re-plan policy (plugin template): at step `at`, move to the given plan; `then` (a list of
    {"at", "boundaries", "rank_mapping"}) gives further moves."""

    def __new__(cls, **options):
        from pdv_ext.policy.base import Policy, Replan

        plans = {options["at"]: options}
        plans.update({p["at"]: p for p in options.get("then", [])})

        class _At(Policy):
            name = "replan_at"

            def after_step(self, metrics):
                p = plans.get(metrics["step"])
                if p is not None:
                    return [Replan(p["boundaries"], p["rank_mapping"], reason="test")]
                return []

        return _At({})


def replan_by_action(steps: int = 7, at: int = 2, seed: int = 7) -> Dict[str, Any]:
    """Pipe 2 x data 2 moved to pipe 4 by a policy's Replan inside train_batch, then at step at+2 to other
    boundaries on another rank order: training goes on through the same engine object (its step counter,
    the policies' view of it), the runner logged each move's cost; and the same run without the moves."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    from tests.integration.engine_mode_workers import mode_config

    deepspeed.init_distributed(dist_backend="gloo")
    out: Dict[str, Any] = {}
    for label in ("moved", "still"):
        torch.manual_seed(seed)
        model = PipelineModule(layers=mlp_layers(8, 16, D_IN, D_OUT), num_stages=2,
                               loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                               base_seed=seed, partition_method="uniform")
        cfg = mode_config("fp32", 4, 2, 2, 1e-2, "AdamW")
        plugins = [{"name": "tests.integration.shares_workers:ReplanAt", "at": at if label == "moved" else -1,
                    "boundaries": [0, 2, 4, 6, 8], "rank_mapping": [[3], [2], [1], [0]],
                    "then": [{"at": at + 2 if label == "moved" else -1, "boundaries": [0, 1, 3, 6, 8],
                              "rank_mapping": [[1], [0], [3], [2]]}]}]
        cfg["pdv"] = {"policy": {"plugins": plugins, "on_error": "raise"}}
        eng = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
        data = ElasticBatches.for_engine(eng, _dataset(), seed=seed)
        ident = id(eng)
        losses, metric_steps = [], []
        for _ in range(steps):
            losses.append(float(eng.train_batch(data_iter=data)))
            metric_steps.append(eng.pdv_policy.last_metrics.get("step"))
        glue = eng.pdv_policy
        out[label] = {"losses": losses, "same_object": id(eng) == ident, "stages": eng.num_stages,
                      "parts": list(eng.module.parts), "last_move": glue.runner.last_move,
                      "log": glue.runner.action_log, "global_steps": int(eng.global_steps),
                      "metric_steps": metric_steps, "glue_on_engine": glue.engine is eng,
                      "applier_on_engine": glue.runner.applier.engine is eng, "stage_id": eng.stage_id,
                      "p2p_stage": __import__("deepspeed").runtime.pipe.p2p._grid.get_stage_id()}
        del eng
    return out
