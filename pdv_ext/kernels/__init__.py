"""The aggregators' local math: one API, an implementation per device behind it (docs/kernels.md).

Which implementation answers is decided per call by the tensors:
- CPU float32/float64 (one dtype per call): fused C++ kernels (`cpu`, `csrc/pdv_kernels.cpp`, JIT-built on
  first use);
- CUDA float32/float16/bfloat16/float64 (one dtype per call): Triton kernels (`triton_gpu`), one launch or a
  few per call over the whole tensor list and no host synchronisation;
- anything else (other devices or dtypes, mixed dtypes in one list, no compiler, no Triton): the torch
  reference (`reference`), which is also sync-free and keeps results on the inputs' device.
PDV_KERNELS=torch forces the reference everywhere; PDV_KERNELS=triton sends every supported dtype to Triton
whatever the device (with TRITON_INTERPRET=1 that runs the GPU kernels on CPU tensors: the tests).
PDV_TOPK_SELECT=torch|radix picks how Triton's top-k finds its threshold (a Triton radix select, the
default, or torch.topk; docs/kernels.md).

API (stable; aggregators call only these):
- `adasum_dots(a, b) -> (a·b, |a|², |b|²)` per tensor pair, products and sums in float64: three float64
  tensors of len(a), on the inputs' device
- `adasum_combine(a, b, ca, cb, out=None) -> list`: out_i = ca_i * a_i + cb_i * b_i (computed in float64,
  rounded to the dtype); `ca`/`cb` are float64 tensors of len(a) on any device (read without a host round
  trip); with `out` (which may be `a` or `b`) the results are written there and `out` is returned
- `adasum_pair(a, b) -> AdasumPair` with `.dots()` and `.combine(ca, cb, out=None)`: the two calls above on
  one pair of lists, the lists checked once (an Adasum level; the tensors keep their layout between them)
- `topk_error_feedback(update, residual, k) -> (indices, values)`: selects the k largest |update + residual|
  entries (flattened), returns them and leaves residual = (update + residual) with those entries zeroed.
  Indices are int64 in ascending order; NaN ranks above +inf; ties at the k-th value go to the lower index.
- `coordinate_median(stack) -> tensor`: median over dim 0 of an (m, ...) tensor (mean of the two middle
  values for even m, in the dtype); NaN sorts above +inf (as torch.sort), so NaNs from fewer than half the
  rows never win
- `trimmed_mean(stack, trim) -> tensor`: mean over dim 0 after dropping the `trim` largest and smallest per
  coordinate (same order as the median; the kept values are summed in ascending order in float64)

Every function takes any layout (strided views, zero-size tensors, a mix; results equal those of contiguous
copies, and a strided `out` is written into) and empty lists; mismatched lengths, sizes, dtypes or devices
raise ValueError naming the argument.

Identity of results: every implementation gives the reference's bits, except the float64 sums of
`adasum_dots` (summation order; they agree to float64 rounding) and the sign of a zero median / mean.
"""
from __future__ import annotations

import operator
import os
import threading
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch

from . import cpu, reference
from .cpu import (SOURCE, STALE_BATON_SECONDS, _state, clear_stale_batons, extensions_dir,  # noqa: F401
                  prebuild_jit_ops)
from .reference import abs_key as _abs_key  # noqa: F401
from .reference import adasum_combine as adasum_combine_torch
from .reference import adasum_dots as adasum_dots_torch
from .reference import coordinate_median as coordinate_median_torch
from .reference import topk_error_feedback as topk_error_feedback_torch
from .reference import trimmed_mean as trimmed_mean_torch

__all__ = ["adasum_dots", "adasum_combine", "adasum_pair", "AdasumPair", "topk_error_feedback", "coordinate_median",
           "trimmed_mean", "backend", "prebuild_jit_ops", "adasum_dots_torch", "adasum_combine_torch",
           "topk_error_feedback_torch", "coordinate_median_torch", "trimmed_mean_torch"]

_TRITON_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_triton_state = {"tried": False, "module": None, "reason": ""}


def _triton():
    """The Triton module, imported on the first CUDA call (a CPU-only run never pays for the import)."""
    if not _triton_state["tried"]:
        try:
            from . import triton_gpu
            _triton_state["module"] = triton_gpu
        except Exception as e:  # no triton: the reference answers (also sync-free)
            _triton_state["reason"] = cpu._first_line(e)
        _triton_state["tried"] = True
    return _triton_state["module"]


