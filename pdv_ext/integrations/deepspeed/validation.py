"""Validation gradients for Zeno inside DeepSpeed's pipeline engine.

A stage holds only its own layers, so its part of the validation gradient needs a forward and backward
pass through the whole pipeline. `PipelineValidation.compute()` runs the engine's own 1F1B machinery on
one micro-batch of `validation_iter` (a TrainSchedule of one micro-batch without ReduceTiedGrads,
ReduceGrads and OptimizerStep), with the training gradients, data iterator and loss bookkeeping set
aside and restored afterwards. Every stage must call it at the same point (it is called from the
engine's ReduceGrads instruction, which every stage reaches once per step). The validation micro-batches
must have the training micro-batches' shapes (the pipeline's activation buffers are reused).
"""
from __future__ import annotations

from typing import Any, List

import torch

from ...config_base import ConfigError
from .runtime import runtime_of


class _OneMicroBatch:
    """DeepSpeed's TrainSchedule for one micro-batch, minus the reduction and optimizer instructions."""

    def __init__(self, engine: Any):
        from deepspeed.runtime.pipe import schedule

        self._sched = schedule.TrainSchedule(micro_batches=1, stages=engine.num_stages, stage_id=engine.stage_id)
        self._skip = (schedule.ReduceTiedGrads, schedule.ReduceGrads, schedule.OptimizerStep)

    def num_pipe_buffers(self) -> int:
        return self._sched.num_pipe_buffers()

    def __iter__(self):
        for cmds in self._sched:
            yield [c for c in cmds if not isinstance(c, self._skip)]


def reduction_params(engine: Any) -> List[torch.nn.Parameter]:
    """The parameters whose gradients the engine hands to the aggregator, in the same order
    (what DeepSpeed's fp32/fp16 reduction takes, without MoE experts)."""
    from deepspeed.moe.utils import is_moe_param

    return [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0 and not is_moe_param(p)]


class PipelineValidation:
    """Computes this stage's validation gradient (scaled to one micro-batch's mean loss)."""

    def __init__(self, engine: Any, validation_iter: Any):
        self.engine = engine
        self.validation_iter = validation_iter
        self.calls = 0

    def compute(self) -> List[torch.Tensor]:
        eng = self.engine
        needs_data = eng.is_first_stage() or eng.is_last_stage()
        if needs_data and self.validation_iter is None:
            raise ConfigError([f"pdv.aggregation.type: '{eng.aggregator.name}' needs validation data: pass "
                               "validation_iter=... to pdv_ext.initialize (first and last stage ranks)"])
        params = reduction_params(eng)
        saved_grads = [p.grad for p in params]
        saved = {k: getattr(eng, k, None) for k in ("data_iterator", "total_loss", "total_additional_losses",
                                                     "fwd_outputs", "loss")}
        try:
            for p in params:
                p.grad = None
            if needs_data:
                eng.data_iterator = self.validation_iter
            eng.total_loss = None
            eng.total_additional_losses = None
            with eng.grad_boundary_forced(False):
                eng.run_schedule(_OneMicroBatch(eng))
            # the last stage divided the loss by the accumulation steps: undo it (one micro-batch's mean)
            gas = float(eng.gradient_accumulation_steps())
            out = [(p.grad.detach().clone() * gas) if p.grad is not None else torch.zeros_like(p) for p in params]
        finally:
            for p, g in zip(params, saved_grads):
                p.grad = g
            for k, v in saved.items():
                setattr(eng, k, v)
        self.calls += 1
        return out


def refresh_validation(engine: Any) -> None:
    """Called by the engine before aggregating: hand the aggregator a fresh validation gradient when it
    asks for one (every `refresh_every` steps). Every stage gets the same answer (same step counters)."""
    agg = engine.aggregator
    if not getattr(agg, "needs_validation", False):
        return
    needs = getattr(agg, "needs_refresh", None)
    if needs is not None and not needs():
        return
    rt = runtime_of(engine)
    runner = rt.validation
    if runner is None or runner.validation_iter is not engine.validation_iter:
        runner = rt.validation = PipelineValidation(engine, engine.validation_iter)
    agg.set_validation_grads(runner.compute())
