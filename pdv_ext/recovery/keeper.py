"""The snapshot keeper: a process beside each worker that turns a snapshot into files in host memory.

Why a process: making the files, hashing and writing a stage's state costs CPU and, in a thread, the worker's
GIL; on a GPU host that work belongs on the host's spare cores, not on the process that drives the device (the
emulator models this: its workers run under the device's CPU quota, the keepers under their host's group,
`PDV_KEEPER_CGROUP`). The worker copies the state into one shared-memory buffer (a memcpy on the step's path)
and sends the keeper each file's pickle (`torch_format.data_pickle`: the structure, tensors as references into
the buffer); the keeper puts the tensors' bytes around it (`torch_format.archive`: the file torch.save would
write), writes the files through `HostStore.write` (temporary name, rename, sha256) and answers with their seal
entries. The worker seals. The keeper never imports torch: a second and more of CPU per keeper at the job's
start, beside the workers' own start.

The keeper dies with its worker (PR_SET_PDEATHSIG, and its pipe's end-of-file): a worker killed mid-snapshot
takes its keeper with it, and what the keeper had not finished is never sealed.

Protocol (the keeper's stdin / stdout, one pickle each way per request):
  {"op": "write", "buffer": path, "size": n, "tensors": [(offset, nbytes)], "files": {name: (data.pkl bytes,
   [tensor index])}, "root", "job", "host", "step", "write": bool, "only_first": bool}
  -> {"sealed": {name: {"sha256", "bytes"}}, "serialize_s", "write_s"} or {"error": text}
  {"op": "listen", "root", "job", "host", "token", "timeout"} -> {"port": p}: take copies from other hosts'
   keepers from now on (a thread; each copy is written into this host's store as it comes)
  {"op": "push", "root", "job", "host", "step", "names", "to": [address, port], "token", "sender",
   "timeout"} -> {"bytes": n}: send those files of this host's store to that keeper (the bytes of the last
   `write`, kept for it), which answers once it has written them
  {"op": "collect", "step", "senders": [rank], "timeout"} -> {"sealed": {name: entry}}: wait for the copies
   of `step` from those ranks (given up when the worker closes the pipe)

Why the keepers copy to the other host, not the worker: the copy is the largest part of a snapshot (the link
between hosts), and the worker's process is the device's (its socket threads and the bytes' hashing ran
under the device's CPU quota on the emulator, beside the step).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from .torch_format import archive, data_pickle

CGROUP_ENV = "PDV_KEEPER_CGROUP"  # a cgroup.procs file the keeper moves itself into (the emulator's host CPU)
ALIGN = 64


class TensorRef:
    """Where a tensor stood in a snapshot's object (its index in the buffer's layout)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def flatten(obj: Any, out: List[Any], tokens: Optional[List[Any]] = None) -> Any:
    """`obj` with each tensor replaced by a TensorRef and appended to `out` (dicts, lists, tuples rebuilt).
    `tokens`, when given, receives what the pickle of the result depends on besides the tensors' layout: each
    container's type and size, each key and value with its type (equal tokens: an equal pickle)."""
    import torch

    tokens = [] if tokens is None else tokens
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        tokens.append(len(out) - 1)
        return TensorRef(len(out) - 1)
    if isinstance(obj, dict):
        tokens.append((dict, len(obj)))
        res = {}
        for k, v in obj.items():
            tokens.append((type(k), k))
            res[k] = flatten(v, out, tokens)
        return res
    if isinstance(obj, (list, tuple)):
        tokens.append((type(obj), len(obj)))
        return type(obj)(flatten(v, out, tokens) for v in obj)
    tokens.append((type(obj), obj))
    return obj


