"""The one place that names DeepSpeed's private attributes, module globals and patched methods.

pdv_ext works on a live DeepSpeed engine: it rebuilds a stage's layers, swaps process groups, takes over
the gradient reduction and moves optimizer partitions. DeepSpeed offers no public API for most of that, so
pdv reaches into its internals - here, and nowhere else (tests/unit/test_deepspeed_seam.py enforces it).
Each reach is a named function; `REQUIRED_NAMES` lists every name they rely on, and
`missing_names()` says which of them the installed DeepSpeed lacks (a unit test runs it, and
`make test-compat DEEPSPEED=X.Y.Z` runs the DeepSpeed-facing tests against another release). A DeepSpeed
release that renames one of these names then fails one test that names it, not a training run deep inside.

torch's own private module-hook dictionaries (`_forward_*hooks*`) are named here too: the move copies a
module object and must drop the old engine's hooks from the copy.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import MEMORY_OPT_ALLREDUCE_SIZE, PipelineEngine
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
from deepspeed.utils import groups as ds_groups

#: (module, attribute path) of every DeepSpeed name this module relies on. Instance attributes that DeepSpeed
#: sets in a constructor cannot be checked without building an engine: they are listed in
#: `INSTANCE_NAMES` and exercised by the engine tests.
REQUIRED_NAMES: List[Tuple[str, str]] = [
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._INSTRUCTION_MAP"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_reduce_grads"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_schedule"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._aggregate_total_loss"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine._scale_loss_by_gas"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine.allreduce_gradients"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine.reset_activation_shape"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine.set_train_batch_size"),
    ("deepspeed.runtime.pipe.engine", "MEMORY_OPT_ALLREDUCE_SIZE"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._get_gradients_for_reduction"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._set_bounds"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._build"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._index_tied_modules"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._synchronize_tied_weights"),
    ("deepspeed.runtime.pipe.module", "TiedLayerSpec"),
    ("deepspeed.runtime.pipe.topology", "PipelineParallelGrid"),
    ("deepspeed.runtime.pipe.topology", "ProcessTopology"),
    ("deepspeed.runtime.pipe", "p2p._groups"),
    ("deepspeed.runtime.pipe", "p2p._grid"),
    ("deepspeed.runtime.pipe", "p2p._async"),
    ("deepspeed.utils", "groups.mpu"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.average_tensor"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.buffered_reduce_fallback"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.get_gradient_for_reduction"),
]

#: names some releases of the supported range lack; each use falls back (or refuses a feature) where missing
OPTIONAL_NAMES: List[Tuple[str, str]] = [
    ("deepspeed.utils", "groups._release_process_group_references"),  # not in 0.16.9 (forget_process_groups)
    ("deepspeed.runtime.engine", "DeepSpeedEngine._configure_python_gc"),  # 0.19.8
    ("deepspeed.runtime.engine", "DeepSpeedEngine._backward_prologue_per_tensor"),  # 0.19.3
    ("deepspeed", "set_optimizer_flags"),  # 0.17.6
]

#: instance attributes DeepSpeed sets in its constructors (what they are on; checked by the engine tests)
INSTANCE_NAMES: Dict[str, Tuple[str, ...]] = {
    "PipelineModule": ("_topo", "_grid", "_num_layers", "_layer_specs"),
    "PipelineEngine": ("_config", "_force_grad_boundary"),
    "PipelineParallelGrid": ("_topo",),
    "parameter (ZeRO-1 / BF16_Optimizer)": ("_hp_mapping",),
    "BF16_Optimizer / DeepSpeedZeroOptimizer": ("_hp_optimizer_states_linked",),
    "DeepSpeedZeroOptimizer (>= 0.19.8; read with getattr)": ("_use_compact_grad_partition_buffer",),
}


def missing_instance_names(engine: Any) -> List[str]:
    """Each of `INSTANCE_NAMES` a live engine (or its module, grid, optimizer, parameters) lacks, as
    "Class.attr": the names no import can check, checked on a built engine by the engine tests."""
    out = []

    def need(obj: Any, owner: str, names: Sequence[str]) -> None:
        out.extend(f"{owner}.{n}" for n in names if not hasattr(obj, n))

    need(engine.module, "PipelineModule", INSTANCE_NAMES["PipelineModule"])
    need(engine, "PipelineEngine", INSTANCE_NAMES["PipelineEngine"])
    need(engine.grid, "PipelineParallelGrid", INSTANCE_NAMES["PipelineParallelGrid"])
    opt = engine.optimizer
    if hasattr(opt, "bf16_groups") or hasattr(opt, "single_partition_of_fp32_groups"):  # BF16_Optimizer, ZeRO-1
        need(opt, type(opt).__name__, INSTANCE_NAMES["BF16_Optimizer / DeepSpeedZeroOptimizer"])
        groups = getattr(opt, "bf16_groups", None) or getattr(opt, "bit16_groups", [])
        params = [p for g in groups for p in g if p.numel() > 0]
        if params and not any(hasattr(p, "_hp_mapping") for p in params):
            out.append("parameter._hp_mapping")
    return out  # `_use_compact_grad_partition_buffer` is optional: releases before 0.19.8 have no compact buffers


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_names(names: Sequence[Tuple[str, str]] = tuple(REQUIRED_NAMES)) -> List[str]:
    """Each of `names` the installed DeepSpeed lacks, as "module:attribute" (empty: all there)."""
    out = []
    for module, path in names:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            out.append(f"{module}:{path}")
    return out


# ---------------------------------------------------------------------------------------------------
# The engine subclass point: DeepSpeed's private hooks, forwarded to pdv's public methods
# ---------------------------------------------------------------------------------------------------
def _exec_pdv_reduce_grads(engine: Any) -> None:
    engine.pdv_reduce_grads()


class EngineSeam(PipelineEngine):
    """DeepSpeed's PipelineEngine with its private extension points turned into public ones.

    The pipeline engine dispatches schedule instructions through the class-level dict `_INSTRUCTION_MAP`,
    which holds the *base class's* functions: a subclass overriding `_exec_reduce_grads` is never called.
    The map is rebuilt here with ReduceGrads -> `self.pdv_reduce_grads()` (DeepSpeed's DualPipeVEngine does
    the same). The step's reported loss goes through `self.pdv_scale_loss` (None: DeepSpeed's own scaling).
    """

    def pdv_reduce_grads(self) -> None:  # the subclass overrides it
        self.deepspeed_reduce_grads()

    def pdv_scale_loss(self, prescaled_loss: Any) -> Any:  # the subclass overrides it; None: DeepSpeed's
        return None

    def _scale_loss_by_gas(self, prescaled_loss: Any, eval_micro_batches: Any = None) -> Any:
        if eval_micro_batches is None:
            scaled = self.pdv_scale_loss(prescaled_loss)
            if scaled is not None:
                return scaled
        return super()._scale_loss_by_gas(prescaled_loss, eval_micro_batches=eval_micro_batches)

    def deepspeed_reduce_grads(self) -> None:
        """DeepSpeed's own ReduceGrads instruction (its bucketed all-reduce, or ZeRO's / BF16's)."""
        PipelineEngine._exec_reduce_grads(self)

    def engine_mode_gradients(self) -> List[Any]:
        """The gradients DeepSpeed's fp32/fp16 reduction would all-reduce (non-MoE), in its order."""
        return self._get_gradients_for_reduction()[0]

    @contextlib.contextmanager
    def grad_boundary_forced(self, on: bool = True) -> Iterator[None]:
        """DeepSpeed treats the next reduction as a gradient-accumulation boundary (or not) inside."""
        saved = getattr(self, "_force_grad_boundary", False)
        self._force_grad_boundary = on
        try:
            yield
        finally:
            self._force_grad_boundary = saved

    def set_config_accumulation_steps(self, steps: int) -> None:
        """DeepSpeed's 1/gas gradient scale reads its config's accumulation steps: this replica's share."""
        self._config.gradient_accumulation_steps = int(steps)

    def run_schedule(self, sched: Any) -> None:
        """Run a schedule's instructions through this engine's instruction map."""
        self._exec_schedule(sched)

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ReduceGrads: _exec_pdv_reduce_grads}


