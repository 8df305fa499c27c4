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


class Script:
    """A scripted policy (plugin): `steps` maps a step to the actions decided after it - `{"shares": [...]}` or
    `{"boundaries": [...], "rank_mapping": [...]}` (a Replan)."""

    def __new__(cls, **options):
        from pdv_ext.policy.base import Policy, Replan, SetDataShares

        steps = {int(k): v for k, v in options["steps"].items()}

        class _Script(Policy):
            name = "script"

            def after_step(self, metrics):
                p = steps.get(int(metrics["step"]))
                if p is None:
                    return []
                if "shares" in p:
                    return [SetDataShares(p["shares"])]
                return [Replan(p["boundaries"], p["rank_mapping"], reason="script")]

        return _Script({})


class Recorder:
    """A plugin that decides nothing and records every change the runner announces to it (on every rank)."""

    def __new__(cls, **options):
        from pdv_ext.policy.base import Policy

        class _Recorder(Policy):
            name = "recorder"

            def __init__(self, options=None, **kw):
                super().__init__(options, **kw)
                self.seen = []

            def on_change(self, change):
                self.seen.append((change.kind, change.step, change.source, change.shares, change.plan))

        return _Recorder({})


PLAN_A = {"boundaries": [0, 4, 8], "rank_mapping": [[0, 1], [2, 3]]}
PLAN_4 = {"boundaries": [0, 2, 4, 6, 8], "rank_mapping": [[3], [2], [1], [0]]}
PLAN_B = {"boundaries": [0, 3, 8], "rank_mapping": [[1, 2], [3, 0]]}
#: the scripted run: shares, a move to pipe 4 (depth 2 -> 4), back to pipe 2 x 2 on another plan (4 -> 2),
#: shares again, a move at the same width (the shares carried), a checkpoint under it
SCRIPT = {2: {"shares": [3, 1]}, 3: PLAN_4, 5: PLAN_B, 6: {"shares": [1, 3]}, 7: PLAN_A}


def _engine(plan: Dict[str, Any], plugins: List[Dict[str, Any]], grad_acc: int = 2, seed: int = 7,
            every: int = 1):
    import pdv_ext
    from deepspeed.pipe import PipelineModule
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    from tests.integration.engine_mode_workers import mode_config

    torch.manual_seed(seed)
    model = PipelineModule(layers=mlp_layers(8, 16, D_IN, D_OUT), num_stages=len(plan["rank_mapping"]),
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                           base_seed=seed, partition_method="uniform")
    cfg = mode_config("fp32", 4, grad_acc * 2 // len(plan["rank_mapping"][0]), len(plan["rank_mapping"][0]),
                      1e-2, "AdamW")
    cfg["pdv"] = {"placement": {"boundaries": plan["boundaries"], "rank_mapping": plan["rank_mapping"]},
                  "policy": {"plugins": plugins, "on_error": "raise", "every": every}}
    eng = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
    return eng, ElasticBatches.for_engine(eng, _dataset(), seed=seed)


def _where(eng) -> Dict[str, Any]:
    from pdv_ext.integrations.deepspeed.topology import engine_mapping

    return {"boundaries": list(eng.module.parts), "rank_mapping": engine_mapping(eng)}


def _slow_linear(factor: Dict[str, float], base: float):
    """Every nn.Linear forward on this rank sleeps `base` x factor["now"] seconds: a device's speed the test
    sets (the tiny MLP's own compute is noise next to it), through any move (the stages' layers are rebuilt)."""
    import time

    forward = torch.nn.Linear.forward

    def slow(self, x):
        time.sleep(base * factor["now"])
        return forward(self, x)

    torch.nn.Linear.forward = slow


