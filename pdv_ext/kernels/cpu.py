"""The fused CPU kernels: loading the C++ extension (`csrc/pdv_kernels.cpp`, JIT-built) and calling it.

The sources ship inside the package (`pdv_ext/kernels/csrc/`, package data of the wheel, as DeepSpeed ships
its op sources) and are JIT-built on first use, under a file lock so that concurrent ranks build once. The
build is cached under TORCH_EXTENSIONS_DIR; unset, a source checkout uses `<repo>/build/torch_extensions`
(what `make setup` fills) and an installed package torch's default cache (`~/.cache/torch_extensions`),
never a directory beside itself in site-packages. When no compiler works, the sources are missing, or
PDV_KERNELS=torch, `backend()` says "torch" and `pdv_ext.kernels` uses the reference (one warning). The
call wrappers at the end take what `pdv_ext.kernels` hands them: CPU tensors of one dtype, float32 or
float64, a non-empty list.
"""
from __future__ import annotations

import hashlib
import os
import platform
import threading
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..source_tree import jit_cache_dir

#: the C++ source, package data in a checkout and in an installed wheel alike
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "pdv_kernels.cpp")
#: the dtypes the C++ kernels take
FAST_DTYPES = (torch.float32, torch.float64)


# ---- loading the C++ extension --------------------------------------------------------------------
_lock = threading.Lock()
_state = {"tried": False, "module": None, "reason": ""}


def _cpu_tag() -> str:
    """Distinguishes -march=native builds of different CPUs sharing one cache directory."""
    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    info += line
                if line.startswith("flags") or line.startswith("Features"):
                    break
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:8]


def _cflags(native: bool) -> List[str]:
    flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-std=c++17"]
    if native:
        flags.append("-march=native")
    return flags


def extensions_dir() -> str:
    """Where the JIT build is cached (see the module docstring)."""
    cached = jit_cache_dir()
    if cached:
        return cached
    from torch.utils import cpp_extension  # imports setuptools (0.2 s): only for builds, not every rank

    return cpp_extension.get_default_build_root()


#: a torch JIT baton (`<build dir>/lock`) older than this is a killed build's: builds take well under it
STALE_BATON_SECONDS = 300.0


def clear_stale_batons(root: str, ops: Sequence[str], older_than: float = STALE_BATON_SECONDS) -> List[str]:
    """Remove torch's build lock of each of `ops` under `root` when it is older than `older_than` seconds."""
    import time

    removed = []
    for name in ops:
        baton = os.path.join(root, name, "lock")
        try:
            if time.time() - os.path.getmtime(baton) >= older_than:
                os.remove(baton)
                removed.append(baton)
        except FileNotFoundError:
            pass
    return removed


def prebuild_jit_ops(log=lambda msg: None) -> Dict[str, str]:
    """Build the JIT-compiled ops our ranks load - these kernels and DeepSpeed's CPU shared-memory op - once,
    here (`make setup`), so that ranks started under a test's timeout never race to build them. A killed
    build leaves torch's lock file behind, and every later load of that op waits for it forever: a lock
    older than STALE_BATON_SECONDS is removed first. Returns {op: "built" | reason it was not}."""
    out: Dict[str, str] = {}
    for baton in clear_stale_batons(extensions_dir(), ["deepspeed_shm_comm"]):
        log(f"removed a killed build's lock {baton}")
    out["pdv_kernels"] = "built" if backend() == "cpp" else _state["reason"]
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops import __compatible_ops__

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None or not __compatible_ops__.get(builder.NAME, False):
            out["deepspeed_shm_comm"] = "not used by this accelerator"
        else:
            builder.load(verbose=False)
            out["deepspeed_shm_comm"] = "built"
    except Exception as e:  # DeepSpeed falls back to plain torch.distributed without it
        out["deepspeed_shm_comm"] = _first_line(e)
    return out


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _build():
    import ctypes
    import fcntl

    from torch.utils import cpp_extension

    if not os.path.exists(SOURCE):
        raise FileNotFoundError(f"kernel source {SOURCE} not found")
    root = extensions_dir()
    os.makedirs(root, exist_ok=True)
    with open(SOURCE, "rb") as f:
        src_tag = hashlib.sha1(f.read()).hexdigest()[:8]
    last_err: Optional[Exception] = None
    for native in (True, False) if os.environ.get("PDV_KERNELS_NATIVE", "1") != "0" else (False,):
        name = f"pdv_kernels_{src_tag}_{_cpu_tag() if native else 'generic'}"
        build_dir = os.path.join(root, name)
        os.makedirs(build_dir, exist_ok=True)
        with open(os.path.join(root, "pdv_kernels.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time across ranks and processes
            try:
                clear_stale_batons(root, [name], older_than=0.0)  # under our lock, any baton is a killed build's
                path = cpp_extension.load(name=name, sources=[SOURCE], extra_cflags=_cflags(native),
                                          build_directory=build_dir, is_python_module=False, verbose=False)
                path = path or os.path.join(build_dir, name + ".so")
                return _bind(ctypes.CDLL(path))
            except Exception as e:  # e.g. -march=native unsupported: retry portable
                last_err = e
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    raise RuntimeError(f"building {SOURCE} failed: {last_err}")


def _bind(lib):
    import ctypes as C

    P, I64, I = C.c_void_p, C.c_int64, C.c_int
    sig = {
        "pdv_adasum_dots": [I, I64, P, P, P, P, I],
        "pdv_adasum_combine": [I, I64, P, P, P, P, P, P, I],
        "pdv_topk_error_feedback": [I, P, P, I64, I64, P, P],
        "pdv_coordinate_median": [I, P, I64, I64, P, I],
        "pdv_trimmed_mean": [I, P, I64, I64, I64, P, I],
    }
    for fn, args in sig.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = I
    return lib


def _ptrs(tensors: Sequence[torch.Tensor]):
    import ctypes

    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _sizes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.numel() for t in tensors], dtype=torch.int64)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"pdv_ext.kernels: {what} failed in the C++ kernel")