def backend(device="cpu") -> str:
    """Which implementation answers float32 tensors on `device`: 'cpp', 'triton' or 'torch'."""
    dev = torch.device(device)
    mode = os.environ.get("PDV_KERNELS", "").lower()
    if mode == "torch":
        return "torch"
    if dev.type == "cuda" or mode == "triton":
        return "triton" if _triton() is not None else "torch"
    return cpu.backend() if dev.type == "cpu" else "torch"


def _choose(sig: List[tuple]):
    """The implementation module for a call whose tensors have signature `sig` (one device, non-empty)."""
    mode = os.environ.get("PDV_KERNELS", "").lower()
    dtypes = {s[1] for s in sig}
    if mode == "torch" or len(dtypes) != 1:  # (mixed dtypes: the reference, tensor by tensor)
        return reference
    dt, dev = dtypes.pop(), sig[0][2]
    if (dev.type == "cuda" or mode == "triton") and dt in _TRITON_DTYPES:
        return _triton() or reference
    if dev.type == "cpu" and dt in cpu.FAST_DTYPES and cpu.available():
        return cpu
    return reference


def _impl(tensors: Sequence[torch.Tensor]):
    return _choose(_sig(tensors))


# ---- argument checks (a Python loop per tensor costs ~1 us: one pass, compared as lists) ----------------
def _list(name: str, ts) -> List[torch.Tensor]:
    ts = list(ts)
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}[{i}]: expected a tensor, got {type(t).__name__}")
    return ts


def _sig(ts: Sequence[torch.Tensor]) -> List[tuple]:
    return [(t.numel(), t.dtype, t.device) for t in ts]


def _first(name: str, ts) -> Tuple[List[torch.Tensor], List[tuple]]:
    """The first tensor list of a call, all on one device; returns it and its signature."""
    ts = _list(name, ts)
    sig = _sig(ts)
    if len({s[2] for s in sig}) > 1:
        i = next(i for i, s in enumerate(sig) if s[2] != sig[0][2])
        raise ValueError(f"{name}[{i}]: on {sig[i][2]}, {name}[0] is on {sig[0][2]}")
    return ts, sig


def _like(name: str, ts, ref_name: str, ref_sig: List[tuple]) -> List[torch.Tensor]:
    """`ts` pairs with the list of signature `ref_sig` tensor by tensor: same count, sizes, dtypes, device."""
    ts = _list(name, ts)
    sig = _sig(ts)
    if sig == ref_sig:
        return ts
    if len(sig) != len(ref_sig):
        raise ValueError(f"{name}: {len(sig)} tensors, {ref_name} has {len(ref_sig)}")
    for i, ((n, dt, dev), (rn, rdt, rdev)) in enumerate(zip(sig, ref_sig)):
        if n != rn:
            raise ValueError(f"{name}[{i}]: {n} elements, {ref_name}[{i}] has {rn}")
        if dt != rdt:
            raise ValueError(f"{name}[{i}]: dtype {dt}, {ref_name}[{i}] is {rdt}")
        if dev != rdev:
            raise ValueError(f"{name}[{i}]: on {dev}, {ref_name}[{i}] is on {rdev}")
    return ts


def _coefficients(name: str, c, n: int) -> torch.Tensor:
    c = c if isinstance(c, torch.Tensor) else torch.as_tensor(c, dtype=torch.float64)
    if c.numel() != n:
        raise ValueError(f"{name}: {c.numel()} coefficients for {n} tensors")
    return c.reshape(-1)


def _dense(ts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in ts]


# ---- launch state per layout (Triton's list ops) ------------------------------------------------------------
# A call's layout key: every tensor's address, size, dtype and contiguity, one C-level map each (~3 us per 61
# tensors). A key seen before was checked in full by the slow path (counts, sizes, dtypes, one device: under
# CUDA's unified addressing an address names one device) and maps to the Triton launch state (PairLaunch),
# so the call is the launches and one or two allocations. Issue #39: the wrapper's Python (signatures, tables,
# selects, ~17 numel() per tensor) cost ~420 us per Adasum level of 61 tensors, 4x the kernels' device time.
_PTR, _NUMEL, _CONTIG = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_pairs: "OrderedDict[tuple, object]" = OrderedDict()
_pairs_lock = threading.Lock()
#: layouts kept (an aggregator has a few per step: adasum one per tree level and dtype)
PAIR_CACHE = 256