def deepspeed_version() -> str:
    import deepspeed

    return str(getattr(deepspeed, "__version__", "?"))


def gradients_are_micro_batch_means() -> bool:
    """Whether the pipeline engine divides each micro-batch's loss by the accumulation steps, so that a
    replica's gradient is the mean over its micro-batches (DeepSpeed >= 0.19.3). DeepSpeed 0.16's pipeline
    engine skips that scaling (it turns `enable_backward_allreduce` off, which also turns the scaling off):
    its gradient is `gas` times the mean, in vanilla DeepSpeed too. pdv's `mean` follows DeepSpeed either way;
    what weighs replicas by their micro-batches (unequal data shares, a move that changes the width) is
    refused there."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return hasattr(DeepSpeedEngine, "_backward_prologue_per_tensor")


def set_optimizer_flags(config_class: Any, model: Any) -> None:
    """What deepspeed.initialize does before building an engine (Muon's parameter flags, DeepSpeed >= 0.17.6;
    older releases have neither)."""
    import deepspeed

    fn = getattr(deepspeed, "set_optimizer_flags", None)
    if fn is not None:
        fn(config_class, model)


def release_shm_workspace(rank: int, port: Optional[str] = None, shm_dir: str = "/dev/shm") -> List[str]:
    """Unlink the name of this rank's shm workspace, keeping its memory mapped: DeepSpeed maps every rank's
    workspace when it initializes and never opens one again, so once every rank has passed that (any
    collective over the world after `init_distributed`), the names only keep the memory after the job ends.
    A job killed or one that exits then leaves nothing behind (before, ~69 MB per rank per job piled up in
    host memory). Returns the paths removed (none where the op is not in use)."""
    import os

    from ...spawn import remove_deepspeed_shm

    port = port if port is not None else os.environ.get("MASTER_PORT")
    if not port:
        return []
    return remove_deepspeed_shm(int(port), rank=int(rank), shm_dir=shm_dir)


def configure_python_gc(engine: Any) -> None:
    """What deepspeed.initialize does after building an engine (its garbage-collection settings)."""
    fn = getattr(engine, "_configure_python_gc", None)
    if fn is not None:
        fn()  # DeepSpeed >= 0.19.8; older releases have no such step


def wrap_instructions(engine: Any, wrap: Callable[[type, Callable], Callable],
                      instructions: Optional[Sequence[type]] = None) -> None:
    """Give `engine` an instance-level instruction map in which each of `instructions` (default: all)
    runs `wrap(instruction class, current function)`: how the policy layer times forward/backward and
    the placement benchmark times every instruction, on top of whatever map the engine has now."""
    imap = dict(engine._INSTRUCTION_MAP)
    for instr in (imap if instructions is None else instructions):
        imap[instr] = wrap(instr, imap[instr])
    engine._INSTRUCTION_MAP = imap


def instance_instructions(engine: Any) -> Optional[Dict[type, Callable]]:
    """The engine's own instruction map (`wrap_instructions`), None when it uses its class's."""
    return engine.__dict__.get("_INSTRUCTION_MAP")


def set_instance_instructions(engine: Any, imap: Optional[Dict[type, Callable]]) -> None:
    """Give the engine its own instruction map back (`instance_instructions`), or its class's with None."""
    if imap is None:
        engine.__dict__.pop("_INSTRUCTION_MAP", None)
    else:
        engine._INSTRUCTION_MAP = imap