def local_address() -> str:
    """The address the other ranks reach this one at: where its route to the job's master (MASTER_ADDR) leaves
    from (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ.get("MASTER_ADDR") or "127.0.0.1", 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


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
        # the last snapshot's pickles and what they were made from: a snapshot of the same structure (every
        # step under one plan, but for values such as the optimizer's step count) reuses them
        self._pickled: Optional[Tuple[Any, Dict[str, Tuple[bytes, List[int]]]]] = None
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

    def stage(self, files: Dict[str, Any]) -> Tuple[Dict[str, Tuple[bytes, List[int]]], List[Tuple[int, int]]]:
        """Copy every tensor of `files` ({name: object}) into the shared buffer (the only work on the step's
        path) and pickle each file's structure around references to them; returns {name: (data.pkl, the
        tensors it refers to)} and each tensor's (offset, bytes) in the buffer, for `write`."""
        tensors: List[Any] = []
        tokens: List[Any] = []
        flat = flatten(files, tensors, tokens)
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self._ensure(total)
        layout, spans = [], []
        on_gpu = False
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            if n:
                # from a GPU: queued copies, one synchronisation below for all of them (not one per tensor);
                # into pinned memory where the buffer could be registered with CUDA, else staged by the driver
                on_gpu |= t.is_cuda
                self.buffer[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=t.is_cuda)
            layout.append((off, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
            spans.append((off, n))
        key = (tuple(tokens), tuple(layout))
        if self._pickled is not None and self._pickled[0] == key:
            pickles = self._pickled[1]  # the same structure, layout and values: the same bytes
        else:
            pickles = {name: data_pickle(obj, layout, TensorRef) for name, obj in flat.items()}
            self._pickled = (key, pickles)
        if on_gpu:
            import torch

            torch.cuda.synchronize()
        return pickles, spans

    def write(self, files: Dict[str, Tuple[bytes, List[int]]], spans: List[Tuple[int, int]],
              **job: Any) -> Dict[str, Any]:
        """Have the keeper write `files` (staged by `stage`); blocks until it answers (waiting on a pipe
        releases the GIL)."""
        req = {"op": "write", "buffer": self.path, "size": self.size, "tensors": spans, "files": files, **job}
        try:
            return self.request(req)
        finally:
            if not self._mapped and self.path and self.proc.poll() is None:
                os.unlink(self.path)  # both processes hold it mapped: nothing is left in /dev/shm if either dies
                self._mapped = True

    def request(self, req: Dict[str, Any]) -> Dict[str, Any]:
        """One request to the keeper and its answer (blocks; waiting on a pipe releases the GIL)."""
        try:
            pickle.dump(req, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
            reply = pickle.load(self.proc.stdout)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise RuntimeError(f"pdv.snapshots: the snapshot keeper (pid {self.proc.pid}) is gone "
                               f"(exit {self.proc.poll()})") from exc
        if "error" in reply:
            raise RuntimeError(f"pdv.snapshots: the snapshot keeper failed ({req['op']}): {reply['error']}")
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

    def close(self, grace: float = 10.0) -> None:
        """End the keeper: it finishes the request in hand within `grace` seconds, else it is killed (0: at
        once, for a snapshot abandoned because a peer is lost: its copy may wait on that peer)."""
        self.close_buffer()
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                if grace <= 0:
                    raise TimeoutError
                self.proc.wait(timeout=grace)
            except Exception:  # noqa: BLE001 - a keeper that will not leave is killed
                self.proc.kill()
                self.proc.wait()


# -------------------------------------------------------------------------------------------------------
# the keeper process
# -------------------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _enter_group(path: str, failed: str) -> bool:
    """Write 0 (the writer: the process into `cgroup.procs`, the thread into `tasks`) into `path`; False, with
    `failed` and the error on stderr, where that cannot be done."""
    try:
        with open(path, "w") as f:
            f.write("0")
        return True
    except OSError as exc:
        print(f"{failed} ({path}: {exc})", file=sys.stderr)
        return False


def _join_cgroup() -> None:
    procs = os.environ.get(CGROUP_ENV)
    if procs:
        _enter_group(procs, "pdv snapshot keeper: could not join its host's CPU group")


_THREAD_JOIN_FAILED = False


def join_host_cpu_thread() -> None:
    """Move the calling thread (a worker's snapshot thread) into its host's CPU group, where the emulator runs
    the keepers. Why: on a real host that thread's work (the keepers' requests, `meta.pt`, the seal, the
    barrier) runs on a host core beside the GPU, not on the device; under `pdv emulate` it ran under the
    device's CPU quota instead, so a slow device's snapshots cost its steps what a real one's would not (issue
    #37). cgroup v1 moves one thread through the group's `tasks`; v2 only within a threaded subtree, which
    the emulator's groups are not: there the thread stays (one line on stderr). Outside the emulator
    (no PDV_KEEPER_CGROUP) nothing happens."""
    global _THREAD_JOIN_FAILED
    procs = os.environ.get(CGROUP_ENV)
    if procs and not _THREAD_JOIN_FAILED:
        _THREAD_JOIN_FAILED = not _enter_group(os.path.join(os.path.dirname(procs), "tasks"),
                                               "pdv snapshots: the snapshot thread stays under the device's CPU quota")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"the sender left after {got} of {n} bytes")
        got += k
    return bytes(buf)


class Copies:
    """The copies other hosts' keepers send to this one (`listen`): each connection's files are written into
    this host's store as they come, and recorded by step and sender only once all of them are written whole
    (a sender lost mid-copy leaves nothing recorded, so nothing of it is ever sealed)."""

    def __init__(self, store: Any, token: str, timeout: float):
        self.store, self.token, self.timeout = store, token, timeout
        self.arrived: Dict[int, Dict[int, Dict[str, Any]]] = {}
        self.cond = threading.Condition()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="pdv-keeper-accept").start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._take, args=(conn,), daemon=True, name="pdv-keeper-copy").start()

    def _take(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.timeout)
                head = json.loads(_recv_exact(conn, int.from_bytes(_recv_exact(conn, 8), "little")).decode())
                if head.get("token") != self.token:
                    return  # not this job's keeper: nothing read, nothing written
                step, entries = int(head["step"]), {}
                for name, size in head["files"]:
                    entries[name] = self.store.write(step, name, _recv_exact(conn, int(size)))
                with self.cond:
                    self.arrived.setdefault(step, {})[int(head["sender"])] = entries
                    for old in [s for s in self.arrived if s < step - 8]:  # long collected or given up on
                        del self.arrived[old]
                    self.cond.notify_all()
                conn.sendall(b"k")
        except Exception as exc:  # noqa: BLE001 - a copy that did not come whole is simply not recorded
            print(f"pdv snapshot keeper: a copy from another host failed: {exc}", file=sys.stderr)

    def collect(self, step: int, senders: List[int], timeout: float, inp: Any) -> Dict[str, Any]:
        """The files of `step` from every rank of `senders`, once all have come; an error after `timeout`
        seconds, or when the worker closes the pipe (it gave the snapshot up)."""
        deadline = time.monotonic() + timeout
        want = {int(r) for r in senders}
        while True:
            with self.cond:
                have = self.arrived.get(step, {})
                if want <= set(have):
                    return {name: e for r in sorted(want) for name, e in have[r].items()}
                self.cond.wait(0.1)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the copies of step {step} from rank(s) {sorted(want - set(have))} did not "
                                   f"come within {timeout:g} s")
            if select.select([inp], [], [], 0)[0]:  # only the end of the pipe comes while a request is in hand
                raise EOFError("the worker closed the pipe")


