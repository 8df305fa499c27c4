"""A live DeepSpeed engine's training state cut into whole parameters by name, and written back.

The plan-independent value is pdv_ext.placement.layer_state.ParamState; this module fills it from a
DeepSpeed engine and writes it back (see that module's docstring for what is cut where):

- torch optimizers on the module's parameters (fp32; `torch_adam: true`): their per-parameter state;
- BF16_Optimizer (bf16) and DeepSpeedZeroOptimizer (ZeRO-1): the fp32 master copies and the optimizer state
  live in one flat partition per parameter group and data-parallel rank; each rank's fragments are gathered
  over the stage's data-parallel group, bit for bit (an integer sum of zero-filled buffers: a float sum
  would turn -0.0 into +0.0);
- FP16_Optimizer (fp16 without ZeRO): one whole flat fp32 copy per group, cut at the parameters.

Where DeepSpeed keeps those (its private fragment maps) is internals.optimizer_layout's business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import TiedLayerSpec

from ...placement.layer_state import ParamState, copy_value, local_names
from . import internals
from .validation import reduction_params

_copy = copy_value


# ---------------------------------------------------------------------------------------------------
# Names and layers
# ---------------------------------------------------------------------------------------------------
def layers_of(module: Any, name: str) -> List[int]:
    """Global layer indices a parameter or buffer name belongs to (several for a tied module)."""
    parts = name.split(".")
    if parts[0].isdigit():
        return [int(parts[0])]
    if parts[0] == "tied_modules" and len(parts) > 1:
        found = [i for i, s in enumerate(internals.layer_specs(module)) if isinstance(s, TiedLayerSpec) and s.key == parts[1]]
        if found:
            return found
    raise ValueError(f"'{name}' is not a pipeline layer's parameter (DeepSpeed names them '<layer>.<...>' or "
                     "'tied_modules.<key>.<...>'): a plan cannot place it")


# ---------------------------------------------------------------------------------------------------
# Optimizer layouts
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Fragment:
    index: int  # position of the parameter in its group
    param_start: int  # first element of the fragment in the flattened parameter
    flat_start: int  # first element of the fragment in the group's flat (partition) tensor
    numel: int


def _int_view(buf: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers: summing zero-filled buffers then reproduces every bit (-0.0, NaN)."""
    return buf.view({8: torch.int64, 4: torch.int32}.get(buf.element_size(), torch.uint8))


class _Layout:
    """How an optimizer keeps per-parameter state: `collect` (may be collective over the stage's
    data-parallel group) and `apply` (local)."""

    def collect(self, names: Dict[int, str], copy: bool = True) -> Dict[str, ParamState]:
        """`copy=False`: the live tensors where no gather makes new ones (for a caller that copies them at
        once, as a snapshot does into its keeper's buffer: one copy of the state on the step's path, not two)."""
        raise NotImplementedError

    def apply(self, states: Dict[str, ParamState], names: Dict[int, str], keep_optimizer: bool = False) -> None:
        """Write `states` (local). `keep_optimizer`: fp32 masters only (from the weights where a state has no
        master), the optimizer state as it is."""
        raise NotImplementedError


class PerParameterLayout(_Layout):
    """A torch optimizer stepping the module's own parameters (fp32 without ZeRO): state per parameter."""

    def __init__(self, optimizer: Optional[torch.optim.Optimizer]):
        self.opt = optimizer

    def collect(self, names: Dict[int, str], copy: bool = True) -> Dict[str, ParamState]:
        out: Dict[str, ParamState] = {}
        if self.opt is None:
            return out
        for i, g in enumerate(self.opt.param_groups):
            for p in g["params"]:
                st = self.opt.state.get(p, {})
                out[names[id(p)]] = ParamState(weight=_held(p, copy), group=i,
                                               optim={k: _held(v, copy) for k, v in st.items()})
        return out

    def apply(self, states: Dict[str, ParamState], names: Dict[int, str], keep_optimizer: bool = False) -> None:
        if self.opt is None or keep_optimizer:
            return
        for g in self.opt.param_groups:
            for p in g["params"]:
                s = states[names[id(p)]]
                if s.optim:
                    self.opt.state[p] = {k: (v.detach().to(p.device if v.dim() else v.device).clone()
                                             if torch.is_tensor(v) else v) for k, v in s.optim.items()}
                else:
                    self.opt.state.pop(p, None)


