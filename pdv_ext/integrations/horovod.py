"""Horovod integration: `DistributedOptimizer` with pluggable aggregation, elastic state, policy hook.

Horovod users swap one line::

    optimizer = pdv_ext.horovod.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                     aggregation="adasum")

Like `hvd.DistributedOptimizer`, the returned object is an instance of a class created on the fly that
inherits from the user's optimizer class (so `isinstance(opt, torch.optim.Adam)` holds and LR schedulers
work); we copy our methods into it the way Horovod does and never subclass Horovod's generated class.

Two reduction paths:
- *native*: `mean` (and `op=hvd.Sum`/`Min`/`Max` without `aggregation`) uses Horovod's own per-parameter
  asynchronous allreduce started from the gradient hooks, exactly as `hvd.DistributedOptimizer` does — same
  names, same scaling, same overlap with the backward pass — so weights match Horovod's step for step.
- *aggregator*: any other aggregator runs at `synchronize()` over all gradients (sorted by parameter name,
  the same order on every rank) through a `HorovodComm`. Grad hooks (the policy Monitor) also force this
  path, since they must see the local gradients before reduction.

Gradients of any layout and precision work on both paths, where Horovod 0.28's own optimizer refuses them
before sending anything ("Tensor is required to be contiguous", "Tensor type torch.BFloat16Tensor is not
supported"): a non-contiguous gradient (a transposed or sliced parameter) is reduced as a contiguous copy
and the result copied back into it; a bfloat16 gradient is reduced in float32 and rounded once on the way
back (the native path; the aggregators get the same from `HorovodComm`); float16 is Horovod's own.
"""
from __future__ import annotations

import copy
import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional

import torch

from ..aggregation import Aggregator, bind_group, build_aggregator
from ..aggregation.faults import FaultInjector, NonFiniteGuard, loss_scale_overflow
from ..aggregation.faults_config import FaultsConfig
from ..aggregation.mean import Mean
from ..comm.horovod_comm import _REDUCE_AS, HorovodComm, _hvd
from ..policy.applier import ApplierBase

__all__ = ["DistributedOptimizer", "PolicyHook", "HorovodApplier", "resolve_aggregation", "register_elastic_handlers"]


def resolve_aggregation(aggregation: Any, op: Any, hvd) -> Any:
    """The aggregator spec for `aggregation` and Horovod's `op` (they may not contradict each other).

    Returns an Aggregator spec, or the Horovod op to reduce with natively (Sum, Min, Max, Product)."""
    if aggregation is None:
        if op is None or op == hvd.Average:
            return "mean"
        if op == hvd.Adasum:
            return "adasum"  # ours: any backend, any rank count
        return op
    if op is not None and op != hvd.Average:
        raise ValueError("pass either `aggregation` or a non-default `op` to DistributedOptimizer, not both "
                         f"(got aggregation={aggregation!r} and op={op!r})")
    if hasattr(aggregation, "aggregation") and not isinstance(aggregation, dict):  # a whole PDVConfig
        aggregation = aggregation.aggregation
    return aggregation