def wrap_loss_aggregation(engine: Any, wrap: Callable[[Callable], Callable]) -> None:
    """Run `engine`'s end-of-step loss averaging (no instruction of the schedule) through `wrap(fn)`,
    `fn(engine)` being DeepSpeed's own."""
    timed = wrap(type(engine)._aggregate_total_loss)
    engine._aggregate_total_loss = lambda: timed(engine)


# ---------------------------------------------------------------------------------------------------
# PipelineModule and its topology
# ---------------------------------------------------------------------------------------------------
def module_topology(module: Any) -> Any:
    """The ProcessTopology a PipelineModule was built with."""
    return module._topo


def grid_topology(grid: Any) -> Any:
    """The ProcessTopology of a PipelineParallelGrid (an engine's `grid`)."""
    return grid._topo


def num_layers(module: Any) -> int:
    """The pipeline's layer count (every stage's layers, not this stage's)."""
    return int(module._num_layers)


def layer_specs(module: Any) -> List[Any]:
    """The module's LayerSpecs (and layers) of the whole pipeline, by global index."""
    return list(module._layer_specs)


def set_topology(module: Any, topo: Any) -> None:
    """Give a PipelineModule a new topology and the grid (process groups: collective) built from it."""
    module._topo = topo
    module.num_stages = topo.get_dim("pipe")
    module._grid = PipelineParallelGrid(process_group=module.world_group, topology=topo)