class FlatLayout(_Layout):
    """An optimizer that steps one flat fp32 tensor per parameter group: the whole group (FP16_Optimizer)
    or this data-parallel rank's partition of it (BF16_Optimizer, ZeRO-1). `fragments[i]` says which
    pieces of which parameters the flat tensor of group i holds; `complete(buf)` fills in the pieces
    other ranks hold (an integer all-reduce over the data-parallel group, or nothing)."""

    def __init__(self, wrapper: Any, lp_groups: Sequence[Sequence[torch.Tensor]], flats: Sequence[torch.Tensor],
                 fragments: Sequence[Sequence[_Fragment]], complete: Optional[Callable[[torch.Tensor], None]] = None,
                 agree: Optional[Callable[[Any], List[Any]]] = None):
        self.wrapper = wrapper
        self.base = getattr(wrapper, "optimizer", wrapper)
        self.lp_groups, self.flats, self.fragments = [list(g) for g in lp_groups], list(flats), fragments
        self.complete = complete or (lambda buf: None)
        self.agree = agree or (lambda x: [x])

    @staticmethod
    def _offsets(params: Sequence[torch.Tensor]) -> List[int]:
        out, o = [], 0
        for p in params:
            out.append(o)
            o += p.numel()
        return out + [o]

    def _state_keys(self) -> List[List[str]]:
        keys = [sorted(k for k, v in self.base.state.get(flat, {}).items()
                       if torch.is_tensor(v) and v.shape == flat.shape) for flat in self.flats]
        seen = self.agree(keys)
        if any(k != keys for k in seen):  # every rank of the group must reduce the same buffers
            raise RuntimeError(f"optimizer state differs between data-parallel ranks: {seen}")
        return keys

    def collect(self, names: Dict[int, str], copy: bool = True) -> Dict[str, ParamState]:
        out: Dict[str, ParamState] = {}
        for i, (params, flat, keys) in enumerate(zip(self.lp_groups, self.flats, self._state_keys())):
            st = self.base.state.get(flat, {})
            off = self._offsets(params)
            whole: Dict[str, torch.Tensor] = {}
            for key, src in [("master", flat)] + [(k, st[k]) for k in keys]:
                buf = torch.zeros(off[-1], dtype=src.dtype, device=src.device)
                for fr in self.fragments[i]:
                    buf.narrow(0, off[fr.index] + fr.param_start, fr.numel).copy_(
                        src.detach().narrow(0, fr.flat_start, fr.numel))
                self.complete(buf)
                whole[key] = buf
            scalars = {k: _copy(v) for k, v in st.items() if k not in keys}
            for j, p in enumerate(params):
                # (the whole buffers are this call's own: a view of one is a copy of the state already)
                cut = lambda b: _held(b.narrow(0, off[j], p.numel()).view(p.shape), copy)  # noqa: E731
                out[names[id(p)]] = ParamState(weight=_held(p, copy), master=cut(whole["master"]), group=i,
                                               optim={**{k: cut(whole[k]) for k in keys}, **scalars})
        return out

    def apply(self, states: Dict[str, ParamState], names: Dict[int, str], keep_optimizer: bool = False) -> None:
        for i, (params, flat) in enumerate(zip(self.lp_groups, self.flats)):
            incoming = [states[names[id(p)]] for p in params]
            if not keep_optimizer:
                self._apply_optimizer(i, params, flat, incoming)
            with torch.no_grad():
                for fr in self.fragments[i]:
                    s = incoming[fr.index]
                    master = s.master if s.master is not None else s.weight
                    flat.narrow(0, fr.flat_start, fr.numel).copy_(master.reshape(-1).narrow(0, fr.param_start, fr.numel))
        internals.relink_optimizer_state(self.wrapper)

    def _apply_optimizer(self, i: int, params: List[torch.Tensor], flat: torch.Tensor,
                         incoming: List[ParamState]) -> None:
        optim = [s.optim for s in incoming if s.optim]
        if optim and len(optim) != len(incoming):
            raise ValueError(f"parameter group {i}: some parameters have optimizer state and some have none")
        if not optim:  # never stepped: the optimizer initialises its state at the first step
            self.base.state.pop(flat, None)
            return
        tensor_keys = [k for k, v in optim[0].items() if torch.is_tensor(v) and v.numel() == params[0].numel()
                       and v.dim() > 0]
        scalars = {k: v for k, v in optim[0].items() if k not in tensor_keys}
        for o in optim:
            for k, v in scalars.items():
                w = o.get(k)
                same = (torch.equal(w, v) if torch.is_tensor(v) and torch.is_tensor(w) else w == v)
                if not same:
                    raise ValueError(f"parameter group {i}: '{k}' differs between its parameters ({v} vs "
                                     f"{w}): one flat optimizer state cannot hold both")
        st = self.base.state.setdefault(flat, {})
        for k in tensor_keys:
            dtype = optim[0][k].dtype
            if not (torch.is_tensor(st.get(k)) and st[k].shape == flat.shape and st[k].dtype == dtype):
                st[k] = torch.zeros(flat.shape, dtype=dtype, device=flat.device)
            for fr in self.fragments[i]:
                st[k].narrow(0, fr.flat_start, fr.numel).copy_(
                    optim[fr.index][k].reshape(-1).narrow(0, fr.param_start, fr.numel))
        for k, v in scalars.items():
            st[k] = _copy(v)


