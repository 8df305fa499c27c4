"""Rank-side functions for the precision / ZeRO engine tests (run through pdv_ext.spawn.run_ranks).

One rank process builds several engines one after the other (vanilla DeepSpeed, then pdv_ext with each
aggregator) from identically seeded models and data, so a whole matrix of modes costs one spawn.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

#: DeepSpeed config fragments of the modes (what `pdv bench engine --precision/--zero` builds, too)
MODES: Dict[str, Dict[str, Any]] = {
    "fp32": {},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "bf16": {"bf16": {"enabled": True}},
    "zero1": {"zero_optimization": {"stage": 1}},
    "bf16_zero1": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "fp16_zero1": {"fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": 1}},
    # bf16 weights with fp32 gradient accumulation under ZeRO-1: DeepSpeed picks its BF16_Optimizer
    "bf16_zero1_fp32acc": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                           "data_types": {"grad_accum_dtype": "fp32"}},
}


def mode_config(mode: str, micro_batch: int, grad_acc: int, dp: int, lr: float = 1e-3,
                optimizer: str = "AdamW") -> Dict[str, Any]:
    params = {"lr": lr, "torch_adam": True} if optimizer.lower().startswith("adam") else {"lr": lr}
    cfg = {"train_batch_size": micro_batch * grad_acc * dp, "train_micro_batch_size_per_gpu": micro_batch,
           "gradient_accumulation_steps": grad_acc, "steps_per_print": 10 ** 9,
           "optimizer": {"type": optimizer, "params": params}, "zero_allow_untested_optimizer": True}
    cfg.update({k: dict(v) for k, v in MODES[mode].items()})
    return cfg


def input_dtype(mode: str) -> torch.dtype:
    """The dtype a mode's model takes its inputs in (DeepSpeed casts the weights, not the data)."""
    cfg = MODES[mode]
    return (torch.bfloat16 if cfg.get("bf16", {}).get("enabled") else
            torch.float16 if cfg.get("fp16", {}).get("enabled") else torch.float32)


def cast_batches(batches: Any, dtype: torch.dtype) -> Any:
    for x, y in batches:
        yield x.to(dtype), y