def _layout_key(ts) -> Optional[tuple]:
    """(addresses, sizes, dtypes, contiguity) of a list or tuple of tensors; None for anything else."""
    if type(ts) not in (list, tuple):
        return None
    try:
        return (tuple(map(_PTR, ts)), tuple(map(_NUMEL, ts)), tuple(map(_DTYPE, ts)), tuple(map(_CONTIG, ts)))
    except (TypeError, AttributeError):  # not all tensors: the slow path names the culprit
        return None


def _pair_key(a, b) -> Optional[tuple]:
    ka = _layout_key(a)
    kb = _layout_key(b) if ka is not None else None
    if kb is None or not ka[0]:
        return None
    return ka, kb, os.environ.get("PDV_KERNELS", "")


def _pair_launch(key: Optional[tuple]):
    """The cached PairLaunch of a layout key (None on a miss or a changed block size)."""
    if key is None:
        return None
    st = _pairs.get(key)  # one hash of the key (a dict read needs no lock); eviction is first-in first-out
    if st is not None and st.block != _triton_state["module"].BLOCK:
        return None
    return st


def _remember(key: Optional[tuple], impl, a: List[torch.Tensor], b: List[torch.Tensor]):
    """A new PairLaunch for a layout the slow path accepted for Triton (every tensor contiguous), or None."""
    if key is None or impl is not _triton_state["module"] or impl is None or \
            not (all(key[0][3]) and all(key[1][3])):
        return None
    st = impl.PairLaunch(a, b)
    with _pairs_lock:
        _pairs[key] = st
        while len(_pairs) > PAIR_CACHE:
            _pairs.popitem(last=False)
    return st


def _coefficient_ok(c, n: int) -> bool:
    return isinstance(c, torch.Tensor) and c.dim() == 1 and c.shape[0] == n


# ---- the API ------------------------------------------------------------------------------------------
def adasum_dots(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = _pair_key(a, b)
    st = _pair_launch(key)
    if st is not None:
        return st.dots()
    a, sig = _first("a", a)
    b = _like("b", b, "a", sig)
    if not a:
        return reference.adasum_dots(a, b)
    impl = _choose(sig)
    st = _remember(key, impl, a, b)
    if st is not None:
        return st.dots()
    return impl.adasum_dots(_dense(a), _dense(b))


def _out_target(st, key, a, b, out):
    """(segments, aligned) for `out` under launch state `st`: a's or b's when out is that list (by identity),
    else out's own, cached in `st` by its key; None when out needs the slow path."""
    if out is a or (len(out) == len(a) and all(map(operator.is_, out, a))):
        return st.a, st.align_a
    if out is b or (len(out) == len(b) and all(map(operator.is_, out, b))):
        return st.b, st.align_b
    ko = _layout_key(out)
    if ko is None or ko[1:3] != key[0][1:3] or not all(ko[3]):
        return None
    return st.out_segments(ko, out)


def _combine_known(st, key, a, b, ca, cb, out) -> bool:
    """The combination through a known layout's launch state `st` (None: not known); False when `ca`, `cb` or
    `out` need the slow path."""
    if st is None or not (_coefficient_ok(ca, st.n) and _coefficient_ok(cb, st.n)):
        return False
    target = _out_target(st, key, a, b, out)
    if target is None:
        return False
    st.combine(ca, cb, *target)
    return True


def adasum_combine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], ca: torch.Tensor, cb: torch.Tensor,
                   out: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    key = _pair_key(a, b) if out is not None and type(out) in (list, tuple) else None
    if _combine_known(_pair_launch(key), key, a, b, ca, cb, out):
        return list(out)
    a, sig = _first("a", a)
    b = _like("b", b, "a", sig)
    outs = None if out is None else _like("out", out, "a", sig)
    ca, cb = _coefficients("ca", ca, len(a)), _coefficients("cb", cb, len(a))
    if not a:
        return outs if outs is not None else []
    impl = _choose(sig)
    if impl is reference:
        return reference.adasum_combine(a, b, ca, cb, outs)
    st = _remember(key, impl, a, b)
    if st is not None:
        target = _out_target(st, key, a, b, outs)
        if target is not None:
            st.combine(ca, cb, *target)
            return outs
    if outs is None:
        outs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in a]
    dense = _dense(outs)  # a strided out: computed into a dense copy, written back below
    impl.adasum_combine(_dense(a), _dense(b), ca, cb, dense)
    for o, d in zip(outs, dense):
        if d is not o:
            o.copy_(d)
    return outs