def _whole_fragments(lp_groups: Sequence[Sequence[torch.Tensor]]) -> List[List[_Fragment]]:
    """Every parameter whole, back to back (FP16_Optimizer's `_flatten_dense_tensors`)."""
    out = []
    for params in lp_groups:
        frs, o = [], 0
        for j, p in enumerate(params):
            frs.append(_Fragment(j, 0, o, p.numel()))
            o += p.numel()
        out.append(frs)
    return out


def _dp_completion(group: Any) -> Tuple[Callable[[torch.Tensor], None], Callable[[Any], List[Any]]]:
    size = dist.get_world_size(group=group) if group is not None else 1

    def complete(buf: torch.Tensor) -> None:
        if size > 1:
            dist.all_reduce(_int_view(buf), group=group)

    def agree(obj: Any) -> List[Any]:
        if size == 1:
            return [obj]
        seen: List[Any] = [None] * size
        dist.all_gather_object(seen, obj, group=group)
        return seen

    return complete, agree


def layout_of(engine: Any) -> _Layout:
    """The layout of `engine.optimizer` (a DeepSpeed engine's optimizer or wrapper)."""
    opt = engine.optimizer
    found = internals.optimizer_layout(opt)
    if found is None:
        return PerParameterLayout(opt)
    if found["fragments"] is None:  # every parameter whole, back to back (FP16_Optimizer)
        return FlatLayout(opt, found["lp_groups"], found["flats"], _whole_fragments(found["lp_groups"]))
    complete, agree = _dp_completion(found["dp_group"])
    return FlatLayout(opt, found["lp_groups"], found["flats"],
                      [[_Fragment(*f) for f in frs] for frs in found["fragments"]], complete, agree)


def collect_is_collective(engine: Any) -> bool:
    """Whether `collect_params` is a collective over the stage's replicas (BF16_Optimizer, ZeRO-1: each holds
    a part of the fp32 masters and the optimizer state), so that every replica must call it."""
    found = internals.optimizer_layout(engine.optimizer)
    if found is None or found["fragments"] is None or found["dp_group"] is None:
        return False
    return dist.get_world_size(group=found["dp_group"]) > 1


