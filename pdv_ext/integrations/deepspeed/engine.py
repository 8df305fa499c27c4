"""DeepSpeed integration: `initialize`, `PDVPipelineEngine`, explicit stage boundaries and rank mapping.

The engine's ReduceGrads instruction runs `PDVPipelineEngine.pdv_reduce_grads` (the instruction map is
rebuilt in internals.EngineSeam, the one place that names DeepSpeed's private parts). Tied-weight
reduction stays DeepSpeed's.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule

from ...aggregation import Aggregator, bind_group, build_aggregator
from ...aggregation.faults import loss_scale_overflow
from ...comm import TorchComm, host_twin
from ...config import ConfigError, PDVConfig, split_config
from ...emulated_device import dump_stacks_on_signal, enter_device_group
from ...log import apply_log_level, logger
from ...user_errors import exit_if_uncaught
from . import internals
from .checkpoint import (CheckpointNotFound, load_layer_checkpoint, missing_checkpoint, plan_of, read_meta,
                         save_layer_checkpoint)
from .glue import begin_step, build_glue
from .inplace import recover as recover_in_place
from .inplace import setup as setup_in_place
from .snapshots import Snapshots, shared_rendezvous_store
from .pdv_state import load_state, save_state
from .move import move_engine
from .runtime import EngineRuntime, runtime_of
from .safe_io import check_plain
from .topology import MappedTopology, build_stage_layers, current_mapping, link_tied_layers, module_layout
from .validation import reduction_params, refresh_validation


# ---------------------------------------------------------------------------------------------------
# Placement mechanisms: explicit rank mapping and explicit stage boundaries
# ---------------------------------------------------------------------------------------------------
def apply_placement(module: PipelineModule, boundaries: Optional[Sequence[int]] = None,
                    rank_mapping: Optional[Sequence[Sequence[int]]] = None) -> bool:
    """Re-partition a built `PipelineModule` in place (all ranks must call it with the same arguments).

    `boundaries` are DeepSpeed's `parts` (stage s holds layers boundaries[s]..boundaries[s+1]-1);
    `rank_mapping[stage][replica]` is the global rank. Either may be None (kept as is). The local
    stage's layers are rebuilt from their specs; use `seed_layers=True` in the PipelineModule for
    initial weights that do not depend on the placement. Returns True when anything changed.
    """
    changed = False
    world = module.world_size
    if rank_mapping is not None:
        rows = [list(r) for r in rank_mapping]
        if sum(len(r) for r in rows) != world:
            raise ConfigError([f"pdv.placement.rank_mapping: places {sum(len(r) for r in rows)} ranks but the job "
                               f"has {world}"])
        if rows != current_mapping(module):
            internals.set_topology(module, MappedTopology(rows))
            changed = True
    stage = internals.module_topology(module).get_coord(module.global_rank).pipe
    if boundaries is not None:
        parts = [int(b) for b in boundaries]
        if parts[-1] != internals.num_layers(module):
            raise ConfigError([f"pdv.placement.boundaries: must end at the layer count {internals.num_layers(module)} "
                               f"(got {parts})"])
        if len(parts) - 1 != module.num_stages:
            raise ConfigError([f"pdv.placement.boundaries: describe {len(parts) - 1} stages but the pipeline has "
                               f"{module.num_stages}"])
    else:
        parts = list(module.parts)
        if len(parts) - 1 != module.num_stages:
            raise ConfigError(["pdv.placement.boundaries: required when rank_mapping changes the stage count"])
    if changed or parts != list(module.parts) or stage != module.stage_id:
        _rebuild(module, parts, stage)
        changed = True
    return changed


def _rebuild(module: PipelineModule, parts: List[int], stage: int) -> None:
    """Drop the local layers and build those of `stage` under `parts` (PipelineModule.__init__'s tail)."""
    build_stage_layers(module, parts, stage)
    link_tied_layers(module)


def resolve_placement(module: PipelineModule, cfg: PDVConfig) -> Optional[Dict[str, Any]]:
    """Turn `pdv.placement` into (boundaries, rank_mapping) and apply them; returns what was applied."""
    pl = cfg.placement
    boundaries, mapping = pl.boundaries, pl.rank_mapping
    if pl.plan is not None:
        from ...placement.startup import read_plan  # read on rank 0, broadcast

        plan = read_plan(pl.plan)
        boundaries, mapping = plan["boundaries"], plan["rank_mapping"]
    elif pl.cluster is not None:
        from ...placement.startup import plan_for_module  # planning at start-up (rank 0 plans, broadcasts)

        plan = plan_for_module(module, pl, layers=internals.layer_specs(module))
        boundaries, mapping = plan["boundaries"], plan["rank_mapping"]
    if boundaries is None and mapping is None:
        return None
    apply_placement(module, boundaries, mapping)
    return module_layout(module).to_dict()


def parameter_names(module: nn.Module) -> Dict[int, Tuple[str, bool]]:
    """id(parameter) -> (name, requires_grad): what `follow_rebuild` maps from."""
    return {id(p): (n, p.requires_grad) for n, p in module.named_parameters()}


def follow_rebuild(module: nn.Module, before: Dict[int, Tuple[str, bool]], model_parameters: Any,
                   optimizer: Any = None) -> Any:
    """Point what the caller built from the module's old parameters at the rebuilt ones.

    A re-partition replaces the local layers, so a list of parameters taken before `initialize` (or an
    optimizer built on them) would hold tensors the module no longer uses: the weights would never
    change. A list that held every old parameter (or every trainable one) now holds the same set of the
    new module; other lists and parameter groups are mapped by name (DeepSpeed names layers by global
    index, so a layer that stays on this stage keeps its names). Layers that arrived on this stage must
    land in some group. A lazy iterator such as `model.parameters()` needs nothing: it is read later.
    Returns the new `model_parameters`; an optimizer's groups are updated in place.
    """
    now = dict(module.named_parameters())
    if {id(p) for p in now.values()} == set(before):
        return model_parameters  # nothing was rebuilt
    old_names = {n for n, _ in before.values()}

    def remap(params: Any) -> List[Any]:
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        ids = {id(p) for p in params}
        if ids == set(before):
            return list(now.values())
        if ids and ids == {i for i, (_, grad) in before.items() if grad}:
            return [p for p in now.values() if p.requires_grad]
        out = []
        for p in params:
            entry = before.get(id(p))
            if entry is None:
                out.append(p)  # not a parameter of the module: the caller's own tensor
            elif entry[0] in now:
                out.append(now[entry[0]])
        return out

    def check(groups: List[List[Any]], what: str) -> None:
        covered = {id(p) for g in groups for p in g}
        missing = sorted(n for n, p in now.items() if p.requires_grad and n not in old_names and id(p) not in covered)
        if missing:
            more = ", ..." if len(missing) > 4 else ""
            raise ConfigError([f"{what}: pdv.placement moved layers onto this stage whose parameters "
                               f"({', '.join(missing[:4])}{more}) are in no parameter group; pass model.parameters() "
                               "(or None), or build the groups from the module after pdv_ext.initialize"])

    if isinstance(model_parameters, (list, tuple)) and model_parameters:
        if all(isinstance(g, dict) for g in model_parameters):
            model_parameters = [{**g, "params": remap(g["params"])} for g in model_parameters]
            check([g["params"] for g in model_parameters], "model_parameters")
        else:
            model_parameters = remap(model_parameters)
            check([model_parameters], "model_parameters")
    if optimizer is not None and hasattr(optimizer, "param_groups"):
        for g in optimizer.param_groups:
            g["params"] = remap(g["params"])
        check([g["params"] for g in optimizer.param_groups], "optimizer")
    return model_parameters


# ---------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------
class GradHook:
    """Something that sees (and may replace) the gradients around aggregation: faults, the Monitor."""

    #: False for a hook that has nothing to do where DeepSpeed reduces itself (the non-finite guard under
    #: `mean`): it does not make ZeRO-1 hand the reduction to pdv's Mean
    needs_full_gradients: bool = True

    def before(self, engine: "PDVPipelineEngine", grads: List[torch.Tensor]) -> List[torch.Tensor]:
        return grads

    def after(self, engine: "PDVPipelineEngine", grads: List[torch.Tensor]) -> None:
        return None


class PDVPipelineEngine(internals.EngineSeam):
    """DeepSpeed's PipelineEngine whose data-parallel gradient reduction is a pluggable Aggregator.

    Each stage aggregates over its own data-parallel group (`self.dp_comm`) the gradients DeepSpeed
    would all-reduce, in one of three reduction modes (`self.reduce_mode`):

    - `"engine"` (fp32, fp16): the parameters' `.grad`, DeepSpeed's `allreduce_gradients`. `mean` is
      pdv's own Mean, bit-identical to DeepSpeed's bucketed all-reduce.
    - `"bf16"` (BF16_Optimizer: `bf16` alone, or bf16 + ZeRO-1 with fp32 gradient accumulation): the
      optimizer's flat gradient buffers, one view per parameter (`optimizer.fp32_groups_gradients`,
      fp32 or bf16 after `data_types.grad_accum_dtype`). DeepSpeed all-reduces them and the optimizer's
      step takes this rank's partition.
    - `"zero"` (DeepSpeedZeroOptimizer, ZeRO stage 1): the parameters' full gradients; ZeRO's
      `reduce_gradients` then takes this rank's partition. A non-mean aggregator produces the averaged
      gradient first and ZeRO's bookkeeping runs with its communication switched off (no second
      reduction).

    In "bf16" and "zero" mode `mean` is DeepSpeed's own reduction (bit-identical by construction);
    every other aggregator works on fp32 copies of bf16 gradients (aggregators compute in fp32/fp64)
    and writes the result back. ZeRO stage 2/3 cannot run in a DeepSpeed pipeline at all.
    """

    def __init__(self, *args: Any, pdv_config: Optional[PDVConfig] = None, validation_iter: Any = None,
                 pdv_glue: Any = None, **kwargs: Any):
        cc = kwargs.get("config_class")
        if cc is not None and int(getattr(cc, "zero_optimization_stage", 0) or 0) >= 2:
            raise ConfigError([f"zero_optimization.stage: {cc.zero_optimization_stage} partitions gradients, which "
                               "DeepSpeed's pipeline engine does not support; use stage 0 or 1 with pipelines"])
        super().__init__(*args, **kwargs)
        self.pdv_runtime = EngineRuntime()  # pdv's own run-time state (runtime.py)
        self.pdv_config = pdv_config or PDVConfig()
        self.validation_iter = validation_iter
        self.grad_hooks: List[GradHook] = []
        # on NCCL a gloo twin of each data-parallel group carries the aggregators' host payloads (flags,
        # scalars): reading them back then costs no device sync (TorchComm); every rank builds all twins
        self.dp_comm = TorchComm(self.grid.get_data_parallel_group(), host_group=host_twin(self.grid.dp_groups))
        self.placement = getattr(self.module, "_pdv_placement", None)
        self.init_search_report = getattr(self.module, "_pdv_init_search", None)
        self.reduce_mode = ("bf16" if self.using_bf16_optimizer else
                            "zero" if self.zero_optimization_stage() > 0 else "engine")
        self._native_reduce = False  # set by set_aggregator: `mean` in "bf16"/"zero" mode is DeepSpeed's own
        # data shares: micro-batches per data-parallel replica (None: DeepSpeed's equal split)
        self.data_shares: Optional[List[int]] = None
        self.total_micro_batches = int(self.micro_batches) * self.dp_world_size
        self._group_replicas = self._replicas_by_group_rank()
        self.set_aggregator(self.pdv_config.aggregation)
        self._set_static_shares()
        from ...aggregation.faults import install_fault_hooks  # pdv.faults + the NaN/Inf guard

        install_fault_hooks(self)
        self._check_release()
        self.pdv_policy = build_glue(self, carried=pdv_glue)  # pdv.policy (a move carries its glue over)
        # pdv.snapshots: the state in host memory every few steps, for a restart on the survivors
        self.pdv_snapshots = Snapshots(self.pdv_config.snapshots, self) if self.pdv_config.snapshots else None
        self._check_takeover_once()  # the hooks now exist: can `mean` under ZeRO-1 hand them the gradients?

    def _check_release(self) -> None:
        """What this DeepSpeed release cannot carry, refused at start-up (docs/deepspeed.md, supported versions):
        before 0.19.3 the pipeline engine sums micro-batch gradients, so `rebalance` (unequal shares) would
        weigh replicas wrongly (static unequal shares are refused by set_data_shares)."""
        if internals.gradients_are_micro_batch_means():
            return
        names = [str(p.get("name", "")) for p in self.pdv_config.policy.plugins]
        if "rebalance" in names:
            raise ConfigError([f"pdv.policy.plugins: 'rebalance' needs DeepSpeed >= 0.19.3 (it gives replicas unequal "
                               f"data shares, which the pipeline engine of DeepSpeed {internals.deepspeed_version()} "
                               "cannot weigh: it sums micro-batch gradients instead of averaging them)"])

    def _check_takeover_once(self) -> None:
        """`mean` under ZeRO-1 becomes pdv's reduction when a grad hook watches the gradients: check the ZeRO
        settings for that (once per aggregator, at start-up and before the first such reduction)."""
        if not self._takeover_checked and self.reduce_mode == "zero" and not self.uses_deepspeed_reduction:
            self._check_zero_takeover(self.aggregator.name, hooked=True)
            self._takeover_checked = True

    # -- aggregation ------------------------------------------------------------------------------
    def set_aggregator(self, spec: Any) -> Aggregator:
        """Switch the aggregator (at a step boundary, on every rank of the stage)."""
        spec = {"type": spec} if isinstance(spec, str) else spec
        agg = build_aggregator(spec)
        given = set(spec) if isinstance(spec, dict) else set(getattr(spec, "options", {}) or {})
        if agg.name == "mean" and not {"prescale", "predivide_factor"} & given:
            # follow DeepSpeed's own scaling settings so `mean` stays bit-identical to it
            agg.options.prescale = not self.postscale_gradients()
            agg.options.predivide_factor = float(self.gradient_predivide_factor())
        native = self.reduce_mode != "engine" and agg.name == "mean"
        if self.reduce_mode == "zero" and not native:
            self._check_zero_takeover(agg.name)
        bind_group(agg, self.dp_comm)
        self.aggregator = agg
        self._native_reduce = native
        self._takeover_checked = not (self.reduce_mode == "zero" and native)
        self._check_takeover_once()  # `mean` with the hooks there already
        return agg

    def _check_zero_takeover(self, name: str, hooked: bool = False, why: Optional[str] = None) -> None:
        """What ZeRO-1 settings pdv cannot take the reduction over under (each named by its config key): a
        non-mean aggregator, or `mean` while a grad hook (pdv.policy's Monitor, pdv.faults) needs the whole
        averaged gradients. Where ZeRO keeps compact partition buffers it fills them only inside its own
        reduction: taken over, the optimizer would step on zeros."""
        opt, errors = self.optimizer, []
        if why is not None:  # another reason pdv reduces (unequal data shares: the sample-weighted mean)
            why = f"{why} (unequal shares: pdv's sample-weighted mean) under ZeRO stage 1"
        elif hooked:
            who = ", ".join(sorted({type(h).__name__ for h in self.grad_hooks
                                    if getattr(h, "needs_full_gradients", True)}))
            why = f"pdv.policy / pdv.faults (grad hooks reading the whole averaged gradients: {who}) under ZeRO stage 1"
        else:
            why = f"pdv.aggregation.type '{name}' under ZeRO stage 1"
        if self.zero_cpu_offload():
            errors.append(f"zero_optimization.offload_optimizer: {why} needs the gradients on the device (no "
                          "optimizer offload); " + ("turn offload off, or run without the hooks" if hooked
                                                   else "use 'mean' or turn offload off"))
        if getattr(opt, "overlap_comm", False):
            errors.append(f"zero_optimization.overlap_comm: {why} needs it false (the pipeline reduces at the "
                          "step boundary anyway)")
        if internals.zero_compact_grad_buffers(opt):
            errors.append(f"data_types.grad_accum_dtype: {why} needs the gradient accumulation dtype equal to the "
                          "model's (fp32 accumulation of bf16 weights runs on the BF16 optimizer: leave ZeRO at "
                          "stage 1 with bf16, which DeepSpeed then picks)")
        if not internals.zero_can_hand_over(opt):
            errors.append(f"zero_optimization.stage: {why} needs DeepSpeedZeroOptimizer (got "
                          f"{type(opt).__name__})")
        if errors:
            raise ConfigError(errors)

    @property
    def uses_deepspeed_reduction(self) -> bool:
        """Whether ReduceGrads runs DeepSpeed's own reduction (`mean` in "bf16" mode, and in "zero" mode
        while no grad hook reads the gradients); otherwise the aggregator does the reduction."""
        if self.data_shares is not None:  # unequal shares: the sample-weighted mean is pdv's
            return False
        return self._native_reduce and (self.reduce_mode == "bf16" or not self._grads_watched())

    def _grads_watched(self) -> bool:
        """Whether a grad hook needs the full averaged gradients (`GradHook.needs_full_gradients`)."""
        return any(getattr(h, "needs_full_gradients", True) for h in self.grad_hooks)

    def _refresh_validation(self) -> None:
        """Zeno: one validation micro-batch through the pipeline (validation.py), its gradient handed over
        as the same tensors, order and dtype as the gradients aggregated."""
        if self.reduce_mode == "engine":  # `.grad` of the module's parameters: the order aggregated
            return refresh_validation(self)
        agg, captured = self.aggregator, []
        agg.set_validation_grads = captured.append  # shadows the method for this call
        try:
            if self.reduce_mode == "bf16":
                with internals.bf16_grads_set_aside(self.optimizer):
                    refresh_validation(self)
                    if captured:  # the buffers now hold the validation pass's gradients, / the accumulation steps
                        gas = float(self.gradient_accumulation_steps())
                        captured[0] = [g.float() * gas for g in self.reduction_grads()]
            else:  # ZeRO-1: `.grad` as computed, in the optimizer's parameter order
                refresh_validation(self)
                if captured:
                    by_param = {id(p): g for p, g in zip(reduction_params(self), captured[0])}
                    captured[0] = [by_param[id(p)].float() if by_param[id(p)].dtype == torch.bfloat16
                                   else by_param[id(p)] for p in internals.zero_parameters(self.optimizer)]
        finally:
            del agg.set_validation_grads  # back to the class's method
        if captured:
            agg.set_validation_grads(captured[0])

    def aggregate_gradients(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Run the grad hooks and the aggregator over this stage's data-parallel group."""
        if self.fp16_enabled() and loss_scale_overflow(self.aggregator, grads, self.dp_comm):
            return grads  # every replica skips this step with DeepSpeed's loss scaler (see loss_scale_overflow)
        if self.aggregator.needs_validation:  # Zeno: one validation micro-batch through the pipeline
            self._refresh_validation()
        for hook in self.grad_hooks:
            grads = hook.before(self, grads)
        out = self.aggregator(grads, self.dp_comm, samples=self.group_samples())
        for hook in self.grad_hooks:
            hook.after(self, out)
        return out

    # -- data shares --------------------------------------------------------------------------------
    def _replicas_by_group_rank(self) -> List[int]:
        """The data-parallel id (replica) of each rank of this stage's data-parallel group, by group rank
        (torch orders a group's ranks by global rank, the topology's replicas may be placed otherwise)."""
        import torch.distributed as dist

        group = self.grid.get_data_parallel_group()
        ranks = [dist.get_global_rank(group, r) for r in range(self.dp_world_size)] if self.dp_world_size > 1 \
            else [self.global_rank]
        return [internals.grid_topology(self.grid).get_coord(r).data for r in ranks]

    def _set_static_shares(self) -> None:
        """`pdv.data_shares` at start-up ("equal", a list, or "by_throughput" from the cluster YAML)."""
        from ...policy.shares import static_shares

        topo = internals.grid_topology(self.grid)
        stages, dp = topo.get_dim("pipe"), topo.get_dim("data")
        replica_ranks = [[topo.get_rank(pipe=s, data=d) for s in range(stages)] for d in range(dp)]
        shares = static_shares(self.pdv_config.data_shares, dp, self.total_micro_batches, stages, replica_ranks,
                               self.pdv_config.placement.cluster)
        if shares is not None:
            self.set_data_shares(shares)

    def group_samples(self) -> Optional[List[int]]:
        """Samples of each rank of the data-parallel group this step (by group rank), for the aggregator;
        None with equal shares."""
        if self.data_shares is None:
            return None
        mbs = int(self.train_micro_batch_size_per_gpu())
        return [self.data_shares[d] * mbs for d in self._group_replicas]

    def set_data_shares(self, shares: Optional[Sequence[int]]) -> None:
        """Give each data-parallel replica `shares[d]` micro-batches of the step's global batch (at a step
        boundary, on every rank; None or an equal split = DeepSpeed's own). The global batch is unchanged:
        the shares must add up to `total_micro_batches`. DeepSpeed scales each replica's gradient by
        1/(its own micro-batches), so every replica's gradient is the mean over its samples; the aggregator
        then weighs the replicas by their samples (`group_samples`)."""
        from ...policy.shares import check_shares

        dp, total = self.dp_world_size, self.total_micro_batches
        if shares is not None:
            shares = check_shares(shares, dp, total, what="data shares")
            if len(set(shares)) == 1:
                shares = None
        if shares is not None and not internals.gradients_are_micro_batch_means():
            raise ConfigError([f"pdv.data_shares: unequal shares {list(shares)} need DeepSpeed >= 0.19.3: the "
                               f"pipeline engine of DeepSpeed {internals.deepspeed_version()} sums each replica's "
                               "micro-batch gradients instead of averaging them, so replicas of different shares "
                               "cannot be weighed by their samples"])
        mine = total // dp if shares is None else shares[self.grid.get_data_parallel_id()]
        self.data_shares = shares
        self.micro_batches = mine
        self.set_config_accumulation_steps(mine)  # DeepSpeed's 1/gas gradient scale: this replica's
        if self.reduce_mode == "zero" and shares is not None and self._native_reduce:
            self._check_zero_takeover("mean", why="pdv.data_shares")

    def pdv_scale_loss(self, prescaled_loss: Any) -> Any:
        """The step's reported loss with unequal shares: the mean over every micro-batch of the step (each
        replica's sum x dp / total, which DeepSpeed's all-reduce then divides by dp), not the mean of the
        replicas' means. None (DeepSpeed's own scaling) with equal shares."""
        if self.data_shares is None:
            return None
        factor = self.dp_world_size / self.total_micro_batches
        if isinstance(prescaled_loss, torch.Tensor):
            return prescaled_loss * factor
        if isinstance(prescaled_loss, (tuple, list)):
            return [x * factor if isinstance(x, torch.Tensor) else x for x in prescaled_loss]
        return prescaled_loss

    def _aggregate_in_place(self, grads: List[torch.Tensor]) -> None:
        """Aggregate `grads` and write the result into them; bf16 tensors go through fp32 copies."""
        work = [g.float() if g.dtype == torch.bfloat16 else g for g in grads]
        out = self.aggregate_gradients(work)
        for g, o in zip(grads, out):
            if o is not g:
                g.copy_(o)

    def reduction_grads(self) -> List[torch.Tensor]:
        """The gradients DeepSpeed would all-reduce in this engine's mode, one tensor per parameter, in
        the same order on every rank of the stage (views: writing them changes what the optimizer uses)."""
        if self.reduce_mode == "bf16":
            return internals.bf16_gradient_views(self.optimizer)
        if self.reduce_mode == "zero":
            return internals.zero_reduction_gradients(self.optimizer)
        return self.engine_mode_gradients()

    def _native_mean(self) -> None:
        """DeepSpeed's own reduction (`mean` in "bf16"/"zero" mode); in "bf16" mode the grad hooks see the
        optimizer's buffers around it (they hold the full average afterwards)."""
        grads = self.reduction_grads() if self.reduce_mode == "bf16" and self._grads_watched() else None
        if grads is not None:
            seen = grads
            for hook in self.grad_hooks:
                seen = hook.before(self, seen)
            for g, s in zip(grads, seen):
                if s is not g:
                    g.copy_(s)
        self.deepspeed_reduce_grads()
        if grads is not None:
            for hook in self.grad_hooks:
                hook.after(self, grads)

    def pdv_reduce_grads(self) -> None:
        """The ReduceGrads instruction: DeepSpeed's own reduction or the aggregator's."""
        if not self.pipeline_enable_backward_allreduce:
            return self.deepspeed_reduce_grads()
        if self.uses_deepspeed_reduction:
            return self._native_mean()
        self._check_takeover_once()  # a hook appended after start-up
        # the aggregator takes over (under ZeRO-1 also `mean` while a hook watches the gradients: ZeRO
        # leaves only this rank's partition reduced, the hooks need the whole average)
        with self.grad_boundary_forced(True):
            self._aggregate_in_place(self.reduction_grads())
            if self.reduce_mode == "zero":
                internals.zero_partition_without_comm(self)

    # -- policies and checkpoints (the logic lives in glue.py, pdv_state.py) -------------------------
    def train_batch(self, data_iter: Any = None) -> Any:
        try:
            glue = begin_step(self, data_iter)
            loss = super().train_batch(data_iter=data_iter)
            if glue is not None:  # metrics, then the policies' actions, at this step boundary on every rank
                glue.end(loss)
            if self.pdv_snapshots is not None and self.pdv_snapshots.due(self):
                self.pdv_snapshots.take(self)
        except Exception as exc:
            # pdv.snapshots.in_place: a peer died and the survivors went on in a new world, from the newest
            # snapshot (this object now holds the rebuilt engine): the step again, from there
            if runtime_of(self).in_place is not None and recover_in_place(self, exc):
                return self.train_batch(data_iter)
            raise
        return loss

    def discard_snapshots(self) -> None:
        """Remove this job's in-memory snapshots on every host (collective): call it when training is done
        (they only serve restarts, and they hold host memory). A no-op without `pdv.snapshots`."""
        if self.pdv_snapshots is not None:
            self.pdv_snapshots.discard(self)

    def resume_from_snapshots(self) -> Optional[int]:
        """Restore the newest complete in-memory snapshot of this job (collective; `pdv.snapshots`), under this
        engine's plan whatever the plan that wrote it. Returns its step, None when there is none."""
        if self.pdv_snapshots is None:
            raise ConfigError(["resume_from_snapshots: pdv.snapshots is not set in the config"])
        return self.pdv_snapshots.resume(self)

    def move_to(self, boundaries: Sequence[int], rank_mapping: Sequence[Sequence[int]], **kwargs: Any) -> Any:
        """Move this running pipeline to new stage boundaries and rank placement, in these processes
        (collective, at a step boundary; `move.move_engine`). Returns the MoveReport."""
        return move_engine(self, boundaries, rank_mapping, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's checkpoint plus pdv's state (aggregator, batch size, policies, data position), and the
        same state keyed by layer, which any other plan can load (checkpoint.py)."""
        client_state = kwargs.get("client_state", args[0] if args else None)
        try:  # pdv's files hold plain values only (safe_io): refused on every rank before anything is written
            check_plain(client_state, "client_state")
        except TypeError as exc:
            raise ConfigError([f"save_checkpoint: {exc}"]) from None
        out = super().save_checkpoint(save_dir, tag, *args, **kwargs)
        save_state(self, save_dir, tag)
        save_layer_checkpoint(self, save_dir, tag, client_state)
        return out

    @exit_if_uncaught
    def load_checkpoint(self, load_dir: str, tag: Any = None, *args: Any, missing_ok: bool = False,
                        **kwargs: Any) -> Any:
        """DeepSpeed's loader under the plan the checkpoint was written with; under any other plan (boundaries,
        placement, pipeline depth), its layer-keyed form. Also where DeepSpeed's own cannot restore the state:
        under BF16_Optimizer without ZeRO (DeepSpeed 0.19's loader indexes the saved dict by data-parallel
        rank and fails), and where replicas hold different weights (gossip: DeepSpeed keeps replica 0's).

        Nothing to load (no folder `load_dir`, no `latest` file in it without a `tag`, no folder for the tag)
        raises `CheckpointNotFound` (a ConfigError naming the path) where DeepSpeed would warn and train from
        scratch; with `missing_ok=True` it returns `(None, None)` as DeepSpeed does (rank 0 logs one line):
        the resume-if-there-is-one pattern. Every rank gets the same answer: where some ranks (node-local
        folders) find a checkpoint and others do not, all raise, naming the ranks that found nothing."""
        latest = "latest_universal" if self.load_universal_checkpoint() else "latest"
        missing = agreed_missing(missing_checkpoint(load_dir, tag, latest))
        if missing is not None:
            if not missing_ok:
                raise CheckpointNotFound([missing])
            if self.global_rank == 0:
                logger.info(f"{missing}; starting from scratch (missing_ok=True)")
            return None, None
        meta = read_meta(load_dir, tag)
        if meta is not None and (meta["plan"] != plan_of(self) or meta.get("replicas_differ")
                                 or (self.reduce_mode == "bf16" and not self.zero_optimization())):
            names = ("load_module_strict", "load_optimizer_states", "load_lr_scheduler_states", "load_module_only")
            opts = {**dict(zip(names, args)), **kwargs}
            return load_layer_checkpoint(self, load_dir, tag, opts.get("load_optimizer_states", True),
                                         opts.get("load_lr_scheduler_states", True), opts.get("load_module_only", False))
        out = super().load_checkpoint(load_dir, tag, *args, **kwargs)
        if out[0] is not None:
            load_state(self, load_dir, tag)
        return out


# ---------------------------------------------------------------------------------------------------
# initialize
# ---------------------------------------------------------------------------------------------------
def agreed_missing(missing: Optional[str]) -> Optional[str]:
    """This rank's `missing_checkpoint` answer made the same on every rank (one small all-gather): a
    checkpoint some ranks can read and others cannot would leave the readers loading while the others stop."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return missing
    seen: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, missing)
    lacking = [r for r, m in enumerate(seen) if m is not None]
    if not lacking:
        return None
    if len(lacking) == len(seen):
        return seen[0]
    first = seen[lacking[0]]
    return (f"{first} on rank(s) {', '.join(map(str, lacking))} (the other ranks found it: every node needs the "
            "same checkpoint folder)")


def _bind_local_device() -> None:
    """Bind this process to its GPU (`LOCAL_RANK`, as DeepSpeed's engine does later) on accelerators with
    devices: NCCL object collectives stage on the current device, which is GPU 0 for every rank of a node
    until something binds it ("Duplicate GPU" errors)."""
    import os

    acc = get_accelerator()
    if acc.device_name() != "cpu" and "LOCAL_RANK" in os.environ:
        acc.set_device(int(os.environ["LOCAL_RANK"]))


def _releases_shm_on_error(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A start-up that fails once the process group exists (a bad "pdv" section in a script that set the group
    up itself, a placement the devices cannot take) unlinks this rank's DeepSpeed shm workspace on its way out,
    as one that succeeds does at its end (`internals.release_shm_workspace`): otherwise ~69 MB per rank stay in
    /dev/shm after the job (every rank of a job that fails alike removes its own)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                internals.release_shm_workspace(torch.distributed.get_rank())
            raise
    return wrapper


@exit_if_uncaught  # a ConfigError nothing catches: its lines once (rank 0), exit 2 on every rank
@_releases_shm_on_error
def initialize(args: Any = None,
               model: Optional[nn.Module] = None,
               optimizer: Any = None,
               model_parameters: Any = None,
               training_data: Any = None,
               lr_scheduler: Any = None,
               distributed_port: int = deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None,
               dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable] = None,
               config: Any = None,
               mesh_param: Any = None,
               config_params: Any = None,
               *,
               validation_iter: Any = None,
               init_search_iter: Any = None):
    """Drop-in for `deepspeed.initialize` (same arguments, same return value).

    Reads and validates the `"pdv"` section first (before any process group exists, so a bad key fails
    fast). A `PipelineModule` gets placement applied and a `PDVPipelineEngine`; any other model goes to
    `deepspeed.initialize` unchanged. `validation_iter` feeds aggregators that score against trusted
    validation data (Zeno). `init_search_iter` yields this rank's (inputs, labels) batches for
    `pdv.init_search` (the search runs on the whole model before the engine is built).

    `args.deepspeed_config` (`--deepspeed_config`) is read as the config when `config` is not given, and
    left as the caller set it: DeepSpeed's engine never reads it, and for a model that is not a
    `PipelineModule` it is hidden (set to None) only while `deepspeed.initialize` runs, which refuses it
    beside the config dict pdv hands over. At the end, rank 0 logs what pdv_ext set up (engine, aggregator
    per stage, placement, policies, init search) at INFO through pdv_ext's logger (`pdv_ext.log`,
    `pdv_ext.integrations.deepspeed.summary`).

    A bad `"pdv"` section (or any other setting pdv_ext refuses) raises `pdv_ext.ConfigError`, on every rank
    alike: catch it to handle it. One that nothing catches ends the process with its lines printed once (rank
    0) and exit status 2, without a traceback per rank (`pdv_ext.user_errors.exit_if_uncaught`).
    """
    enter_device_group()  # on the emulated cluster: the start-up so far ran on the host's CPU (--startup-on-host)
    dump_stacks_on_signal()  # on the emulated cluster: a run that times out prints where each rank waits
    if config is None and config_params is not None:
        config = config_params
    from_args = None  # the caller's --deepspeed_config, kept in args (hidden from deepspeed.initialize below)
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config = from_args = args.deepspeed_config
    if config is None:
        raise ConfigError(["config: pass config=... or --deepspeed_config (a DeepSpeed JSON with a 'pdv' section)"])
    ds_config, pdv_cfg = split_config(config)
    apply_log_level(ds_config)  # DeepSpeed's "log_level" quiets pdv_ext's INFO lines too
    ds_config["pdv"] = pdv_cfg.model_dump(exclude_defaults=True)  # readable from engine._config._param_dict

    if not isinstance(model, PipelineModule):
        if pdv_cfg.init_search.enabled:
            raise ConfigError(["pdv.init_search: runs inside initialize for a PipelineModule only; for other models "
                               "call pdv_ext.init_search.search_init(model, loss_fn, data_iter, comm, cfg) first"])
        if pdv_cfg.aggregation.type != "mean":
            raise ConfigError(["pdv.aggregation.type: custom aggregation needs a PipelineModule under "
                               "DeepSpeed (or pdv_ext.horovod for Horovod)"])
        if from_args is not None:  # deepspeed.initialize refuses args.deepspeed_config beside the dict we pass
            args.deepspeed_config = None
        try:
            return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                        training_data=training_data, lr_scheduler=lr_scheduler,
                                        distributed_port=distributed_port, mpu=mpu,
                                        dist_init_required=dist_init_required, collate_fn=collate_fn,
                                        config=ds_config, mesh_param=mesh_param)
        finally:
            if from_args is not None:
                args.deepspeed_config = from_args
    if mpu is not None:
        raise ConfigError(["mpu: must be None with pipeline parallelism (the PipelineModule defines the grid)"])

    if pdv_cfg.init_search.enabled and init_search_iter is None:
        raise ConfigError(["pdv.init_search: pass init_search_iter=... (this rank's (inputs, labels) batches)"])
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    distributed_port=distributed_port, dist_init_required=dist_init_required)
    _bind_local_device()  # the placement and init-search collectives below run before the engine binds it
    before = parameter_names(model)
    model._pdv_placement = resolve_placement(model, pdv_cfg)
    model_parameters = follow_rebuild(model, before, model_parameters, optimizer)
    if pdv_cfg.init_search.enabled:  # before the engine: optimizer and master weights start from the winner
        from ...init_search import search_pipeline_init

        model._pdv_init_search = search_pipeline_init(model, init_search_iter, pdv_cfg.init_search,
                                                      layers=internals.layer_specs(model))
    config_class = DeepSpeedConfig(ds_config, model.mpu())
    internals.set_optimizer_flags(config_class, model)
    engine = PDVPipelineEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, mpu=model.mpu(),
                               dist_init_required=dist_init_required, collate_fn=collate_fn, config=ds_config,
                               config_class=config_class, pdv_config=pdv_cfg, validation_iter=validation_iter)
    internals.configure_python_gc(engine)
    # what a move (move.py) rebuilds the engine from, in the same processes
    runtime_of(engine).build = {"args": args, "optimizer": optimizer, "model_parameters": model_parameters,
                                "training_data": training_data, "lr_scheduler": lr_scheduler,
                                "collate_fn": collate_fn, "dist_init_required": dist_init_required, "config": ds_config}
    if pdv_cfg.snapshots is not None and engine.global_rank == 0 and shared_rendezvous_store():
        logger.warning("pdv.snapshots: torchrun shares one rendezvous store across restarts, where the restarted "
                       "workers find the last attempt's process-group addresses and fail to connect; launch "
                       "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/recovery.md)")
    runtime_of(engine).in_place = setup_in_place(engine, pdv_cfg.snapshots)  # (collective)
    if pdv_cfg.snapshots is not None and pdv_cfg.snapshots.resumes():  # torchrun restarted us: go on
        step = engine.resume_from_snapshots()
        if engine.global_rank == 0:
            logger.info(f"resumed from the in-memory snapshot of step {step}" if step is not None else
                        "no in-memory snapshot of this job: starting from scratch")
    from .summary import log_startup  # rank 0 logs what pdv_ext set up (one small collective)
    log_startup(engine, pdv_cfg)
    internals.release_shm_workspace(engine.global_rank)  # every rank is past init_distributed (the collective)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
