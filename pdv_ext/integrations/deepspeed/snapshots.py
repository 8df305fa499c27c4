"""In-memory snapshots of a running pipeline, and the resume from them under the survivors' plan (issue #37).

A snapshot is the layer-keyed checkpoint form (checkpoint.py: one file per layer, `meta.pt`) written into each
host's memory (`recovery.HostStore`) instead of a disk folder, so any plan over the same layers loads it:

- every stage's layer files go to each host that runs one of its replicas (written by the replica with the
  lowest data-parallel index there); a stage whose replicas all run on one host sends its files to a rank
  on the next host as well (the hosts in name order, cyclically): with two hosts or more, every layer is on
  two. `meta.pt` is written on every host.
- a rank seals what it wrote; a step counts only when sealed and whole (a rank killed mid-snapshot leaves
  an incomplete step, never a wrong one); after every rank is done the older steps are dropped (`keep`).

`resume(engine, store)` (collective, at start-up): the hosts' listings are gathered, the newest step whose
files are all somewhere among them is chosen, each rank fetches the files of its stage it lacks from a rank
that has them (checked against their sha256), and the layer-keyed loader restores them into this engine,
whatever its plan. Nothing left that covers every layer: one `SnapshotLost` error naming the lost files.
"""
from __future__ import annotations

import io
import os
import re
import shutil
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...recovery.store import HostStore, SnapshotLost, missing_files, newest_complete, tag_of
from .checkpoint import load_layer_checkpoint, meta_of, stage_layer_entries
from .safe_io import check_plain
from .topology import current_mapping


def shared_rendezvous_store() -> bool:
    """Whether torchrun runs these workers on its shared rendezvous store (TORCHELASTIC_USE_AGENT_STORE, unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): the store outlives a restart, and the restarted workers read the
    last attempt's gloo / NCCL addresses from it (seen with torch 2.13: "connectFullMesh failed ... Connection
    refused" to the dead workers' ports)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
        os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"


#: fault injection, for the tests of "a rank killed during a snapshot / a recovery": `PHASE@STEP:RANK` makes that
#: rank's process exit abruptly (os._exit, no clean-up) when its snapshot of STEP reaches PHASE, in the job's
#: first start (TORCHELASTIC_RESTART_COUNT 0); `resume@STEP:RANK` in the first restart's resume of STEP
FAULT_ENV = "PDV_SNAPSHOT_FAULT"
FAULT_PHASES = ("serialize", "write", "send", "seal", "prune", "resume")
FAULT_EXIT = 17


def _fault(phase: str, step: int, rank: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    m = re.fullmatch(r"(\w+)@(\d+):(\d+)", spec.strip())
    if m is None or m.group(1) not in FAULT_PHASES:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected PHASE@STEP:RANK, PHASE one of {', '.join(FAULT_PHASES)}")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if (m.group(1), int(m.group(2)), int(m.group(3)), attempt) == (phase, step, rank, int(phase == "resume")):
        os._exit(FAULT_EXIT)


def _bytes(obj: Any, what: str) -> bytes:
    check_plain(obj, what)
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _hosts(store: HostStore) -> List[str]:
    """Every rank's host, by global rank (one small all-gather)."""
    hosts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, store.host)
    return [str(h) for h in hosts]