def adaptive_system(ckpt_dir: str, cluster: str, profile: str) -> Dict[str, Any]:
    """The policies as one system on a real engine (pipe 2 x data 2, 4 gloo ranks):

    1. `scripted`: SCRIPT's shares and moves (depth 2 -> 4 -> 2, a move at the same width with shares in
       force), every change announced to a recording plugin on every rank, a checkpoint after step 8;
    2. `resumed`: a fresh engine under PLAN_B loads it (a layer-keyed load under another plan, shares kept):
       the resume is announced as a `checkpoint` change;
    3. `replan`: the built-in `replan` (moves only), rank 1's device slowed 5x from step 7: it moves the real
       engine's pipeline, its plan follows on every rank (on ranks other than 0 only through the runner's
       announcement: the policy decides on rank 0), nothing churns after."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out: Dict[str, Any] = {"rank": rank}

    plugins = [{"name": "tests.integration.shares_workers:Script", "steps": SCRIPT},
               {"name": "tests.integration.shares_workers:Recorder"}]
    eng, data = _engine(PLAN_A, plugins)
    losses, shares = [], []
    for _ in range(8):
        losses.append(float(eng.train_batch(data_iter=data)))
        shares.append(None if eng.data_shares is None else list(eng.data_shares))
    eng.save_checkpoint(ckpt_dir, tag="s8")
    runner = eng.pdv_policy.runner
    out["scripted"] = {"losses": losses, "shares": shares, "seen": runner.policies[1].seen, "where": _where(eng),
                       "log": [(s, a["action"]) for s, a in runner.action_log], "position": data.position}
    del eng, data

    eng, data = _engine(PLAN_B, [{"name": "tests.integration.shares_workers:Script", "steps": {}},
                                 {"name": "tests.integration.shares_workers:Recorder"}])
    eng.load_checkpoint(ckpt_dir, tag="s8")
    losses = [float(eng.train_batch(data_iter=data)) for _ in range(2)]
    out["resumed"] = {"losses": losses, "seen": eng.pdv_policy.runner.policies[1].seen, "where": _where(eng),
                      "shares": eng.data_shares, "steps": int(eng.global_steps)}
    del eng, data

    factor = {"now": 1.0}
    _slow_linear(factor, 0.003)
    plugins = [{"name": "replan", "cluster": cluster, "profile": profile, "total_steps": 1000,
                "allow_shares": False}]  # a move, not a split: the pipeline moves under the built-in policy
    eng, data = _engine(PLAN_A, plugins, grad_acc=4)
    losses = []
    for step in range(1, 31):
        if rank == 1 and step == 7:
            factor["now"] = 5.0
        losses.append(float(eng.train_batch(data_iter=data)))
    runner = eng.pdv_policy.runner
    (replan,) = runner.policies
    out["replan"] = {"losses": losses, "log": [(s, a["action"], a["source"]) for s, a in runner.action_log],
                     "changes": [(c.kind, c.step, c.source) for c in runner.changes], "plan": replan.plan,
                     "where": _where(eng), "decisions": replan.decisions, "errors": runner.errors}
    return out


def goodput_with_shares(steps: int = 12, seed: int = 7) -> Dict[str, Any]:
    """Pipe 2 x data 2 with unequal shares from the config ([3, 1] of 4 micro-batches) and the `goodput` batch
    policy deciding on every step: what the batch, the shares and the data positions were at each step."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    from tests.integration.engine_mode_workers import mode_config

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = PipelineModule(layers=mlp_layers(4, 16, D_IN, D_OUT), num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(),
                           seed_layers=True, seed_fn=seed_layer, base_seed=seed, partition_method="uniform")
    cfg = mode_config("fp32", 4, 2, 2, 1e-2, "AdamW")
    cfg["pdv"] = {"data_shares": [3, 1], "policy": {
        "on_error": "raise", "monitor": {"ema": 0.5},
        "plugins": [{"name": "goodput", "warmup_steps": 2, "interval": 1, "measure_steps": 1, "min_gain": 0.0,
                     "min_batch_size": 16, "max_batch_size": 64}]}}
    eng = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
    data = ElasticBatches.for_engine(eng, _dataset(), seed=seed, record=True)
    batches, shares = {}, {}
    for step in range(steps):
        batches[step + 1] = int(eng.train_batch_size())
        eng.train_batch(data_iter=data)
        shares[step + 1] = None if eng.data_shares is None else list(eng.data_shares)
    runner = eng.pdv_policy.runner
    return {"rank": dist.get_rank(), "stage": eng.stage_id, "batches": batches, "shares": shares,
            "log": runner.action_log, "seen": list(data.seen), "position": data.position}