def train_modes(modes: List[str], aggregators: List[Any], steps: int = 3, stages: int = 2, layers: int = 6,
                hidden: int = 32, micro_batch: int = 4, grad_acc: int = 2, seed: int = 11,
                lr: float = 1e-3, optimizer: str = "AdamW", vanilla: bool = True) -> Dict[str, Any]:
    """For each mode: vanilla DeepSpeed (unless `vanilla=False`), then pdv_ext with each of `aggregators`
    (a name or a spec dict; `label` names its entry). Returns per mode and engine the losses, this
    stage's initial and final weights (float32), the optimizer class and the engine's reduction mode."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer, synthetic_batches

    from deepspeed.accelerator import get_accelerator

    on_cuda = get_accelerator().device_name() == "cuda"  # DS_ACCELERATOR=cuda: the GPU tier (nccl)
    deepspeed.init_distributed(dist_backend="nccl" if on_cuda else "gloo")
    dp = dist.get_world_size() // stages
    out: Dict[str, Any] = {"rank": dist.get_rank(), "device": get_accelerator().device_name()}
    for mode in modes:
        runs: Dict[str, Any] = {}
        for agg in ([None] if vanilla else []) + list(aggregators):
            torch.manual_seed(seed)
            model = PipelineModule(layers=mlp_layers(layers, hidden, 16, 4), num_stages=stages,
                                   loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                                   base_seed=seed)
            cfg = mode_config(mode, micro_batch, grad_acc, dp, lr, optimizer)
            if agg is None:
                name, init = "vanilla", deepspeed.initialize
            else:
                spec = {"type": agg} if isinstance(agg, str) else dict(agg)
                name, init = spec.get("label", spec["type"]), pdv_ext.initialize
                spec.pop("label", None)
                extra = spec.pop("pdv_extra", {})  # other "pdv" sub-sections (e.g. a policy Monitor)
                cfg["pdv"] = {"aggregation": spec, **extra}
            kwargs = {}
            if agg is not None:  # trusted validation data for Zeno (first and last stage read it)
                kwargs["validation_iter"] = cast_batches(synthetic_batches(16, 4, micro_batch, seed=seed + 1000),
                                                         input_dtype(mode))
            eng = init(model=model, config=cfg, model_parameters=[p for p in model.parameters()], **kwargs)[0]
            data = cast_batches(synthetic_batches(16, 4, micro_batch, seed=seed + eng.grid.get_data_parallel_id()),
                                input_dtype(mode))
            initial = {n: p.detach().float().clone() for n, p in eng.module.named_parameters()}
            losses = [float(eng.train_batch(data_iter=data)) for _ in range(steps)]
            runs[name] = {"losses": losses, "initial": initial,
                          "weights": {n: p.detach().float().clone() for n, p in eng.module.named_parameters()},
                          "optimizer": type(eng.optimizer).__name__,
                          "reduce_mode": getattr(eng, "reduce_mode", None),
                          "native": getattr(eng, "uses_deepspeed_reduction", None),
                          "stage": eng.stage_id, "dp_id": eng.grid.get_data_parallel_id(),
                          "param_device": str(next(eng.module.parameters()).device)}
            glue = getattr(eng, "pdv_policy", None)
            if glue is not None:  # what the Monitor measured at the last step
                runs[name]["metrics"] = {k: v for k, v in glue.last_metrics.items() if isinstance(v, (int, float))}
            if hasattr(eng, "aggregator"):
                from pdv_ext.integrations.deepspeed.internals import missing_instance_names

                runs[name]["missing_internals"] = missing_instance_names(eng)
                runs[name]["aggregator_steps"] = eng.aggregator.step
                v = getattr(eng.aggregator, "_v", None)  # Zeno's validation gradient (flat), when it keeps one
                if isinstance(v, torch.Tensor):
                    runs[name]["validation_norm"] = float(v.double().norm())
            del eng
        out[mode] = runs
    return out


def train_matrix(plan: List[Any], **kwargs: Any) -> Dict[str, Any]:
    """`train_modes` for several (mode, aggregators) pairs in one spawn, without vanilla runs; also
    records the error a ZeRO stage 2 pipeline gives (`zero2_error`)."""
    out: Dict[str, Any] = {}
    for mode, aggs in plan:
        res = train_modes([mode], aggs, vanilla=False, **kwargs)
        out["rank"] = res["rank"]
        out[mode] = res[mode]
    out["zero2_error"] = zero2_error()
    out["hooked_mean_error"] = hooked_mean_error()
    return out


def hooked_mean_error() -> Optional[str]:
    """The message for `mean` + a fault hook under bf16 + ZeRO-1 with optimizer offload and fp32
    accumulation: ZeRO fills its compact partition buffers only in its own reduction, so pdv must not take
    it over (the optimizer stepped on zeros, silently). None if an engine was built."""
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.config_base import ConfigError

    model = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                           loss_fn=torch.nn.MSELoss())
    cfg = mode_config("bf16_zero1", 1, 1, dist.get_world_size() // 2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    cfg["zero_force_ds_cpu_optimizer"] = False
    cfg["pdv"] = {"aggregation": {"type": "mean"},
                  "faults": {"byzantine_ranks": [1], "attack": "sign_flip", "start_step": 100000}}
    try:
        pdv_ext.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
    except ConfigError as exc:
        return str(exc)
    return None


def zero2_error() -> Optional[str]:
    """The message pdv_ext.initialize gives for ZeRO stage 2 in a pipeline (None if it built one)."""
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.config_base import ConfigError

    model = PipelineModule(layers=[torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], num_stages=2,
                           loss_fn=torch.nn.MSELoss())
    cfg = mode_config("fp32", 1, 1, dist.get_world_size() // 2)
    cfg["zero_optimization"] = {"stage": 2}
    cfg["pdv"] = {"aggregation": {"type": "adasum"}}
    try:
        pdv_ext.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))
    except ConfigError as exc:
        return str(exc)
    return None


class PlainMean:
    """Test aggregator given as "module:Class": the plain average (all-reduce SUM, then / world) under a
    name other than `mean`, so the engine hands it the reduction instead of DeepSpeed's native path: its
    result must match DeepSpeed's mean up to rounding (same tensors, same scaling)."""

    def __new__(cls, **options):
        from pdv_ext.aggregation import Aggregator

        class _PlainMean(Aggregator):
            name = "plain_mean"

            def aggregate(self, grads, comm):
                for g in grads:
                    comm.all_reduce(g, "sum")
                    g.div_(comm.size)
                return grads

        return _PlainMean(options)
