"""The snapshot keeper: a process beside each worker that turns a snapshot into files in host memory.

Why a process: serializing, hashing and writing a stage's state costs CPU and, in a thread, the worker's GIL;
on a GPU host that work belongs on the host's spare cores, not on the process that drives the device (the
emulator models this: its workers run under the device's CPU quota, the keepers under their host's group,
`PDV_KEEPER_CGROUP`). The worker copies the state into one shared-memory buffer (a memcpy on the step's path)
and sends the keeper the layout; the keeper rebuilds the objects, `torch.save`s them, writes them through
`HostStore.write` (temporary name, rename, sha256) and answers with their seal entries. The worker seals.

The keeper dies with its worker (PR_SET_PDEATHSIG, and its pipe's end-of-file): a worker killed mid-snapshot
takes its keeper with it, and what the keeper had not finished is never sealed.

Protocol (the keeper's stdin / stdout, one pickle each way per request):
  {"op": "write", "buffer": path, "size": n, "tensors": [(offset, dtype, shape)], "files": {name: object
   with TensorRef(i) in place of tensors}, "root", "job", "host", "step", "write": bool, "only_first": bool}
  -> {"sealed": {name: {"sha256", "bytes"}}, "serialize_s", "write_s"} or {"error": text}
"""
from __future__ import annotations

import ctypes
import io
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

CGROUP_ENV = "PDV_KEEPER_CGROUP"  # a cgroup.procs file the keeper moves itself into (the emulator's host CPU)
ALIGN = 64


class TensorRef:
    """Where a tensor stood in a snapshot's object (its index in the buffer's layout)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (TensorRef, (self.i,))


def flatten(obj: Any, out: List[Any]) -> Any:
    """`obj` with each tensor replaced by a TensorRef and appended to `out` (dicts, lists, tuples rebuilt)."""
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return TensorRef(len(out) - 1)
    if isinstance(obj, dict):
        return {k: flatten(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(flatten(v, out) for v in obj)
    return obj


def rebuild(obj: Any, tensors: List[Any]) -> Any:
    if isinstance(obj, TensorRef):
        return tensors[obj.i]
    if isinstance(obj, dict):
        return {k: rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(rebuild(v, tensors) for v in obj)
    return obj


class Keeper:
    """The worker's handle on its keeper process (started at once: the first snapshot does not wait for its
    imports)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "pdv_ext.recovery.keeper"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        self.path: Optional[str] = None
        self.size = 0
        self.buffer: Any = None
        self._mapped = False  # the keeper has mapped the buffer: its name can go (the memory stays while mapped)
        self._registered = False  # page-locked for CUDA (unregistered before it is unmapped)

    def _ensure(self, size: int) -> None:
        import torch

        if self.buffer is not None and size <= self.size:
            return
        self.close_buffer()
        size = max(size, 1 << 20) * 5 // 4  # room for some growth before the next remap
        from .config import host_memory_dir

        fd, self.path = tempfile.mkstemp(prefix=f"pdv-keeper-{os.getpid()}-", dir=host_memory_dir())
        os.ftruncate(fd, size)
        os.close(fd)
        self.buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        self.size = size
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # page-locked: copies from the GPU queue
            try:
                torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), size, 0)
                self._registered = True
            except Exception:  # noqa: BLE001 - pageable memory still works, the driver stages the copies
                pass

    def stage(self, obj: Any) -> Tuple[Any, List[Tuple[int, str, Tuple[int, ...]]]]:
        """Copy every tensor of `obj` into the shared buffer (the only work on the step's path); returns the
        object with TensorRefs and the layout."""
        tensors: List[Any] = []
        flat = flatten(obj, tensors)
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self._ensure(total)
        layout = []
        on_gpu = False
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            if n:
                # from a GPU: queued copies, one synchronisation below for all of them (not one per tensor);
                # into pinned memory where the buffer could be registered with CUDA, else staged by the driver
                on_gpu |= t.is_cuda
                self.buffer[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=t.is_cuda)
            layout.append((off, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        if on_gpu:
            import torch

            torch.cuda.synchronize()
        return flat, layout

    def write(self, files: Any, layout: List[Any], **job: Any) -> Dict[str, Any]:
        """Have the keeper write `files` (staged by `stage`); blocks until it answers (waiting on a pipe
        releases the GIL)."""
        req = {"op": "write", "buffer": self.path, "size": self.size, "tensors": layout, "files": files, **job}
        try:
            pickle.dump(req, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
            reply = pickle.load(self.proc.stdout)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise RuntimeError(f"pdv.snapshots: the snapshot keeper (pid {self.proc.pid}) is gone "
                               f"(exit {self.proc.poll()})") from exc
        if not self._mapped and self.path:
            os.unlink(self.path)  # both processes hold it mapped: nothing is left in /dev/shm if either dies
            self._mapped = True
        if "error" in reply:
            raise RuntimeError(f"pdv.snapshots: the snapshot keeper failed: {reply['error']}")
        return reply

    def close_buffer(self) -> None:
        if self._registered:
            import torch

            try:
                torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            except Exception:  # noqa: BLE001
                pass
            self._registered = False
        if self.path and not self._mapped:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self.path, self.buffer, self.size, self._mapped = None, None, 0, False

    def close(self) -> None:
        self.close_buffer()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - a keeper that will not leave is killed
                self.proc.kill()


# -------------------------------------------------------------------------------------------------------
# the keeper process
# -------------------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _join_cgroup() -> None:
    procs = os.environ.get(CGROUP_ENV)
    if procs:
        try:
            with open(procs, "w") as f:
                f.write("0")
        except OSError as exc:
            print(f"pdv snapshot keeper: could not join {procs}: {exc}", file=sys.stderr)


def _serve(inp: Any, out: Any) -> None:
    import torch

    from .store import HostStore

    maps: Dict[Tuple[str, int], Any] = {}
    while True:
        try:
            req = pickle.load(inp)
        except EOFError:
            return
        try:
            key = (req["buffer"], req["size"])
            if key not in maps:
                maps.clear()
                maps[key] = torch.from_file(req["buffer"], shared=True, size=req["size"], dtype=torch.uint8)
            buf = maps[key]
            t0 = time.perf_counter()
            tensors = []
            for off, dtype, shape in req["tensors"]:
                dt = getattr(torch, dtype)
                n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                tensors.append(buf[off:off + n].view(dt).view(shape).clone() if n else torch.empty(shape, dtype=dt))
            blobs = {}
            for name, obj in req["files"].items():
                obj = rebuild(obj, tensors)  # (checked plain by the worker before it was staged)
                b = io.BytesIO()
                torch.save(obj, b)
                blobs[name] = b.getvalue()
            t1 = time.perf_counter()
            sealed = {}
            if req["write"]:
                store = HostStore(req["root"], req["job"], req["host"])
                for name in sorted(blobs):
                    sealed[name] = store.write(req["step"], name, blobs[name])
                    if req.get("only_first"):
                        break
            reply = {"sealed": sealed, "serialize_s": t1 - t0, "write_s": time.perf_counter() - t1}
        except Exception:  # noqa: BLE001 - every failure goes back to the worker, which raises it
            reply = {"error": traceback.format_exc(limit=4)}
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def main() -> None:
    _die_with_parent()
    _join_cgroup()
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    _serve(inp, out)


if __name__ == "__main__":
    from pdv_ext.recovery.keeper import main as _main  # the module's own classes (TensorRef), not __main__'s

    _main()