class _PDVDistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamically created optimizer class (see `DistributedOptimizer`)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, reduction,
                 gradient_predivide_factor, sparse_as_dense, process_set, validation_loss, faults=None,
                 loss_scaled=False):
        super(self.__class__, self).__init__(params)
        hvd = _hvd()
        self._hvd = hvd
        self._compression = compression
        self.process_set = process_set
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.validation_loss = validation_loss
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                             "model.named_parameters()")
        names = [k for k, _ in named_parameters]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {', '.join(dups)}")
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was given but some optimizer parameters are not named "
                             f"(ids {sorted(unnamed)})")
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        # the order every rank agrees on: by name
        self._ordered = [v for k, v in sorted(named_parameters, key=lambda kv: kv[0])
                         if id(v) in all_ids and v.requires_grad]
        self.backward_passes_per_step = int(backward_passes_per_step)
        #: backward passes per rank this step when the data shares are unequal (None: every rank runs
        #: `backward_passes_per_step`); set at a step boundary by `set_data_shares`
        self.data_shares: Optional[List[int]] = None
        self._equal_passes = self.backward_passes_per_step
        self._delay = {p: self.backward_passes_per_step for p in self._ordered}
        self._handles: Dict[torch.Tensor, Any] = {}
        self._synchronized = False
        self._should_synchronize = True
        self.grad_hooks: List[Any] = []
        self.comm = HorovodComm(process_set) if process_set.included() else None
        self.aggregator: Optional[Aggregator] = None
        self._native_op = None
        self.set_aggregator(reduction)
        self.global_steps = 0  # reductions so far (the step faults and the non-finite guard report)
        self.loss_scaled = bool(loss_scaled)
        self._guard = NonFiniteGuard(defer=self.loss_scaled)  # scaled gradients: overflows are the scaler's
        self.pdv_faults: Optional[FaultInjector] = None
        if faults is not None and faults.byzantine_ranks:
            # a grad hook like any other (it forces the aggregator path); label_flip is a data hook:
            # `optimizer.pdv_faults.wrap_data_iter(batches, lambda: optimizer.global_steps)`
            self.pdv_faults = FaultInjector(faults, hvd.rank())
            self.pdv_faults.check_world(hvd.size())
            self.grad_hooks.append(self.pdv_faults)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(p)) for p in self._ordered]

    # ---- aggregation ------------------------------------------------------------------------------
    @property
    def dp_comm(self) -> HorovodComm:
        """The data-parallel Comm (the same attribute name as PDVPipelineEngine's)."""
        return self.comm

    def set_aggregator(self, spec: Any) -> Aggregator:
        """Switch the aggregator; call it on every rank at the same step boundary (the PolicyRunner does)."""
        if self._handles:
            raise RuntimeError("set_aggregator() called between backward() and step()")
        hvd = self._hvd
        if isinstance(spec, int) and not isinstance(spec, bool):  # a native Horovod op
            self.aggregator, self._native_op = Mean(), spec
        else:
            self.aggregator = build_aggregator(spec)
            self._native_op = None
            if type(self.aggregator) is Mean:
                self._native_op = hvd.Average
            if self.gradient_predivide_factor != 1.0:
                if type(self.aggregator) is not Mean:
                    raise ValueError("gradient_predivide_factor applies to mean aggregation only "
                                     f"(got aggregation '{self.aggregator.name}')")
                self.aggregator.options.predivide_factor = self.gradient_predivide_factor
            if self.aggregator.needs_validation and self.validation_loss is not None \
                    and getattr(self.aggregator, "validation_fn", None) is None:
                self.aggregator.validation_fn = self.validation_gradients
            bind_group(self.aggregator, self.comm)
        return self.aggregator

    def validation_gradients(self) -> List[torch.Tensor]:
        """This rank's gradient of `validation_loss()` (torch.autograd.grad: `.grad` and the backward-pass
        count are untouched), one tensor per parameter in the aggregation order."""
        loss = self.validation_loss()
        grads = torch.autograd.grad(loss, self._ordered, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self._ordered, grads)]

    def _native(self) -> bool:
        # Horovod's Average of each rank's accumulated sum is the exact sample mean (times the mean number
        # of passes) whatever the shares, so unequal shares need no change on the native path
        return self._native_op is not None and not self.grad_hooks

    def _native_scale(self):
        """Horovod's pre/postscale factors reproducing the Mean options (Horovod adds 1/size for Average)."""
        hvd = self._hvd
        if self._native_op != hvd.Average:
            return self._native_op, 1.0, 1.0
        opt = self.aggregator.options
        if opt.prescale:
            return hvd.Sum, 1.0 / self.comm.size, 1.0
        return hvd.Average, 1.0 / opt.predivide_factor, opt.predivide_factor

    # ---- gradient hooks (Horovod's mechanics: count backward passes, start the native allreduce) ----
    def _make_hook(self, p: torch.Tensor) -> Callable:
        def hook(*_):
            if self._delay[p] <= 0:
                raise AssertionError("gradients were computed more than backward_passes_per_step times before "
                                     "step(); increase backward_passes_per_step to accumulate gradients locally")
            self._delay[p] -= 1
            if self._delay[p] == 0 and self._native():
                self._handles[p] = self._allreduce_async(p)
        return hook

    def _allreduce_async(self, p: torch.Tensor):
        if p.grad is None:  # other ranks may have a gradient for it (dynamic graphs)
            p.grad = torch.zeros_like(p)
        name = self._parameter_names[p]
        if p.grad.is_sparse and not self.sparse_as_dense:
            return self._hvd.sparse_allreduce_async(p.grad, name=name, op=self._native_op,
                                                    process_set=self.process_set), None, None
        tensor = p.grad.to_dense() if p.grad.is_sparse else p.grad
        compressed, ctx = self._compression.compress(tensor)
        # what Horovod refuses travels as a contiguous copy (bfloat16: in float32), copied back at sync
        wide = _REDUCE_AS.get(compressed.dtype)
        if wide is not None:
            work = compressed.to(wide, memory_format=torch.contiguous_format)
        else:
            work = compressed if compressed.is_contiguous() else compressed.contiguous()
        op, pre, post = self._native_scale()
        handle = self._hvd.allreduce_async_(work, name=name, op=op, prescale_factor=pre,
                                            postscale_factor=post, process_set=self.process_set)
        return handle, ctx, (compressed if work is not compressed else None)

    # ---- synchronize / step ------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the reduction of every gradient (Horovod's API: call before clipping, then
        `with optimizer.skip_synchronize(): optimizer.step()`)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        if self._native():
            self._synchronize_native()
        else:
            self._synchronize_aggregator()
        for p in self._ordered:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = True
        self.global_steps += 1

    def _synchronize_native(self) -> None:
        for p in self._ordered:
            if p not in self._handles:
                self._handles[p] = self._allreduce_async(p)
        for p, (handle, ctx, staged) in self._handles.items():
            output = self._hvd.synchronize(handle) if not callable(handle) else handle()
            if staged is not None:  # reduced as a contiguous (or float32) copy: back into the original
                output = staged.copy_(output)
            if p.grad.is_sparse:
                out = self._compression.decompress(output, ctx)
                p.grad.zero_().add_(out if out.is_sparse else out.to_sparse())
            else:
                p.grad.set_(self._compression.decompress(output, ctx))
        self._handles.clear()
        self.aggregator.step += 1

    def _synchronize_aggregator(self) -> None:
        params = self._ordered
        sparse = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                sparse.append(p)
                p.grad = p.grad.to_dense()
        packed = [self._compression.compress(p.grad) for p in params]
        grads = [t for t, _ in packed]
        if self.loss_scaled and loss_scale_overflow(self.aggregator, grads, self.comm):
            out = grads  # inf on every rank: the GradScaler skips this step and lowers its scale everywhere
        else:
            out = self._aggregate_with_hooks(grads)
        for p, o, (_, ctx) in zip(params, out, packed):
            g = self._compression.decompress(o, ctx)
            if g is not p.grad:
                p.grad.copy_(g)
        for p in sparse:
            p.grad = p.grad.to_sparse()

    def _share_normalised(self, grads: List[torch.Tensor]) -> Optional[List[int]]:
        """With unequal shares: scale this rank's accumulated gradient (a sum over its own passes, Horovod's
        convention) to the equal-split scale, `mean passes / own passes`, so that every replica hands the
        aggregator the mean over its own samples times the same factor; returns the per-rank sample
        counts for the aggregator (None with equal shares: nothing changes)."""
        if self.data_shares is None:
            return None
        mine = self.data_shares[self.comm.rank]
        factor = self._equal_passes / mine
        if factor != 1.0:
            for g in grads:
                g.mul_(factor)
        return list(self.data_shares)

    def _aggregate_with_hooks(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        samples = self._share_normalised(grads)
        for hook in self.grad_hooks:
            grads = hook.before(self, grads)
        if self.aggregator.needs_validation and getattr(self.aggregator, "validation_fn", None) is None \
                and getattr(self.aggregator, "_v", None) is None:
            raise ValueError(f"aggregator '{self.aggregator.name}' needs validation gradients: pass "
                             "validation_loss=<callable returning the loss on a trusted batch> to DistributedOptimizer")
        # NaN/Inf from any rank: filtered by the robust aggregators, a NonFiniteGradients error naming the
        # rank and step with the others (the native path leaves this to Horovod, as hvd does); with
        # loss_scaled=True an overflow is left to the GradScaler instead
        self._guard.pre(self.aggregator, grads, self.comm, self.global_steps)
        out = self.aggregator(grads, self.comm, samples=samples)
        self._guard.post(self.aggregator, out, self.comm, self.global_steps)
        for hook in self.grad_hooks:
            hook.after(self, out)
        return out

    @contextmanager
    def skip_synchronize(self):
        """`optimizer.step()` inside this context does not synchronize (after a manual `synchronize()`)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() after "
                              "optimizer.synchronize(); gradients are reduced twice")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change gradient accumulation (e.g. after a batch-size policy action), at a step boundary; the
        ranks' data shares go back to the equal split."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.data_shares = None
        self._equal_passes = int(passes)
        self._set_local_passes(int(passes))

    def _set_local_passes(self, passes: int) -> None:
        self.backward_passes_per_step = int(passes)
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def set_data_shares(self, shares: Optional[List[int]]) -> None:
        """Backward passes (micro-batches) of each rank this step, adding up to size x the equal split's
        passes (the global batch is unchanged); None or equal = the equal split. Call on every rank at the
        same step boundary (the PolicyRunner does, for a SetDataShares action). Each backward pass adds the
        gradient of one micro-batch's mean loss (Horovod's convention: do not divide the loss by the passes);
        the reduction then gives the exact mean over every sample of the step, as with equal shares."""
        from ..policy.shares import check_shares

        size = self.comm.size if self.comm is not None else 1
        if shares is not None:
            shares = check_shares(shares, size, self._equal_passes * size, what="data shares")
            if len(set(shares)) == 1:
                shares = None
        self.data_shares = shares
        self._set_local_passes(self._equal_passes if shares is None else shares[self.comm.rank])

    # ---- state: what elastic commits and checkpoints carry -------------------------------------------
    def pdv_state_dict(self) -> Dict[str, Any]:
        """Aggregator (type, options, state: error feedback, RNG, step) and accumulation settings."""
        agg = self.aggregator
        return {"aggregator": {"type": agg.name, **agg.options.model_dump()}, "native_op": self._native_op,
                "aggregator_state": agg.state_dict(), "backward_passes_per_step": self._equal_passes,
                "data_shares": self.data_shares, "global_steps": self.global_steps}

    def load_pdv_state_dict(self, state: Dict[str, Any]) -> None:
        native = state.get("native_op")
        spec = native if native is not None and native != self._hvd.Average else dict(state["aggregator"])
        current = {"type": self.aggregator.name, **self.aggregator.options.model_dump()}
        if native != self._native_op or current != state["aggregator"]:
            self.set_aggregator(spec)
        # tensors onto this rank's device: state pickled on rank 0's GPU unpickles onto that GPU's index
        dev = next((p.device for p in self._ordered), None)
        self.aggregator.load_state_dict(_on_device(copy.deepcopy(state["aggregator_state"]), dev))
        self.set_backward_passes_per_step(state.get("backward_passes_per_step", self._equal_passes))
        shares = state.get("data_shares")
        if shares is not None and self.comm is not None and len(shares) == self.comm.size:
            self.set_data_shares(shares)  # (an elastic world of another size starts from the equal split)
        self.global_steps = int(state.get("global_steps", self.global_steps))

    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        sd["pdv"] = self.pdv_state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        pdv = state_dict.pop("pdv", None)
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        super(self.__class__, self).load_state_dict(state_dict)
        if pdv is not None:
            self.load_pdv_state_dict(pdv)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, op=None, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False, process_set=None,
                         aggregation: Any = None, validation_loss: Optional[Callable[[], torch.Tensor]] = None,
                         faults: Any = None, loss_scaled: bool = False):
    """`hvd.DistributedOptimizer` plus `aggregation` (a registered aggregator name, a `{"type": ...,
    **options}` dict, an Aggregator, or a PDVConfig/`pdv.aggregation` section).

    `op=hvd.Adasum` without `aggregation` selects our `adasum` (any backend and rank count); `op=hvd.Sum`
    etc. reduce natively. `num_groups`/`groups` are accepted for compatibility; they only change how
    Horovod fuses messages, not the result, and the native path leaves fusion to Horovod's tensor fusion.
    `validation_loss()` returns the loss on a trusted validation batch, for aggregators that score
    candidates against a validation gradient (zeno; refreshed every `refresh_every` steps).
    `faults` (a `pdv.faults` dict or FaultsConfig; taken from a whole PDVConfig passed as `aggregation`)
    makes the listed global ranks Byzantine, as under DeepSpeed (`optimizer.pdv_faults`).
    `loss_scaled=True` for gradients scaled by torch AMP's `GradScaler` (fp16): an overflow on any rank is
    not an error but reaches every rank as inf, so the scaler skips the step and lowers its scale on all
    of them (`faults.loss_scale_overflow`); the aggregators that would filter it never see it.
    """
    hvd = _hvd()
    if not hvd.is_initialized():
        raise RuntimeError("call hvd.init() before pdv_ext.horovod.DistributedOptimizer")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    compression = compression if compression is not None else hvd.Compression.none
    process_set = process_set if process_set is not None else hvd.global_process_set
    if faults is None and hasattr(aggregation, "faults") and not isinstance(aggregation, dict):  # a PDVConfig
        faults = aggregation.faults
    if faults is not None and not isinstance(faults, FaultsConfig):
        faults = FaultsConfig.model_validate(faults)
    reduction = resolve_aggregation(aggregation, op, hvd)
    if num_groups:
        warnings.warn("num_groups is deprecated in Horovod; use groups", DeprecationWarning)
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of lists of torch.Tensor")
    namespace = dict(_PDVDistributedOptimizer.__dict__)
    # hvd.broadcast_optimizer_state initialises empty optimizer state by calling the *base* class's
    # step() when the optimizer's module is Horovod's (a wrapper whose step() is collective); ours is such
    # a wrapper too, so it gets the same treatment instead of running the aggregator on zero gradients.
    namespace["__module__"] = "horovod.torch.optimizer"
    namespace["_pdv_distributed"] = True
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), namespace)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, reduction,
               gradient_predivide_factor, sparse_as_dense, process_set, validation_loss, faults, loss_scaled)


# ---- elastic: the pdv part of the optimizer state is broadcast from rank 0 on sync ------------------------
class _PDVOptimizerMeta(type):
    def __instancecheck__(cls, obj):
        return bool(getattr(obj, "_pdv_distributed", False))


class PDVOptimizerType(metaclass=_PDVOptimizerMeta):
    """Matches any optimizer returned by our `DistributedOptimizer` (for Horovod's handler registry)."""


_REGISTERED = False


def register_elastic_handlers(extra=()) -> None:
    """Teach `hvd.elastic.TorchState` our objects: the optimizer's pdv state (aggregator type, options,
    error feedback, RNG, step) follows commit/restore with the optimizer and is taken from rank 0 on sync
    (a new worker must agree with the others on step and RNG); `extra` adds (type, handler) pairs."""
    global _REGISTERED
    from horovod.torch.elastic import state as hstate
    from horovod.torch.functions import broadcast_object

    class PDVOptimizerStateHandler(hstate.OptimizerStateHandler):
        def sync(self):
            super().sync()
            self.value.load_pdv_state_dict(broadcast_object(self.value.pdv_state_dict(), root_rank=0,
                                                            name="pdv.elastic.optimizer"))

    registry = list(hstate.get_handler_registry())
    types = {t for t, _ in registry}
    new = [(t, h) for t, h in extra if t not in types]
    if not _REGISTERED:
        new.append((PDVOptimizerType, PDVOptimizerStateHandler))
        _REGISTERED = True
    if new:
        hstate.set_handler_registry(new + registry)


if os.environ.get("PDV_NO_ELASTIC_HANDLERS") != "1":
    try:
        register_elastic_handlers()
    except ImportError:  # pragma: no cover - Horovod without elastic support
        pass


# ---- policies: the same Monitor and PolicyRunner as in the DeepSpeed engine --------------------------
class HorovodApplier(ApplierBase):
    """Applies PolicyRunner actions to a Horovod training loop (every rank, at a step boundary).

    Micro-batches per step are the optimizer's `backward_passes_per_step` (the loop must read it each
    step, e.g. through `PolicyHook.micro_batches`); a new micro-batch size goes to the data iterator
    (`set_micro_batch_size`, e.g. pdv_ext.policy.data.ElasticBatches) and to `PolicyHook.micro_batch_size`.
    """

    num_stages = 1

    def __init__(self, hook: "PolicyHook"):
        self.hook = hook

    @property
    def optimizer(self) -> Any:
        return self.hook.optimizer

    @property
    def aggregator(self) -> Any:
        return self.hook.optimizer.aggregator

    @property
    def data_iterator(self) -> Any:
        return self.hook.data

    def batch_geometry(self):
        """(micro-batch size, passes per rank of the equal split, ranks): with unequal data shares the
        middle one is the step's passes over the ranks."""
        h = self.hook
        return int(h.micro_batch_size), int(h.optimizer._equal_passes), int(h.comm.size)

    def data_shares(self) -> Optional[List[int]]:
        shares = self.hook.optimizer.data_shares
        return None if shares is None else list(shares)

    def set_data_shares(self, shares) -> None:
        """Backward passes per rank (the optimizer's accumulation, the data iterator's slices, the Monitor)."""
        h = self.hook
        h.optimizer.set_data_shares(shares)
        self.iterator_follows_shares(h.optimizer.data_shares)
        h.monitor.shares = h.optimizer.data_shares

    def set_batch_size(self, micro_batches: int, micro_batch_size: int) -> None:
        h = self.hook
        if h.optimizer.data_shares is not None:  # a new global batch starts from the equal split
            self.set_data_shares(None)
        if micro_batch_size != h.micro_batch_size:
            self.iterator_follows_micro_batch_size(micro_batch_size)
            h.micro_batch_size = int(micro_batch_size)
        h.optimizer.set_backward_passes_per_step(micro_batches)

    def set_aggregator(self, spec: Any) -> None:
        self.hook.optimizer.set_aggregator(spec)


def _on_device(obj: Any, device: Optional[torch.device]) -> Any:
    """`obj` with every tensor in it (nested dicts, lists, tuples) moved to `device` (None: unchanged)."""
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _on_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_device(v, device) for v in obj)
    return obj


