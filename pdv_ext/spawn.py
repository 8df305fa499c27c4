"""Start N local ranks of a Python function — for tests, benchmarks and tools.

Each rank is a fresh interpreter (`python -m pdv_ext.spawn`) in its own process group with the
environment a launcher gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port).
The function's return value comes back pickled. A hard timeout kills every rank's whole process
group, so nothing is left behind even when a rank hangs in a collective.
"""
from __future__ import annotations

import glob
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .registry import load_object
from .source_tree import jit_cache_dir


class RankFailed(RuntimeError):
    """A rank exited non-zero or the run timed out; the message holds each failing rank's output tail."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_distributed(barrier: bool = True) -> None:
    """Leave torch.distributed cleanly: a barrier (no rank tears its gloo pairs down while a peer is still
    finishing the last collective), then destroy every process group while the interpreter is fully alive.
    Seen without it: a rank aborting with "terminate called without an active exception" (SIGABRT) on its way
    out, which a launcher reports as a failed run. Never raises: a finished rank must not fail on teardown."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if barrier:
            try:
                dist.barrier()
            except Exception:  # a peer already gone: still destroy our side
                pass
        dist.destroy_process_group()
    except Exception:
        pass


def default_env() -> Dict[str, str]:
    """Environment for CPU ranks: one thread each (ranks share 2 cores), the CPU accelerator, the
    JIT-extension cache (the checkout's build/, or whatever TORCH_EXTENSIONS_DIR says; an installed
    package leaves it to torch's default)."""
    env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "PYTHONUNBUFFERED": "1",
    }
    cache = jit_cache_dir()
    if cache:
        env["TORCH_EXTENSIONS_DIR"] = cache
    return env


#: DeepSpeed's CPU all-reduce workspace (its shm comm op, csrc/cpu/comm/shm.cpp, where every rank is local): one
#: file of ~69 MB per rank in /dev/shm, `<this>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`, that it never unlinks
SHM_WORKSPACE_PREFIX = "deepspeed_allreduce_buffer"


def remove_deepspeed_shm(port: int, rank: Optional[int] = None, shm_dir: str = "/dev/shm") -> List[str]:
    """Remove the shared-memory workspaces DeepSpeed's CPU all-reduce (its shm comm op) made for the job whose
    rendezvous port is `port`: one of ~69 MB per rank in /dev/shm, which DeepSpeed never unlinks (a day of
    test runs left 8 GB of host memory there). The name holds the address as DeepSpeed resolved it
    (127.0.0.1 for MASTER_ADDR=localhost), so any address matches. Every rank's (call it once every rank of
    that job is gone), or only `rank`'s (what a live rank does for itself, see
    `internals.release_shm_workspace`). Returns the paths removed."""
    which = "*" if rank is None else str(int(rank))
    pattern = os.path.join(shm_dir, f"{SHM_WORKSPACE_PREFIX}_{os.getuid()}_*_{int(port)}_{which}")
    removed = []
    for path in glob.glob(pattern):
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def kill_matching(marker: str) -> None:
    """SIGKILL every process whose command line holds `marker` (e.g. a job's unique output folder): what
    torchrun's agent started sits in sessions of its own, out of reach of the agent's process group."""
    import psutil

    for _ in range(3):  # again, for anything started while the first ones died
        for q in psutil.process_iter(["cmdline"]):
            if marker in " ".join(q.info["cmdline"] or []) and q.pid != os.getpid():
                try:
                    q.kill()
                except psutil.Error:
                    pass


def run_ranks(target: str, world_size: int, kwargs: Optional[Dict[str, Any]] = None, timeout: float = 120.0,
              env: Optional[Dict[str, str]] = None, per_rank_env: Optional[Sequence[Dict[str, str]]] = None,
              quiet: bool = True) -> List[Any]:
    """Run `target` ("module:function", called as `fn(**kwargs)`) on `world_size` ranks; return the
    per-rank results. torch.distributed is *not* initialised for you (DeepSpeed does it; or call
    `init_torch_distributed()`).

    A free port can be taken by another process between `free_port()` and rank 0's store listening on it
    (seen with tests in parallel: EADDRINUSE); the ranks then fail before any collective, and the run is
    started again on another port (at most `PORT_TRIES` times)."""
    for attempt in range(PORT_TRIES):
        try:
            return _run_ranks_once(target, world_size, kwargs, timeout, env, per_rank_env, quiet, free_port())
        except RankFailed as e:
            if not _port_taken(str(e)) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