def _send(data: bytes, dst: int, group: Any = None) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def _recv(src: int, group: Any = None) -> bytes:
    n = torch.empty(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()


def _copied(obj: Any) -> Any:
    """`obj` with every tensor copied to the CPU (lists, tuples and dicts rebuilt): what a background write
    reads while the training thread updates the weights and optimizer state in place."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj


def plan_writers(mapping: List[List[int]], hosts: List[str]) -> Tuple[Dict[int, List[int]], Dict[int, Tuple[int, int]]]:
    """({stage: ranks that write its layer files on their own host}, {stage: (sender, receiver)} for a stage whose
    replicas all run on one host: its replica-0 rank sends the files to the lowest rank of the next host)."""
    names = sorted(set(hosts))
    writers: Dict[int, List[int]] = {}
    buddies: Dict[int, Tuple[int, int]] = {}
    for s, ranks in enumerate(mapping):
        seen: Dict[str, int] = {}
        for r in ranks:  # data-parallel order: the lowest replica on each host writes there
            seen.setdefault(hosts[r], r)
        writers[s] = list(seen.values())
        if len(seen) == 1 and len(names) > 1:
            nxt = names[(names.index(hosts[ranks[0]]) + 1) % len(names)]
            buddies[s] = (ranks[0], min(r for r, h in enumerate(hosts) if h == nxt))
    return writers, buddies


class Snapshots:
    """A job's snapshots as this rank sees them (`engine.pdv_snapshots`): `take(engine)` after a step,
    `resume(engine)` at start-up. Holds no engine (a move swaps the engine's state for a new one's)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.store = HostStore(cfg.root_dir(), cfg.job_name())
        self.hosts = _hosts(self.store)  # collective: every rank builds its engine at once
        self.last: Dict[str, float] = {}
        # the writing half of a snapshot runs on a thread of its own, over a process group of its own (the
        # step's collectives go on meanwhile on the engine's); one snapshot in flight at a time
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.timeout)) if cfg.background
                       else None)  # a peer that died mid-snapshot fails the thread's wait, not holds it for good
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.resumed: Dict[str, float] = {}  # the last resume: its step and seconds

    def due(self, engine: Any) -> bool:
        return engine.global_steps > 0 and engine.global_steps % self.cfg.every == 0

    def _host_leader(self, rank: int) -> bool:
        return rank == min(r for r, h in enumerate(self.hosts) if h == self.store.host)

    def wait(self) -> None:
        """Finish the snapshot in flight, if any (its error, if it failed, is raised here)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"pdv.snapshots: the snapshot in the background failed: {err}") from err

    def take(self, eng: Any) -> Dict[str, float]:
        """Snapshot the engine's state at its current step (collective). What the state is gets settled here,
        on every rank (a copy of it where the writing runs in the background, `background`: default); the
        bytes are written, sent and sealed by a thread while training goes on. Returns this rank's figures of
        the previous snapshot (seconds and their parts, bytes written)."""
        self.wait()
        t0 = time.perf_counter()
        step, rank = int(eng.global_steps), int(eng.global_rank)
        mapping = current_mapping(eng.module)
        by_layer, pdv, whole = stage_layer_entries(eng)
        layers: List[Any] = [None] * dist.get_world_size()  # every layer file a complete step has
        dist.all_gather_object(layers, sorted(by_layer))
        expected = {f"layer_{i:02d}.pt" for ls in layers for i in ls} | {"meta.pt"}
        meta: List[Any] = [meta_of(eng, pdv, whole) if mapping[0][0] == rank else None]
        dist.broadcast_object_list(meta, src=mapping[0][0])
        writers, buddies = plan_writers(mapping, self.hosts)
        sends = rank in writers[eng.stage_id] or any(src == rank for src, _ in buddies.values())
        entries = by_layer if sends else {}
        meta_obj = meta[0] if self._host_leader(rank) else None
        job = dict(step=step, rank=rank, entries=entries, meta=meta_obj, writes=rank in writers[eng.stage_id],
                   buddies=buddies, expected=expected, t0=t0)
        if self._group is None:
            self._write(**job, t_collect=time.perf_counter(), group=None)
            return self.last
        job["entries"], job["meta"] = _copied(entries), _copied(meta_obj)  # training moves on meanwhile
        job.update(t_collect=time.perf_counter(), group=self._group)
        # a daemon thread: a process that ends (or dies) with a snapshot in flight is not held up by it; the
        # unfinished step is never sealed everywhere, so a resume takes the one before
        self._thread = threading.Thread(target=self._run, kwargs=job, name="pdv-snapshot", daemon=True)
        self._thread.start()
        return self.last

    def _run(self, **job: Any) -> None:
        try:
            self._write(**job)
        except BaseException as exc:  # raised in the training thread at the next take / wait
            self._error = exc

    def _write(self, step: int, rank: int, entries: Dict[int, Any], meta: Any, writes: bool,
               buddies: Dict[int, Tuple[int, int]], expected: Any, t0: float, t_collect: float,
               group: Any) -> None:
        """The writing half: bytes, this host's files, the copies for the next host, the seal, then (every rank
        sealed) the older steps dropped."""
        store = self.store
        _fault("serialize", step, rank)
        files = {f"layer_{i:02d}.pt": _bytes(e, f"layer {i}") for i, e in sorted(entries.items())}
        t_serialize = time.perf_counter()
        sealed: Dict[str, Dict[str, object]] = {}
        if writes:
            for name, data in files.items():
                sealed[name] = store.write(step, name, data)
                _fault("write", step, rank)  # one file written, the others not
        if meta is not None:  # meta on every host
            sealed["meta.pt"] = store.write(step, "meta.pt", _bytes(meta, "meta"))
        t_write = time.perf_counter()
        _fault("send", step, rank)
        for s, (src, dst) in sorted(buddies.items()):  # the same order on every rank: no send waits on another
            if rank == src:
                for name in sorted(files):
                    _send(name.encode(), dst, group)
                    _send(files[name], dst, group)
                _send(b"", dst, group)
            elif rank == dst:
                while True:
                    name = _recv(src, group).decode()
                    if not name:
                        break
                    sealed[name] = store.write(step, name, _recv(src, group))
        t_send = time.perf_counter()
        _fault("seal", step, rank)
        if sealed:
            store.seal(step, rank, sealed, expected)
        dist.barrier(group=group)  # every rank sealed this step: the older ones can go
        _fault("prune", step, rank)
        if self._host_leader(rank):
            store.prune(self.cfg.keep)
        end = time.perf_counter()
        self.last = {"seconds": end - t0, "bytes": float(sum(int(e["bytes"]) for e in sealed.values())),
                     # where the time went: gathering the stage's state (and the layer list, the meta; a copy
                     # of it in the background mode), turning it into bytes, writing it, sending the copies,
                     # sealing and waiting for the others (in the background mode all but the first off the
                     # step's critical path)
                     "collect_s": t_collect - t0, "serialize_s": t_serialize - t_collect,
                     "write_s": t_write - t_serialize, "send_s": t_send - t_write, "seal_wait_s": end - t_send}

    def discard(self, eng: Any) -> None:
        """Remove this job's snapshots from every host's memory (collective; at the end of training: they are
        for restarts, and a tmpfs holds them in RAM)."""
        self.wait()
        dist.barrier()
        if self._host_leader(int(eng.global_rank)):
            shutil.rmtree(self.store.base, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(self.store.base))  # the job's folder, once no host is left in it
            except OSError:
                pass
        dist.barrier()

    def resume(self, eng: Any) -> Optional[int]:
        """Restore the newest step every file of which survives on some host into `eng` (collective, any plan
        over the same layers). Returns the step, None when no host has any snapshot of this job."""
        self.wait()
        t0 = time.perf_counter()
        store = self.store
        rank = int(eng.global_rank)
        listings: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(listings, (store.host, store.complete()))
        by_host = {h: lst for h, lst in listings}
        if not any(by_host.values()):
            return None
        step = newest_complete(by_host)
        if step is None:
            lost = missing_files(by_host)
            newest = max(lost)
            raise SnapshotLost([f"snapshots: no step survives whole on the hosts left ({', '.join(sorted(by_host))}); "
                                f"the newest, step {newest}, lost {', '.join(lost[newest])}: resume from your newest "
                                f"disk checkpoint (engine.load_checkpoint)"])
        _fault("resume", step, rank)
        module = eng.module
        start, stop = module.parts[eng.stage_id], module.parts[eng.stage_id + 1]
        need_by_rank: List[Any] = [None] * dist.get_world_size()
        mine = {"meta.pt"} | {f"layer_{i:02d}.pt" for i in range(start, stop)}
        dist.all_gather_object(need_by_rank, sorted(mine))
        holders: Dict[str, List[int]] = {}  # file -> ranks whose host has it, lowest first
        shas: Dict[str, str] = {}
        for r, (h, lst) in enumerate(listings):
            for name, sha in (lst.get(step) or {}).get("files", {}).items():
                holders.setdefault(name, []).append(r)
                shas.setdefault(name, sha)
        local = set((store.complete().get(step) or {}).get("files", {}))
        for r in range(dist.get_world_size()):  # fetch what each rank's host lacks, in one global order
            host_r = listings[r][0]
            have_r = set((by_host.get(host_r, {}).get(step) or {}).get("files", {}))
            for name in need_by_rank[r]:
                if name in have_r or name not in holders:
                    continue
                src = holders[name][0]
                if rank == src:
                    _send(store.read(step, name, shas[name]), r)
                elif rank == r:
                    data = _recv(src)
                    if name not in local:
                        entry = store.write(step, name, data)
                        if entry["sha256"] != shas[name]:
                            raise SnapshotLost([f"snapshots: {name} of step {step} arrived damaged from rank {src}"])
                        store.seal(step, rank, {name: entry}, [], label=f"-fetched-{name}")
                        local.add(name)
        files = (store.complete().get(step) or {}).get("files", {})
        for name in sorted(mine & set(files)):  # what this rank will load: checked before the loader reads it
            store.read(step, name, files[name])
        load_layer_checkpoint(eng, store.base, tag_of(step))
        dist.barrier()
        self.resumed = {"step": float(step), "seconds": time.perf_counter() - t0}
        return step