#: the copies for other hosts are background traffic: DSCP CS1 ("lower effort", RFC 8622's neighbour), which a
#: network with QoS serves after the rest (`pdv emulate` does), and Linux's bulk priority on this host's queues
BACKGROUND_TOS = 0x20
TC_PRIO_BULK = 2


def background_socket(to: Tuple[str, int], timeout: float) -> socket.socket:
    """A TCP connection to `to` marked as background traffic (`BACKGROUND_TOS`). Why: a stage's copy is
    megabytes every step, and on a link it shares with the pipeline's activations an activation waited behind
    it (8 KB round trips 3.6 ms instead of 0.8 on the emulator's 100 Mbit/s link); marked, the link serves the
    activations first and the copy in the gaps. Where the marks cannot be set it goes unmarked."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, BACKGROUND_TOS)
        if hasattr(socket, "SO_PRIORITY"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, TC_PRIO_BULK)  # (after IP_TOS, which sets it)
    except OSError:
        pass
    sock.settimeout(timeout)
    try:
        sock.connect((to[0], int(to[1])))
    except BaseException:
        sock.close()
        raise
    return sock


def push(store: Any, step: int, names: List[str], to: Tuple[str, int], token: str, sender: int,
         timeout: float, written: Optional[Dict[Tuple[int, str], bytes]] = None) -> int:
    """Send the files `names` of `step` from this host's store to the keeper at `to` (from `written`, the
    bytes this keeper wrote last, where they are there); returns the bytes sent once it has written them."""
    written = written or {}
    blobs = [written[(step, name)] if (step, name) in written else store.read_raw(step, name) for name in names]
    head = json.dumps({"token": token, "step": int(step), "sender": int(sender),
                       "files": [[n, len(b)] for n, b in zip(names, blobs)]}).encode()
    with background_socket(to, timeout) as sock:
        sock.sendall(len(head).to_bytes(8, "little") + head)
        for b in blobs:
            sock.sendall(b)
        if _recv_exact(sock, 1) != b"k":
            raise ConnectionError(f"the keeper at {to[0]}:{to[1]} did not confirm the copy of step {step}")
    return sum(len(b) for b in blobs)


def _serve(inp: Any, out: Any) -> None:
    from .store import HostStore

    maps: Dict[Tuple[str, int], Any] = {}
    written: Dict[Tuple[int, str], bytes] = {}  # the last write's files, for its push (not read back)
    copies: Optional[Copies] = None
    while True:
        try:
            req = pickle.load(inp)
        except EOFError:
            return
        try:
            op = req.get("op", "write")
            if op == "listen":
                if copies is None:
                    copies = Copies(HostStore(req["root"], req["job"], req["host"]), req["token"],
                                    float(req["timeout"]))
                reply = {"port": copies.port}
            elif op == "push":
                t0 = time.perf_counter()
                n = push(HostStore(req["root"], req["job"], req["host"]), int(req["step"]), list(req["names"]),
                         tuple(req["to"]), req["token"], int(req["sender"]), float(req["timeout"]), written)
                reply = {"bytes": n, "push_s": time.perf_counter() - t0}
            elif op == "collect":
                if copies is None:
                    raise RuntimeError("collect before listen")
                reply = {"sealed": copies.collect(int(req["step"]), list(req["senders"]), float(req["timeout"]),
                                                  inp)}
            else:
                reply = _write(req, maps, HostStore, written)
        except EOFError:
            return
        except Exception:  # noqa: BLE001 - every failure goes back to the worker, which raises it
            reply = {"error": traceback.format_exc(limit=4)}
        pickle.dump(reply, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()


def _write(req: Dict[str, Any], maps: Dict[Tuple[str, int], Any], HostStore: Any,
           written: Dict[Tuple[int, str], bytes]) -> Dict[str, Any]:
    """The `write` request: each file made from its pickle and its tensors' bytes in the shared buffer, then
    written; the files are kept in `written` (until the next write) for the copy to the other host."""
    key = (req["buffer"], req["size"])
    if key not in maps:
        for old in maps.values():
            old.close()
        maps.clear()
        with open(req["buffer"], "r+b") as f:
            maps[key] = mmap.mmap(f.fileno(), int(req["size"]))
    view = memoryview(maps[key])
    t0 = time.perf_counter()
    spans = req["tensors"]
    try:
        blobs = {name: archive(pkl, [(i, view[spans[i][0]:spans[i][0] + spans[i][1]]) for i in used])
                 for name, (pkl, used) in req["files"].items()}
    finally:
        view.release()
    t1 = time.perf_counter()
    sealed = {}
    written.clear()
    if req["write"]:
        store = HostStore(req["root"], req["job"], req["host"])
        for name in sorted(blobs):
            sealed[name] = store.write(req["step"], name, blobs[name])
            written[(int(req["step"]), name)] = blobs[name]
            if req.get("only_first"):
                break
    return {"sealed": sealed, "serialize_s": t1 - t0, "write_s": time.perf_counter() - t1}


def main() -> None:
    _die_with_parent()
    _join_cgroup()
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    _serve(inp, out)


if __name__ == "__main__":
    main()