def rebuild_stage(module: Any, parts: List[int], stage: int, device: Any) -> None:
    """Drop the local layers and build those of `stage` under `parts` (PipelineModule.__init__'s tail,
    local: no communication)."""
    from torch import nn

    for name in [n for n in module._modules if n.isdigit()]:
        del module._modules[name]
    module.tied_modules = nn.ModuleDict()
    module.tied_weight_attrs = {}
    module.forward_funcs = []
    module.fwd_map = {}
    module.is_checkpointable_results = []
    module.is_checkpointable_results_interval = None
    module.stage_id = stage
    module.parts = list(parts)
    module._set_bounds(start=parts[stage], stop=parts[stage + 1])
    module._build()
    module.to(device)


def link_tied(module: Any) -> None:
    """The tied layers' groups (collective over the world), their weights made equal from the first stage
    that holds them (PipelineModule.__init__ does this once)."""
    module.tied_comms = module._index_tied_modules()
    module._synchronize_tied_weights()


# ---------------------------------------------------------------------------------------------------
# Moving an engine in place: module globals, object state
# ---------------------------------------------------------------------------------------------------
def p2p_globals() -> Tuple[Any, Any, Any]:
    """The pipeline's module-level process-group state (p2p's groups and grid, DeepSpeed's mpu), which
    building an engine overwrites: saved before a move, restored if it fails."""
    return (p2p._groups, p2p._grid, ds_groups.mpu)


def restore_p2p_globals(saved: Tuple[Any, Any, Any]) -> None:
    p2p._groups, p2p._grid, ds_groups.mpu = saved


#: DeepSpeed's cached groups (deepspeed.utils.groups): single ones, and dicts of them
_DS_GROUP_GLOBALS = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                     "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mpu", "mesh_device")
_DS_GROUP_DICTS = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                   "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")


