"""Glue between the policy layer and DeepSpeed's pipeline engine (PDVPipelineEngine calls only this).

The policy layer knows an engine only through the applier protocol of pdv_ext.policy.runner; this is
DeepSpeed's side of it (Horovod's is in pdv_ext.integrations.horovod).

- `EngineApplier`: how actions change a live PipelineEngine (PLATFORM.md: `set_train_batch_size` for the
  micro-batches per step; a new micro-batch size also needs the config value, `engine.micro_batch_size`
  and `reset_activation_shape()` on every rank — and the data iterator re-based, see policy/data.py).
- `PolicyGlue`: builds the Monitor (grad hook + forward/backward timing) and the PolicyRunner from
  `pdv.policy`, and runs them around each `train_batch`.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...comm import world_comm
from ...policy.applier import ApplierBase
from ...policy.base import build_policy
from ...policy.config import PolicyConfig
from ...emulated_device import DeviceClock, device_clock
from ...policy.metrics import Monitor
from ...policy.runner import PolicyRunner
from .internals import wrap_instructions
from .runtime import runtime_of
from ...placement.plan import Layout
from .topology import engine_layout, engine_mapping


class EngineApplier(ApplierBase):
    """Applies actions to a PipelineEngine (the runner calls it on every rank at a step boundary)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.num_stages = int(engine.num_stages)

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def aggregator(self) -> Any:
        return self.engine.aggregator

    @property
    def data_iterator(self) -> Any:
        return self.engine.data_iterator

    def batch_geometry(self) -> Tuple[int, int, int]:
        """(micro-batch size, micro-batches per replica and step on average, replicas): with unequal data
        shares the middle one is the global batch's micro-batches over the replicas."""
        e = self.engine
        dp = int(e.grid.get_data_parallel_world_size())
        return int(e.train_micro_batch_size_per_gpu()), int(e.total_micro_batches) // dp, dp

    def data_shares(self) -> Optional[List[int]]:
        """Micro-batches per replica (None: the equal split)."""
        return None if self.engine.data_shares is None else list(self.engine.data_shares)

    def set_data_shares(self, shares: Optional[Sequence[int]]) -> None:
        """New shares of the same global batch: the engine's micro-batches, the data iterator's slices and
        the Monitor's per-replica batch follow (every rank, at a step boundary)."""
        e = self.engine
        e.set_data_shares(shares)
        self.iterator_follows_shares(e.data_shares)
        glue = getattr(e, "pdv_policy", None)
        if glue is not None:
            glue.monitor.shares = e.data_shares

    def replan(self, boundaries: Sequence[int], rank_mapping: Sequence[Sequence[int]]) -> Any:
        """Move the pipeline (`engine.move_to`: move.py); the engine object stays the user's."""
        return self.engine.move_to(boundaries, rank_mapping)

    def placement(self) -> Dict[str, Any]:
        """The plan in force and where it came from (the start-up plan's cluster, profile and solver)."""
        e = self.engine
        pl = e.pdv_config.placement
        return {**Layout(e.module.parts, engine_mapping(e)).to_dict(),
                "cluster": pl.cluster, "profile": pl.profile, "solver": pl.solver, "schedule": pl.schedule,
                "aggregator": pl.aggregator, "solver_options": dict(pl.solver_options),
                "total_micro_batches": int(e.total_micro_batches),
                # the cluster's device under each rank, as the start-up plan matched them (None: rank r on
                # device r); fewer than the cluster's after a restart on the devices left
                "devices": (getattr(e.module, "_pdv_plan", None) or {}).get("devices")}

    def set_batch_size(self, micro_batches: int, micro_batch_size: int) -> None:
        e = self.engine
        if e.data_shares is not None:  # a new global batch starts from the equal split
            self.set_data_shares(None)
        if micro_batch_size != e.train_micro_batch_size_per_gpu():
            self.iterator_follows_micro_batch_size(micro_batch_size)
            e.set_train_micro_batch_size(micro_batch_size)
            e.micro_batch_size = micro_batch_size
            e.reset_activation_shape()
        e.set_train_batch_size(micro_batch_size * micro_batches * e.grid.get_data_parallel_world_size())
        e.total_micro_batches = int(e.micro_batches) * int(e.grid.get_data_parallel_world_size())

    def set_aggregator(self, spec: Any) -> None:
        self.engine.set_aggregator(spec)