# ---------------------------------------------------------------------------------------------------
# Parameters: collect (full tensors) and apply (local fragments)
# ---------------------------------------------------------------------------------------------------
def collect_params(engine: Any, layout: Optional[_Layout] = None, copy: bool = True) -> Dict[str, ParamState]:
    """This stage's parameters and buffers, whole, by name (collective over the stage's data-parallel
    group under BF16_Optimizer and ZeRO-1). `copy=False`: live tensors where they are whole already
    (`_Layout.collect`)."""
    module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}
    out = (layout or layout_of(engine)).collect(names, copy)
    for n, p in module.named_parameters():
        if n not in out:  # frozen: not in any optimizer group
            out[n] = ParamState(weight=_held(p, copy))
    for n, b in module.named_buffers():
        out[n] = ParamState(weight=_held(b, copy), is_buffer=True)
    return out


def _held(v: Any, copy: bool) -> Any:
    """A tensor detached (and cloned where `copy`), anything else copied (`copy_value`)."""
    if torch.is_tensor(v):
        return v.detach().clone() if copy else v.detach()
    return _copy(v)


def apply_params(engine: Any, states: Dict[str, ParamState], layout: Optional[_Layout] = None,
                 keep_optimizer: bool = False) -> None:
    """Write whole-parameter states into this stage (weights, master copies and optimizer state of the
    fragments this rank owns; local). Every parameter and buffer of the stage must be in `states`."""
    module = engine.module
    have = local_names(module)
    missing = sorted(set(have) - set(states))
    if missing:
        more = ", ..." if len(missing) > 4 else ""
        raise KeyError(f"no state for {', '.join(missing[:4])}{more}")
    with torch.no_grad():
        for n, t in have.items():
            s = states[n]
            src = s.weight if (s.weight.dtype == t.dtype or s.master is None) else s.master
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(f"'{n}': saved shape {tuple(src.shape)}, the model's {tuple(t.shape)}")
            t.copy_(src)
    names = {id(p): n for n, p in module.named_parameters()}
    (layout or layout_of(engine)).apply(states, names, keep_optimizer)


# ---------------------------------------------------------------------------------------------------
# What no plan changes
# ---------------------------------------------------------------------------------------------------
_SCALERS = ("loss_scaler", "loss_scale_config")  # ZeRO / FP16_Optimizer (0.19: LossScaleConfig)
#: FP16_Optimizer before DeepSpeed 0.19 keeps its dynamic scale on itself
_OWN_SCALE = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_loss_scale",
              "dynamic_loss_scale", "cur_hysteresis")


def scaler_state(optimizer: Any) -> Optional[Dict[str, Any]]:
    """The loss scaler's plain values (scale, iteration counters, hysteresis), or None without one."""
    for attr in _SCALERS:
        obj = getattr(optimizer, attr, None)
        if obj is not None:
            values = {k: _copy(v) for k, v in vars(obj).items()
                      if torch.is_tensor(v) or isinstance(v, (bool, int, float, str, type(None)))}
            return {"attr": attr, "type": type(obj).__name__, "values": values}
    if hasattr(optimizer, "cur_scale"):  # the scale on the optimizer itself (FP16_Optimizer, DeepSpeed < 0.19)
        values = {k: _copy(getattr(optimizer, k)) for k in _OWN_SCALE if hasattr(optimizer, k)}
        return {"attr": None, "type": type(optimizer).__name__, "values": values}
    return None


def apply_scaler_state(optimizer: Any, state: Optional[Dict[str, Any]]) -> None:
    """Restore `scaler_state` into `optimizer`'s scaler (same kind: fp16 dynamic loss scaling)."""
    if not state:
        return
    obj = optimizer if state["attr"] is None else getattr(optimizer, state["attr"], None)
    if obj is None:
        return  # the new run has no loss scaler (bf16 or fp32): nothing to restore
    for k, v in state["values"].items():
        if hasattr(obj, k):
            cur = getattr(obj, k)
            setattr(obj, k, cur.copy_(v) if torch.is_tensor(cur) and torch.is_tensor(v) else _copy(v))