def backend() -> str:
    """'cpp' when the fused kernels are loaded (building them if needed), else 'torch'."""
    return "cpp" if _module() is not None else "torch"


def _module():
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        if os.environ.get("PDV_KERNELS", "").lower() == "torch":
            _state["reason"] = "PDV_KERNELS=torch"
        else:
            try:
                _state["module"] = _build()
            except Exception as e:  # no compiler, no headers, no sources: the fallbacks are exact
                _state["reason"] = _first_line(e)
                warnings.warn(f"pdv_ext.kernels: using the pure-torch fallbacks ({_state['reason']})",
                              RuntimeWarning, stacklevel=3)
        _state["tried"] = True
        return _state["module"]


def available() -> bool:
    """The extension is loaded (built on the first ask)."""
    return _module() is not None


# ---- calls (contiguous inputs; `pdv_ext.kernels` copies strided ones and writes strided outputs back) ----
def _code(t: torch.Tensor) -> int:
    return 0 if t.dtype == torch.float32 else 1


def adasum_dots(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = torch.empty(3, len(a), dtype=torch.float64)
    sizes = _sizes(a)  # (kept alive across the call)
    _check(_module().pdv_adasum_dots(_code(a[0]), len(a), _ptrs(a), _ptrs(b), sizes.data_ptr(),
                                     out.data_ptr(), torch.get_num_threads()), "adasum_dots")
    return out[0], out[1], out[2]


def adasum_combine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], ca: torch.Tensor, cb: torch.Tensor,
                   outs: Sequence[torch.Tensor]) -> None:
    ca64 = ca.to(device="cpu", dtype=torch.float64).contiguous()
    cb64 = cb.to(device="cpu", dtype=torch.float64).contiguous()
    sizes = _sizes(a)
    _check(_module().pdv_adasum_combine(_code(a[0]), len(a), _ptrs(a), _ptrs(b), _ptrs(outs),
                                        sizes.data_ptr(), ca64.data_ptr(), cb64.data_ptr(),
                                        torch.get_num_threads()), "adasum_combine")


def topk_error_feedback(update: torch.Tensor, residual: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`residual` must be contiguous (it is updated in place)."""
    idx = torch.empty(k, dtype=torch.int64)
    vals = torch.empty(k, dtype=update.dtype)
    _check(_module().pdv_topk_error_feedback(_code(update), update.data_ptr(), residual.data_ptr(),
                                             update.numel(), k, idx.data_ptr(), vals.data_ptr()),
           "topk_error_feedback")
    return idx, vals


def coordinate_median(flat: torch.Tensor) -> torch.Tensor:
    """Of a contiguous (m, n) stack."""
    out = torch.empty(flat.shape[1], dtype=flat.dtype)
    _check(_module().pdv_coordinate_median(_code(flat), flat.data_ptr(), flat.shape[0], flat.shape[1],
                                           out.data_ptr(), torch.get_num_threads()), "coordinate_median")
    return out


def trimmed_mean(flat: torch.Tensor, trim: int) -> torch.Tensor:
    """Of a contiguous (m, n) stack."""
    out = torch.empty(flat.shape[1], dtype=flat.dtype)
    _check(_module().pdv_trimmed_mean(_code(flat), flat.data_ptr(), flat.shape[0], flat.shape[1], trim,
                                      out.data_ptr(), torch.get_num_threads()), "trimmed_mean")
    return out