class _MonitorHook:
    """GradHook: |g|² of the local gradients before aggregation and of the aggregated ones after (with
    `monitor.gns_preconditioned`, of both scaled element-wise by Adam's 1 / (sqrt(v) + eps))."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor
        self._scales: Optional[List[Optional[torch.Tensor]]] = None
        self._skip = False
        self._warned = False

    def before(self, engine: Any, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        self._scales = None
        self._skip = False
        if self.monitor.config.gns_preconditioned and self.monitor.norms_now:
            opt = getattr(engine, "optimizer", None)
            self._scales = adam_scales(opt, grads)
            if self._scales is not None:
                self.monitor.add_local_grads(_scaled(grads, self._scales))
                return grads
            if not getattr(opt, "state", None):  # before the optimizer's first step: no second moment yet
                self._skip = True
                return grads
            if not self._warned:  # another optimizer, or a mode whose buffers are not the parameters' .grad
                self._warned = True
                warnings.warn("pdv.policy.monitor.gns_preconditioned: the optimizer keeps no Adam second moment "
                              "for these gradients (torch Adam / AdamW in fp32 without ZeRO only): the plain "
                              "noise scale is measured")
        self.monitor.add_local_grads(grads)
        return grads

    def after(self, engine: Any, grads: List[torch.Tensor]) -> None:
        if self._skip:
            return
        if self._scales is not None and len(self._scales) == len(grads):  # the same tensors, in order
            self.monitor.add_aggregated_grads(_scaled(grads, self._scales))
            return
        self.monitor.add_aggregated_grads(grads)


def adam_scales(optimizer: Any, grads: List[torch.Tensor]) -> Optional[List[Optional[torch.Tensor]]]:
    """1 / (sqrt(v / (1 - beta2^t)) + eps) for each gradient of `grads` whose parameter has Adam's second moment
    `v` in `optimizer` (matched by the gradient's storage: in fp32 without ZeRO the engine hands the hooks the
    parameters' own .grad); None unless every non-empty gradient has one (a partial preconditioning would mix
    two norms)."""
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return None
    state = getattr(optimizer, "state", {})
    by_storage: Dict[int, Tuple[torch.Tensor, Any, float, float]] = {}  # what a scale needs, by the .grad's storage
    for group in optimizer.param_groups:
        eps, beta2 = float(group.get("eps", 1e-8)), float(group.get("betas", (0.9, 0.999))[1])
        for p in group["params"]:
            st = state.get(p) if p.grad is not None else None
            v = st.get("exp_avg_sq") if st else None
            if v is not None and v.shape == p.grad.shape:
                by_storage[p.grad.data_ptr()] = (v, st.get("step", 1), beta2, eps)
    found = [None if g is None or not g.numel() else by_storage.get(g.data_ptr(), False) for g in grads]
    if any(f is False for f in found):  # match first: no scale is computed for gradients that fall back
        return None
    return [None if f is None else _adam_scale(*f) for f in found]


def _adam_scale(v: torch.Tensor, step: Any, beta2: float, eps: float) -> torch.Tensor:
    if torch.is_tensor(step) and step.device.type != "cpu":  # fused / capturable Adam: kept on the device
        step = step.to(dtype=v.dtype).clamp(min=1)
    else:
        step = max(float(step), 1.0)
    return ((v / (1 - beta2 ** step)).sqrt() + eps).reciprocal()


def _scaled(grads: List[torch.Tensor], scales: List[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    return [g if s is None else g * s.to(g.dtype) for g, s in zip(grads, scales) if g is not None]


def _timed(fn: Any, monitor: Monitor, cuda: bool = False, clock: Optional[DeviceClock] = None) -> Any:
    """`fn` (an instruction's handler) timed into `monitor` by the device's clock: CUDA events on GPU ranks
    (where the host only queues kernels: its clock would time the launches), an emulated device's busy time
    on its CPU quota (`clock`, emulated_device.py), else the host clock."""
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(self, *args, **kwargs)
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                monitor.add_compute_span(start, end)
        if clock is not None:
            c = clock.start()
            try:
                return fn(self, *args, **kwargs)
            finally:
                monitor.add_compute(clock.seconds_since(c))
        t = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            monitor.add_compute(time.perf_counter() - t)

    return run


class PolicyGlue:
    """Monitor + runner of one engine, driven by PDVPipelineEngine.train_batch (begin/end)."""

    def __init__(self, engine: Any, cfg: PolicyConfig):
        self.cfg = cfg
        # the world: every rank of every stage agrees; on NCCL the metrics travel on a gloo twin (no device sync)
        self.comm = world_comm()
        cuda = torch.device(getattr(engine, "device", "cpu")).type == "cuda"
        self.monitor = Monitor(self.comm, engine.grid.get_data_parallel_world_size(), cfg.monitor, every=cfg.every,
                               sync=torch.cuda.synchronize if cuda else None)
        policies = [build_policy(p) for p in cfg.plugins]
        self.runner: Optional[PolicyRunner] = (
            PolicyRunner(policies, self.comm, EngineApplier(engine), cfg.on_error, cfg.every, cfg.lr_scaling)
            if policies else None)
        self.last_metrics: Dict[str, Any] = {}
        self._begun = False
        self._step_lr: Optional[float] = None
        self.attach(engine)

    def attach(self, engine: Any) -> None:
        """Wire this glue into `engine`: at start-up, and again when a move (move.py) rebuilt the
        engine in the same processes - the Monitor, the runner and the user's reference to the glue live on."""
        from deepspeed.runtime.pipe import schedule

        cuda = torch.device(getattr(engine, "device", "cpu")).type == "cuda"
        self.monitor.dp_size = int(engine.grid.get_data_parallel_world_size())
        # (stage, replica) of every global rank: what each per-rank time belongs to
        self.monitor.layout = engine_layout(engine, self.comm.size)
        self.monitor.shares = engine.data_shares
        engine.grad_hooks.append(_MonitorHook(self.monitor))
        # time forward/backward per rank (the straggler signal) through an instance-level instruction map
        clock = None if cuda else device_clock()
        wrap_instructions(engine, lambda instr, fn: _timed(fn, self.monitor, cuda, clock),
                          (schedule.ForwardPass, schedule.BackwardPass))
        self.rebind(engine)

    def rebind(self, engine: Any) -> None:
        """Drive `engine` from now on: after a move, the user's engine object (which took over the new engine's
        state), not the object the move built - the next move, and the step counter, act on the user's."""
        self.engine = engine
        self.applier = EngineApplier(engine)
        if self.runner is not None:
            self.runner.applier = self.applier

    def begin(self) -> None:
        if not self._begun:
            self._begun = True
            if self.runner is not None:
                ctx_step = int(self.engine.global_steps)
                self.runner.on_train_begin(ctx_step)
        # the LR this step's optimizer update uses: DeepSpeed's scheduler moves it only after that update
        lrs = self.applier.get_lr()
        self._step_lr = lrs[0] if lrs else None
        self.monitor.begin_step(int(self.engine.global_steps) + 1)

    def end(self, loss: Any) -> Dict[str, Any]:
        """After train_batch: the Monitor's metrics (`lr`: the LR the step used, the policies' scale
        included); on agreement steps the runner applies the actions."""
        e = self.engine
        mbs, mb, _ = self.applier.batch_geometry()
        if self.runner is not None:  # the scheduler just reset the LR: the policies' scale goes back on now
            self.runner.sync_lr()
        m = self.monitor.end_step(int(e.global_steps), float(loss) if loss is not None else None,
                                  self._step_lr, mbs, mb, getattr(e.aggregator, "report", None))
        if m is None:  # not an agreement step (pdv.policy.every): no communication
            return self.last_metrics
        if self.runner is not None:
            self.runner.after_step(m)
        self.last_metrics = m
        return m

    def close(self) -> None:
        self.monitor.close()

    # ---- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"monitor": self.monitor.state_dict(),
                "runner": self.runner.state_dict() if self.runner is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.monitor.load_state_dict(state["monitor"])
        if self.runner is not None and state.get("runner") is not None:
            self.runner.load_state_dict(state["runner"])
        self._begun = False  # policies see on_train_begin again (after their state is restored)


def build_glue(engine: Any, carried: Optional[PolicyGlue] = None) -> Optional[PolicyGlue]:
    """A PolicyGlue when `pdv.policy` asks for one (plugins or an enabled monitor), else None; `carried`
    (the glue of the engine a move replaces) is attached to `engine` instead of building a new one."""
    if carried is not None:
        carried.attach(engine)
        return carried
    cfg = engine.pdv_config.policy
    return PolicyGlue(engine, cfg) if cfg.active else None


def begin_step(engine: Any, data_iter: Any = None) -> Optional[PolicyGlue]:
    """Before a train_batch: hand a restored data position to the iterator, start the step's clock."""
    rt = runtime_of(engine)
    pending = rt.pending_data
    if pending is not None:
        it = data_iter if data_iter is not None else engine.data_iterator
        if hasattr(it, "load_state_dict"):
            it.load_state_dict(pending)
            rt.pending_data = None
            replica = rt.pending_replica  # a move gave this rank another replica
            if replica is not None:
                if hasattr(it, "set_replica"):
                    it.set_replica(*replica)
                    if hasattr(it, "set_shares"):  # shares carried over a move that kept the replica count
                        it.set_shares(getattr(engine, "data_shares", None))
                else:
                    warnings.warn("the data iterator cannot follow the move to another replica (no set_replica): "
                                  "use pdv_ext.policy.data.ElasticBatches")
                rt.pending_replica = None
    glue: Optional[PolicyGlue] = getattr(engine, "pdv_policy", None)
    if glue is not None:
        glue.begin()
    return glue