def _sync_cuda_if_used() -> None:
    """The Monitor's end-of-step wait on GPU ranks (nothing where CUDA was never used)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _MonitorTap:
    """Grad hook on the optimizer: compute time up to the reduction, |g|² before and after it."""

    def __init__(self, hook: "PolicyHook"):
        self.hook = hook

    def before(self, optimizer: Any, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        import time

        h = self.hook
        if h._ev0 is not None and grads and grads[0].is_cuda:  # device time: the host only queued the work
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            h.monitor.add_compute_span(h._ev0, end)
        else:
            h.monitor.add_compute(time.perf_counter() - h._t0)
        h.monitor.add_local_grads(grads)
        return grads

    def after(self, optimizer: Any, grads: List[torch.Tensor]) -> None:
        self.hook.monitor.add_aggregated_grads(grads)


class PolicyHook:
    """Runs the Monitor and the PolicyRunner (built-in and plugin policies, unchanged) in a Horovod loop.

        hook = PolicyHook(optimizer, config="horovod.yaml", micro_batch_size=32, data=batches)
        for step in range(steps):
            for _ in range(hook.micro_batches):        # policies may change it
                x, y = next(batches); loss = F.cross_entropy(model(x), y); loss.backward()
            optimizer.step(); optimizer.zero_grad()
            hook.after_step(loss.item())              # collective: every rank, every step

    `config` is a PolicyConfig, a PDVConfig, a dict or a file holding the pdv section (or None: monitor
    only). Under `hvd.elastic.run` pass the hook to `TorchState(..., policy=hook)`: its state (policies,
    monitor, batch geometry, data position) is committed, restored, and taken from rank 0 on sync.
    """

    def __init__(self, optimizer: Any, config: Any = None, micro_batch_size: int = 1, data: Any = None,
                 comm: Optional[HorovodComm] = None):
        from ..policy.base import build_policy
        from ..policy.config import PolicyConfig
        from ..policy.metrics import Monitor
        from ..policy.runner import PolicyRunner

        if not getattr(optimizer, "_pdv_distributed", False):
            raise TypeError("PolicyHook needs an optimizer from pdv_ext.horovod.DistributedOptimizer")
        cfg = config
        if cfg is None:
            cfg = PolicyConfig()
        elif not isinstance(cfg, PolicyConfig):
            if hasattr(cfg, "policy") and not isinstance(cfg, dict):
                cfg = cfg.policy
            else:
                from ..config import load_pdv

                cfg = load_pdv(cfg).policy
        self.cfg: PolicyConfig = cfg
        self.optimizer = optimizer
        self.comm = comm or optimizer.comm
        self.micro_batch_size = int(micro_batch_size)
        self.data = data
        self.step = 0
        self.monitor = Monitor(self.comm, self.comm.size, cfg.monitor, sync=_sync_cuda_if_used)
        self.applier = HorovodApplier(self)
        policies = [build_policy(p) for p in cfg.plugins]
        self.runner = (PolicyRunner(policies, self.comm, self.applier, cfg.on_error, cfg.every, cfg.lr_scaling)
                       if policies else None)
        self.last_metrics: Dict[str, Any] = {}
        optimizer.grad_hooks.append(_MonitorTap(self))
        self._begun = False
        self._t0 = 0.0
        self._ev0: Optional[Any] = None  # a CUDA timing event at the step's start, once CUDA is in use
        self._restart_clock()

    @property
    def micro_batches(self) -> int:
        """This rank's backward passes this step (gradient accumulation: SetBatchSize changes it for every
        rank, SetDataShares per rank)."""
        return int(self.optimizer.backward_passes_per_step)

    def _restart_clock(self) -> None:
        import time

        self._t0 = time.perf_counter()
        self._ev0 = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev0.record()
        self.monitor.begin_step()

    def on_train_begin(self) -> None:
        """Policies' `on_train_begin` (called by the first `after_step` if you do not call it)."""
        self._begun = True
        if self.runner is not None:
            self.runner.on_train_begin(self.step)

    def after_step(self, loss: Any = None) -> Dict[str, Any]:
        """Collective: gather the step's metrics, run the policies, apply their actions on every rank.
        Returns the step's metrics (identical on all ranks)."""
        if not self._begun:
            self.on_train_begin()
        self.monitor.dp_size = self.comm.size  # elastic: the world may have changed
        mbs, mb, _ = self.applier.batch_geometry()
        lrs = self.applier.get_lr()
        loss = float(loss) if loss is not None else None
        m = self.monitor.end_step(self.step, loss, lrs[0] if lrs else None, mbs, mb,
                                  getattr(self.optimizer.aggregator, "report", None))
        if self.runner is not None:
            m["actions"] = [a.to_dict() for a in self.runner.after_step(m)]
        self.step += 1
        self.last_metrics = m
        self._restart_clock()
        return m

    def close(self) -> None:
        self.monitor.close()

    # ---- state (elastic commits, checkpoints) -------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "monitor": self.monitor.state_dict(),
                "runner": self.runner.state_dict() if self.runner is not None else None,
                "micro_batch_size": self.micro_batch_size, "micro_batches": int(self.optimizer._equal_passes),
                "data_shares": self.optimizer.data_shares,
                "data": self.data.state_dict() if hasattr(self.data, "state_dict") else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.monitor.load_state_dict(state["monitor"])
        if self.runner is not None and state.get("runner") is not None:
            self.runner.load_state_dict(state["runner"])
        self.micro_batch_size = int(state["micro_batch_size"])
        self.optimizer.set_backward_passes_per_step(int(state["micro_batches"]))
        shares = state.get("data_shares")
        if shares is not None and len(shares) == self.comm.size:  # an elastic world of another size: equal
            self.optimizer.set_data_shares(shares)
        self.monitor.shares = self.optimizer.data_shares
        if state.get("data") is not None and hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(state["data"])
        self._begun = False  # policies see on_train_begin again, after their state is restored
        self._restart_clock()

    def on_reset(self) -> None:
        """After an elastic reset: the data iterator follows the new rank and world size."""
        if self.data is not None and hasattr(self.data, "dp_size"):
            self.data.set_micro_batch_size(self.micro_batch_size)  # re-base at the committed position
            self.data.dp_rank, self.data.dp_size = self.comm.rank, self.comm.size
            if hasattr(self.data, "set_shares"):
                self.data.set_shares(self.optimizer.data_shares)


def _register_policy_handler() -> None:
    from horovod.torch.elastic import state as hstate
    from horovod.torch.functions import broadcast_object

    class PolicyHookStateHandler(hstate.StateHandler):
        def __init__(self, value):
            super().__init__(value)
            self.save()

        def save(self):
            self._saved = copy.deepcopy(self.value.state_dict())

        def restore(self):
            self.value.load_state_dict(copy.deepcopy(self._saved))

        def sync(self):
            state = broadcast_object(self.value.state_dict(), root_rank=0, name="pdv.elastic.policy")
            self.value.load_state_dict(state)
            self.value.on_reset()

    register_elastic_handlers([(PolicyHook, PolicyHookStateHandler)])


if os.environ.get("PDV_NO_ELASTIC_HANDLERS") != "1":
    try:
        _register_policy_handler()
    except ImportError:  # pragma: no cover
        pass