@contextlib.contextmanager
def new_groups_time_out_after(seconds: float) -> Iterator[None]:
    """Inside: every process group made without a timeout of its own (DeepSpeed's `new_group` calls pass
    none, so torch gives each its default, 30 minutes) waits `seconds` for a silent member, as the world it
    is made from does. In-place recovery builds the survivors' engine so: a member lost while the engine's
    groups connect (gloo's connect waits in the store for its address) fails the build within `seconds`,
    instead of holding the survivors for half an hour. Reads torch's module defaults at call time
    (`_get_default_timeout`; tested on torch 2.13)."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    names = [n for n in ("default_pg_timeout", "default_pg_nccl_timeout")
             if isinstance(getattr(c10d, n, None), timedelta)]
    saved = {n: getattr(c10d, n) for n in names}
    for n in names:
        setattr(c10d, n, timedelta(seconds=seconds))
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(c10d, n, v)


def keep_forever(groups: Sequence[Any]) -> None:
    """Never destroy `groups` (process groups of a world left behind): a gloo group's destructor waits for the
    work still queued on it, and a collective this rank gave up on (`torch_comm`'s interrupt) may wait on a
    peer that is alive in the new world and will never take part: the destructor, run wherever the last
    reference drops (seen: the first step after a recovery), would then hold this rank until the old group's
    timeout (30 minutes for DeepSpeed's groups) while the new world waits for it. A reference that is never
    released (not even at interpreter exit) costs a few objects per recovery."""
    import ctypes

    for g in groups:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))


def forget_process_groups() -> None:
    """Drop the world and every group made from it, in torch and in DeepSpeed's module caches, without
    waiting on them (a peer is gone: a collective on them would fail or hang). torch's
    `_abort_process_group` aborts what can be aborted (NCCL; gloo cannot be) and clears its group maps, so
    the next `init_process_group` starts a new world; DeepSpeed's group caches (its
    `_release_process_group_references` where the release has it, the same names by hand where not) and the p2p
    globals are reset, so the next engine builds its own."""
    from torch.distributed import distributed_c10d as c10d

    if c10d.is_initialized():  # (not after a world that failed to form)
        keep_forever(list(c10d._world.pg_map))  # before the maps are cleared: every group of the old world
        c10d._abort_process_group()
    release = getattr(ds_groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
    else:
        for name in _DS_GROUP_GLOBALS:
            if hasattr(ds_groups, name):
                setattr(ds_groups, name, None)
        for name in _DS_GROUP_DICTS:
            value = getattr(ds_groups, name, None)
            if isinstance(value, dict):
                value.clear()
    p2p._groups, p2p._grid = None, None
    p2p._async.clear()


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def module_copy(engine: Any) -> Any:
    """A second PipelineModule object sharing nothing mutable with `engine.module` (containers copied, the
    old engine's forward hooks dropped): a new stage is built there while the old one stays intact."""
    import copy

    old = engine.module
    new = object.__new__(type(old))
    state = {k: (copy.copy(v) if isinstance(v, (dict, list, set)) else v) for k, v in old.__dict__.items()}
    object.__setattr__(new, "__dict__", state)
    for handle in (getattr(engine, "module_forward_pre_hook", None), getattr(engine, "module_forward_post_hook", None)):
        if handle is not None:
            for d in _FORWARD_HOOK_DICTS:
                getattr(new, d, {}).pop(handle.id, None)
    return new


def swap_engine_state(user_engine: Any, user_module: Any, built_engine: Any, built_module: Any) -> None:
    """The user's engine and module objects take over the state of the ones a move built (both keep
    working: the user's references stay valid)."""
    object.__setattr__(user_module, "__dict__", built_module.__dict__)
    built_engine._modules["module"] = user_module
    object.__setattr__(user_engine, "__dict__", built_engine.__dict__)


# ---------------------------------------------------------------------------------------------------
# Optimizers: ZeRO-1 without its communication, BF16 buffers, partition fragments
# ---------------------------------------------------------------------------------------------------
def zero_partition_without_comm(engine: Any) -> None:
    """ZeRO-1's reduce_gradients with its communication switched off: the gradients already hold the
    aggregate, ZeRO copies this rank's partition into its averaged-gradient buffers as usual."""
    opt = engine.optimizer
    opt.average_tensor = lambda tensor, *a, **k: tensor
    opt.buffered_reduce_fallback = lambda *a, **k: None
    try:
        engine.allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)
    finally:
        del opt.average_tensor, opt.buffered_reduce_fallback  # back to the class's methods


def zero_can_hand_over(opt: Any) -> bool:
    """Whether a ZeRO optimizer lets pdv reduce for it (the methods switched off above exist)."""
    return all(hasattr(opt, a) for a in ("bit16_groups", "get_gradient_for_reduction", "average_tensor",
                                         "buffered_reduce_fallback"))


def zero_compact_grad_buffers(opt: Any) -> bool:
    """Whether ZeRO keeps compact gradient partition buffers (filled only inside its own reduction)."""
    compact = getattr(opt, "_use_compact_grad_partition_buffer", None)
    return compact is not None and any(compact(i) for i in range(len(getattr(opt, "bit16_groups", []))))


def hp_fragments(params: Sequence[Any]) -> List[Tuple[int, int, int, int]]:
    """This rank's fragments of a group's parameters in its flat fp32 partition (ZeRO-1/2, BF16_Optimizer:
    what DeepSpeed's universal checkpoint reads): (index in group, first element in the flattened
    parameter, first element in the flat partition, element count)."""
    out = []
    for j, p in enumerate(params):
        m = getattr(p, "_hp_mapping", None)
        if m is not None:
            out.append((j, m.lp_fragment_address.start, m.hp_fragment_address.start, m.hp_fragment_address.numel))
    return out


def relink_optimizer_state(wrapper: Any) -> None:
    """After the flat optimizer state was written: DeepSpeed re-links its fragment views at the next step."""
    if hasattr(wrapper, "_hp_optimizer_states_linked"):
        wrapper._hp_optimizer_states_linked = False


def bf16_gradient_views(opt: Any) -> List[Any]:
    """BF16_Optimizer's flat gradient buffers, one view per parameter shaped like it, in group order."""
    return [g.view(p.shape) for lps, gs in zip(opt.bf16_groups, opt.fp32_groups_gradients) for p, g in zip(lps, gs)]


def bf16_parameters(opt: Any) -> List[Any]:
    """BF16_Optimizer's parameters in its reduction order."""
    return [p for g in opt.bf16_groups for p in g]


@contextlib.contextmanager
def bf16_grads_set_aside(opt: Any) -> Iterator[None]:
    """Zero the BF16 optimizer's gradient buffers for an extra backward pass and put the accumulated
    gradients back afterwards (the pass adds into those buffers; `.grad` the pass restores itself)."""
    saved = [f.clone() for f in opt.fp32_groups_gradients_flat]
    flags = [list(f) for f in opt.fp32_groups_has_gradients]
    for f in opt.fp32_groups_gradients_flat:
        f.zero_()
    try:
        yield
    finally:
        for f, s in zip(opt.fp32_groups_gradients_flat, saved):
            f.copy_(s)
        opt.fp32_groups_has_gradients[:] = flags


def zero_parameters(opt: Any) -> List[Any]:
    """ZeRO-1's parameters in its reduction order (empty ones left out)."""
    return [p for group in opt.bit16_groups for p in group if p.numel() > 0]


def zero_reduction_gradients(opt: Any) -> List[Any]:
    """The full gradients ZeRO-1 reduces, one per parameter in its order; a parameter without a gradient
    gets zeros (every rank must reduce the same tensors: DeepSpeed's own rule)."""
    import torch

    out = []
    for p in zero_parameters(opt):
        g = opt.get_gradient_for_reduction(p)
        if g is None:
            if getattr(opt, "use_grad_accum_attribute", False):
                p.grad_accum = torch.zeros_like(p, dtype=opt.gradient_accumulation_dtype)
            else:
                p.grad = torch.zeros_like(p)
            g = opt.get_gradient_for_reduction(p)
        out.append(g)
    return out


def optimizer_layout(opt: Any) -> Optional[Dict[str, Any]]:
    """Where a DeepSpeed optimizer wrapper keeps its fp32 masters and state: {"kind", "lp_groups", "flats",
    "fragments" (per group, `hp_fragments`; None: every parameter whole, back to back), "dp_group"}; None for
    a torch optimizer (or none). Raises ValueError for what cannot be cut into parameters."""
    import torch

    if hasattr(opt, "bf16_groups") and hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return {"kind": "bf16", "lp_groups": opt.bf16_groups, "flats": opt.fp32_groups_flat_partition,
                "fragments": [hp_fragments(g) for g in opt.bf16_groups], "dp_group": opt.dp_process_group}
    if hasattr(opt, "bit16_groups") and hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1
        if getattr(opt, "cpu_offload", False):
            raise ValueError("zero_optimization.offload_optimizer: moving or re-planning the optimizer state of an "
                             "offloaded ZeRO optimizer is not supported")
        return {"kind": "zero", "lp_groups": opt.bit16_groups, "flats": opt.single_partition_of_fp32_groups,
                "fragments": [hp_fragments(g) for g in opt.bit16_groups], "dp_group": opt.dp_process_group}
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer
        return {"kind": "fp16", "lp_groups": opt.fp16_groups, "flats": opt.fp32_groups_flat, "fragments": None,
                "dp_group": None}
    if opt is None or isinstance(opt, torch.optim.Optimizer):
        return None
    raise ValueError(f"optimizer {type(opt).__name__}: its state cannot be cut into parameters (supported: torch "
                     "optimizers, BF16_Optimizer, FP16_Optimizer, ZeRO stage 1)")