PORT_TRIES = 3


def _port_taken(failure: str) -> bool:
    """Whether a failed run's rank logs show its rendezvous port taken by someone else."""
    return "EADDRINUSE" in failure or "address already in use" in failure.lower()


def _run_ranks_once(target: str, world_size: int, kwargs: Optional[Dict[str, Any]], timeout: float,
                    env: Optional[Dict[str, str]], per_rank_env: Optional[Sequence[Dict[str, str]]], quiet: bool,
                    port: int) -> List[Any]:
    with tempfile.TemporaryDirectory(prefix="pdv-ranks-") as tmp:
        with open(os.path.join(tmp, "kwargs.pkl"), "wb") as f:
            pickle.dump(kwargs or {}, f)
        procs, logs = [], []
        base = {**os.environ, **default_env(), **(env or {})}
        try:
            for r in range(world_size):
                e = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                     "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     **((per_rank_env or [{}] * world_size)[r])}
                log = open(os.path.join(tmp, f"rank{r}.log"), "w+b")
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pdv_ext.spawn", target, tmp, str(r)], env=e,
                    stdout=log if quiet else None, stderr=subprocess.STDOUT if quiet else None,
                    start_new_session=True))
            deadline = time.monotonic() + timeout
            failed = None
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    failed = f"timed out after {timeout:.0f}s"
                    break
                bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                if bad:  # one rank died: the others would wait forever in a collective
                    time.sleep(1.0)
                    failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
                    break
                time.sleep(0.05)
            if failed is None:
                bad = [i for i, p in enumerate(procs) if p.returncode != 0]
                if bad:
                    failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
            if failed:
                raise RankFailed(f"{target} on {world_size} ranks: {failed}\n" + _tails(logs))
            results = []
            for r in range(world_size):
                with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
            return results
        finally:
            for p in procs:
                kill_group(p)
            for log in logs:
                log.close()
            remove_deepspeed_shm(port)


def run_command(cmd: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 600.0,
                tail_lines: int = 30) -> "tuple[Optional[int], str]":
    """Run a launcher command (horovodrun, mpirun, deepspeed ...) in its own session with a hard timeout,
    then kill whatever of its process tree is left. Returns (exit code, or None on timeout; the last
    `tail_lines` lines of its combined output)."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(list(cmd), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc)
        log.seek(0)
        return rc, "\n".join(log.read().decode(errors="replace").splitlines()[-tail_lines:])


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a process started with start_new_session=True and everything it started (descendants that
    moved to other sessions, such as MPI daemons, included)."""
    try:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # psutil missing or the leader already gone
        pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:  # children may outlive the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tails(logs: List[Any], lines: int = 25) -> str:
    out = []
    for r, log in enumerate(logs):
        log.flush()
        log.seek(0)
        text = log.read().decode(errors="replace").splitlines()
        if text:
            out.append(f"--- rank {r} (last {lines} lines) ---\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


def init_torch_distributed(backend: Optional[str] = None) -> None:
    """init_process_group from the launcher environment (gloo on CPU, nccl when CUDA is there)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend)


def _worker(target: str, tmp: str, rank: str) -> None:
    with open(os.path.join(tmp, "kwargs.pkl"), "rb") as f:
        kwargs = pickle.load(f)
    result = load_object(target)(**kwargs)
    with open(os.path.join(tmp, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    shutdown_distributed()
    # the rank's work is done and its result on disk: leave without the interpreter's finalisation, where a
    # process group's C++ threads could still be destroyed joinable ("terminate called without an active
    # exception", SIGABRT: seen once in CI on a rank that had returned its result, a snapshot group alive)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