def global_state(engine: Any) -> Dict[str, Any]:
    """Training state identical on every rank and independent of the plan."""
    opt = engine.optimizer
    sched = engine.lr_scheduler
    return {
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "skipped_steps": int(engine.skipped_steps),
        "micro_steps": int(engine.micro_steps),
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "param_groups": ([{k: _copy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
                         if opt is not None else []),
        "loss_scaler": scaler_state(opt) if opt is not None else None,
        "train_batch_size": int(engine.train_batch_size()),
        "micro_batch_size": int(engine.train_micro_batch_size_per_gpu()),
    }


def apply_global_state(engine: Any, g: Dict[str, Any]) -> None:
    opt = engine.optimizer
    if opt is not None:
        if len(g["param_groups"]) != len(opt.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(g['param_groups'])} parameter groups, this one "
                             f"{len(opt.param_groups)}: build the optimizer from the same parameter groups")
        for group, saved in zip(opt.param_groups, g["param_groups"]):
            group.update({k: _copy(v) for k, v in saved.items()})
        apply_scaler_state(opt, g.get("loss_scaler"))
    if g.get("lr_scheduler") is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(g["lr_scheduler"])
    engine.global_steps = g["global_steps"]
    engine.global_samples = g["global_samples"]
    engine.skipped_steps = g["skipped_steps"]
    engine.micro_steps = g["micro_steps"]


# ---------------------------------------------------------------------------------------------------
# Aggregator state, per parameter
# ---------------------------------------------------------------------------------------------------
def reduction_names(engine: Any) -> List[Tuple[str, int]]:
    """(name, numel) of the gradients the engine aggregates, in the aggregator's order (its flat state
    follows this order: PDVPipelineEngine.reduction_grads)."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    mode = getattr(engine, "reduce_mode", "engine")
    opt = engine.optimizer
    if mode == "bf16":
        params = internals.bf16_parameters(opt)
    elif mode == "zero":
        params = internals.zero_parameters(opt)
    else:
        params = reduction_params(engine)  # the engine-mode order, in one place
    return [(names[id(p)], p.numel()) for p in params]


def split_aggregator_state(engine: Any) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Optional[torch.Tensor]]]]:
    """(the aggregator's state without its per-parameter entries, those entries cut per parameter name)."""
    agg = engine.aggregator
    state = dict(agg.state_dict())
    keys = tuple(getattr(agg, "per_parameter_state", ()))
    order = reduction_names(engine)
    total = sum(n for _, n in order)
    per: Dict[str, Dict[str, Optional[torch.Tensor]]] = {name: {} for name, _ in order}
    for key in keys:
        flat = state.pop(key, None)
        if flat is not None and flat.numel() != total:
            raise ValueError(f"aggregator '{agg.name}': state '{key}' has {flat.numel()} elements, the gradients "
                             f"{total}")
        o = 0
        for name, n in order:
            per[name][key] = None if flat is None else flat.reshape(-1).narrow(0, o, n).detach().clone()
            o += n
    return state, per


def join_aggregator_state(engine: Any, state: Dict[str, Any],
                          per: Dict[str, Dict[str, Optional[torch.Tensor]]]) -> Dict[str, Any]:
    """The aggregator state for this engine's reduction order from `split_aggregator_state`'s parts: a
    parameter without an entry (a replica that did not exist before) starts from zeros."""
    agg = engine.aggregator
    out = dict(state)
    order = reduction_names(engine)
    for key in getattr(agg, "per_parameter_state", ()):
        pieces = [per.get(name, {}).get(key) for name, _ in order]
        known = [t for t in pieces if t is not None]
        if not known:
            out[key] = None
            continue
        out[key] = torch.cat([t.reshape(-1) if t is not None else known[0].new_zeros(n)
                              for t, (_, n) in zip(pieces, order)])
    return out