class AdasumPair:
    """`adasum_dots` and then `adasum_combine` of one pair of tensor lists, checked once: what Adasum does at
    each level of its tree (the dots; the sums exchanged; the combination, usually into one of the lists).
    Made by `adasum_pair(a, b)`. The free functions each work out the lists' layout (~15 us of host time
    per 61 tensors on a GPU's host, issue #39); a pair does it once for both calls. Between the calls the
    tensors must keep their places, sizes and layouts (writing their values is fine: that is the point)."""

    __slots__ = ("a", "b", "_key", "_st")

    def __init__(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]):
        self.a, self.b = a, b
        self._key = _pair_key(a, b)
        self._st = _pair_launch(self._key)
        if self._st is None and self._key is not None:  # a layout not seen yet: checked in full once
            a_list, sig = _first("a", a)
            _like("b", b, "a", sig)
            if a_list:
                self._st = _remember(self._key, _choose(sig), a_list, list(b))

    def dots(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """adasum_dots(a, b)."""
        return self._st.dots() if self._st is not None else adasum_dots(self.a, self.b)

    def combine(self, ca: torch.Tensor, cb: torch.Tensor,
                out: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """adasum_combine(a, b, ca, cb, out)."""
        if out is not None and type(out) in (list, tuple) and _combine_known(self._st, self._key, self.a, self.b,
                                                                             ca, cb, out):
            return list(out)
        return adasum_combine(self.a, self.b, ca, cb, out)


def adasum_pair(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> AdasumPair:
    """An `AdasumPair` of the lists a and b (checks as `adasum_dots` does)."""
    return AdasumPair(a, b)


def topk_error_feedback(update: torch.Tensor, residual: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    _like("residual", [residual], "update", _first("update", [update])[1])
    n = update.numel()
    k = max(0, min(int(k), n))
    impl = _impl([update])
    if impl is reference or k in (0, n):  # nothing to select: the reference's few ops are the whole work
        return reference.topk_error_feedback(update, residual, k)
    flat = residual.view(-1) if residual.is_contiguous() else residual.reshape(-1).clone()
    idx, vals = impl.topk_error_feedback(update.reshape(-1).contiguous(), flat, k)
    if not residual.is_contiguous():
        residual.copy_(flat.view(residual.shape))
    return idx, vals


def _stack(stack: torch.Tensor) -> torch.Tensor:
    if not isinstance(stack, torch.Tensor) or stack.dim() < 1 or stack.shape[0] < 1:
        raise ValueError("stack: expected a tensor of shape (m, ...) with m >= 1 rows, got "
                         f"{tuple(stack.shape) if isinstance(stack, torch.Tensor) else type(stack).__name__}")
    return stack


def _rows(stack: torch.Tensor, impl) -> torch.Tensor:
    """(m, n) view of the stack as the implementation reads it: C++ dense, Triton unit column stride."""
    flat = stack.reshape(stack.shape[0], -1)
    if impl is cpu or (flat.shape[1] > 1 and flat.stride(1) != 1):
        flat = flat.contiguous()
    return flat


def _sorted_impl(stack: torch.Tensor):
    impl = _impl([stack])
    if impl is not reference and impl is not cpu and stack.shape[0] > impl.MAX_ROWS:
        return reference
    return impl


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    impl = _sorted_impl(_stack(stack))
    if impl is reference:
        return reference.coordinate_median(stack)
    return impl.coordinate_median(_rows(stack, impl)).view(stack.shape[1:])


def trimmed_mean(stack: torch.Tensor, trim: int) -> torch.Tensor:
    m = _stack(stack).shape[0]
    if not 0 <= 2 * int(trim) < m:
        raise ValueError(f"trim={trim} leaves nothing of {m} vectors")
    impl = _sorted_impl(stack)
    if impl is reference:
        return reference.trimmed_mean(stack, int(trim))
    return impl.trimmed_mean(_rows(stack, impl), int(trim)).view(stack.shape[1:])
