"""Host synchronisations a CUDA run would make, counted on CPU tensors (the GPU tier counts real ones).

CI has no GPU, yet "no host sync per tensor on a GPU path" must not regress there. `SyncAudit` is a
`TorchFunctionMode` that plays the device: tensors handed to `mark` (the gradients), tensors created with an
explicit `device=` (as device code creates them: `device=t.device`, `comm.payload_device`) and every tensor
computed from them are "on the device"; `.cpu()`, `.to("cpu")` and factories without a device are the host.
It records, with the caller's file:line,

- `syncs`: what synchronises on CUDA when its input is on the device: a host read (`item`, `tolist`,
  `bool()`, `float()`, `int()`, `numpy`), an output whose size depends on the values (`nonzero`,
  `masked_select`, `unique`, boolean-mask indexing, `repeat_interleave` without `output_size`), `equal` /
  `allclose`, a device-to-host copy (`.cpu()`, `.to("cpu")`, `host.copy_(device)`), a blocking
  host-to-device copy (`host.to(device)`, `host.cuda()`, `device.copy_(host)` without `non_blocking`), and a
  host value written into the device where torch copies it over and waits: a Python number or host tensor
  at tensor (or list) indices (`acc[idx] = 0`: index_put_ moves the 0 to the device), into a single element
  (`t[3] = 1.0`), or a host tensor of several elements (`index_put_` with host values likewise);
- `divides`: a floating device tensor divided by a Python number that is not a power of two: CUDA computes
  it as a product with the number's rounded reciprocal, the CPU as a quotient, which may differ in the last
  bit (divide by a 0-dim device tensor, `robust.exact`, or multiply by a reciprocal that every device uses);
- `mixes`: an op mixing device tensors with host tensors of more than one element (CUDA raises "Expected all
  tensors to be on the same device" there; copies and index arguments excepted).

Host payloads: `HOST` (`cpu:0`, which makes plain CPU tensors) is the host as an explicit device, the
`payload_device` of a comm with a host group (`TorchComm(host_group=...)`); give it to the in-process comm
to model NCCL with its gloo twin. What it cannot see: torch's own internal syncs and a `.to(torch.device("cpu"))` (indistinguishable from
`.to(t.device)` on CPU: treated as staying on the device, a possible miss, never a false alarm). Work done
inside `tests/threadcomm.py` (the in-process stand-in for NCCL) is not counted.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import weakref
from typing import Any, Iterable, List

import torch
from torch.overrides import TorchFunctionMode

SYNC_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "numpy",
              "is_nonzero", "equal", "allclose", "__repr__", "__format__"}
SYNC_SHAPES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
NO_MIX_CHECK = {"copy_", "to", "index_select", "index_copy_", "index_add_", "index_put_", "__getitem__",
                "__setitem__", "gather", "scatter", "scatter_", "scatter_add_", "take", "cpu", "__get__"}
_SKIP_FILES = ("threadcomm.py", "sync_audit.py")
DIVISIONS = {"div", "div_", "__truediv__", "__itruediv__", "true_divide", "true_divide_"}
HOST = torch.device("cpu", 0)


def _is_host(dev: Any) -> bool:
    """An explicit device that names the host: "cpu" as a string, or `HOST`."""
    if isinstance(dev, str):
        return dev.split(":")[0] == "cpu"
    return isinstance(dev, torch.device) and dev.type == "cpu" and dev.index == 0


def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


class SyncAudit(TorchFunctionMode):
    """One per thread (torch function modes are thread-local); `registry` is shared by the ranks' threads."""

    def __init__(self, registry: "DeviceRegistry"):
        super().__init__()
        self.reg = registry

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        ins = list(_tensors(args)) + list(_tensors(kwargs))
        on_dev = [t for t in ins if self.reg.has(t)]
        if on_dev:
            self._check_sync(name, args, kwargs)
            self._check_division(name, args, kwargs)
            if name not in NO_MIX_CHECK and any(t.numel() > 1 and not self.reg.has(t) for t in ins):
                self.reg.note("mixes", name)
        if name == "copy_" and len(args) >= 2 and not self.reg.has(args[0]) and self.reg.has(args[1]):
            self.reg.note("syncs", "copy_ (device to host)")
        if self._host_to_device(name, args, kwargs):
            self.reg.note("syncs", f"{name} (host to device, blocking)")
        out = func(*args, **kwargs)
        if name == "cpu" or (name == "to" and self._to_host_literal(args, kwargs)):
            if on_dev:
                self.reg.note("syncs", f"{name} (device to host)")
            return out.detach() if out is args[0] else out  # a new object: the host copy is not on the device
        dev = kwargs.get("device")
        if on_dev or (dev is not None and not _is_host(dev)) or \
                (name == "to" and len(args) > 1 and isinstance(args[1], torch.device)):
            for t in _tensors(out):
                self.reg.add(t)
        return out

    def _check_sync(self, name, args, kwargs) -> None:
        if name in SYNC_READS or name in SYNC_SHAPES:
            self.reg.note("syncs", name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.reg.note("syncs", name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and any(
                t.dtype == torch.bool for t in _tensors(args[1:2])):
            self.reg.note("syncs", f"{name} (boolean mask)")
        elif name == "__setitem__" and len(args) >= 3 and self.reg.has(args[0]):
            self._check_setitem(args[0], args[1], args[2])
        elif name in ("index_put_", "index_put") and self.reg.has(args[0]):
            values = args[2] if len(args) > 2 else kwargs.get("values")
            if isinstance(values, torch.Tensor) and not self.reg.has(values):
                self.reg.note("syncs", f"{name} (host values: a blocking host-to-device copy)")

    def _check_division(self, name, args, kwargs) -> None:
        """A floating device tensor divided by a Python number: CUDA multiplies by the number's rounded
        reciprocal (BinaryDivTrueKernel.cu) where the CPU divides, so the bits may differ in the last place
        (exact only for powers of two)."""
        if name not in DIVISIONS or len(args) < 2 or kwargs.get("rounding_mode") is not None:
            return
        x, d = args[0], args[1]
        if isinstance(x, torch.Tensor) and x.is_floating_point() and isinstance(d, (int, float)) and \
                not isinstance(d, bool) and d != 0 and math.isfinite(d) and math.frexp(abs(d))[0] != 0.5:
            self.reg.note("divides", f"{name} by {d!r}")

    def _check_setitem(self, dst: torch.Tensor, index: Any, value: Any) -> None:
        """`dst[index] = value` on the device with a value from the host - a Python number or a host tensor -
        synchronises on CUDA where torch copies that value to the device with a blocking copy: at tensor (or
        list) indices (index_put_ moves the value over: `acc[idx] = 0`) and into a single element (a 0-dim
        destination takes `copy_` of the host scalar). A slice of several elements takes `fill_` (free)."""
        if isinstance(value, torch.Tensor) and self.reg.has(value):
            return
        host_tensor = isinstance(value, torch.Tensor)
        if not (host_tensor or isinstance(value, (bool, int, float, complex))):
            return
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, (torch.Tensor, list)) for p in parts):
            self.reg.note("syncs", "__setitem__ (a host value at tensor indices: a blocking host-to-device copy)")
            return
        with torch._C.DisableTorchFunction():
            one = dst[index].dim() == 0
        if one or (host_tensor and value.numel() > 1):
            self.reg.note("syncs", "__setitem__ (a host value into the device: a blocking host-to-device copy)")

    def _host_to_device(self, name, args, kwargs) -> bool:
        """Whether this call copies a host tensor to the device without non_blocking (`host.to(device)`,
        `host.cuda()`, `device.copy_(host)`): from pageable memory that is a copy and a stream sync."""
        if name not in ("to", "cuda", "copy_") or not args or not isinstance(args[0], torch.Tensor):
            return False
        if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
            return False
        if name == "copy_":
            return len(args) > 1 and self.reg.has(args[0]) and isinstance(args[1], torch.Tensor) and \
                not self.reg.has(args[1])
        if self.reg.has(args[0]):
            return False
        return name == "cuda" or any(isinstance(a, torch.device) and not _is_host(a)
                                     for a in list(args[1:]) + [kwargs.get("device")])

    @staticmethod
    def _to_host_literal(args, kwargs) -> bool:
        return _is_host(kwargs.get("device", args[1] if len(args) > 1 else None))


class DeviceRegistry:
    """Which tensors are on the simulated device, and what was recorded (shared across threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self.syncs: List[str] = []
        self.mixes: List[str] = []
        self.divides: List[str] = []

    def add(self, t: torch.Tensor) -> None:
        with self._lock:
            self._ids[id(t)] = t

    def has(self, t: torch.Tensor) -> bool:
        with self._lock:
            return self._ids.get(id(t)) is t

    def mark(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in _tensors(list(tensors)):
            self.add(t)

    def note(self, kind: str, what: str) -> None:
        where = _caller()
        if where is None:  # inside the in-process comm
            return
        with self._lock:
            getattr(self, kind).append(f"{what} at {where}")

    def mode(self) -> SyncAudit:
        return SyncAudit(self)


def _caller():
    """file:line of the innermost frame outside torch and this module; None inside the thread comm."""
    f = sys._getframe(2)
    torch_dir = os.path.dirname(torch.__file__)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.endswith(_SKIP_FILES[0]):
            return None
        if not fn.startswith(torch_dir) and not fn.endswith(_SKIP_FILES[1]):
            return f"{os.path.relpath(fn)}:{f.f_lineno}"
        f = f.f_back
    return "?"
