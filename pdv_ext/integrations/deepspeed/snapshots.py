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
import json
import math
import os
import secrets
import shutil
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...comm.torch_comm import interrupted
from ...recovery import injected
from ...recovery.keeper import Keeper, join_host_cpu_thread, local_address
from ...recovery.store import (HostStore, SnapshotLost, generation_of, missing_files, newest_complete,
                               newest_generation, step_entries, tag_of)
from .checkpoint import load_layer_checkpoint, meta_of, stage_layer_entries
from .layer_state import collect_is_collective
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


def _faulty(phase: str, step: int, rank: int) -> bool:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return injected.fires(FAULT_ENV, FAULT_PHASES, phase, rank, step) and attempt == int(phase == "resume")


def _fault(phase: str, step: int, rank: int) -> None:
    if _faulty(phase, step, rank):
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


def pack_files(files: Dict[str, bytes]) -> bytes:
    """Files as one message: an 8-byte header length, a JSON header of [name, size] pairs, the bytes in order."""
    head = json.dumps([[name, len(data)] for name, data in files.items()]).encode()
    return b"".join([len(head).to_bytes(8, "little"), head, *files.values()])


def unpack_files(blob: bytes) -> Dict[str, bytes]:
    n = int.from_bytes(blob[:8], "little")
    out, at = {}, 8 + n
    for name, size in json.loads(blob[8:at].decode()):
        out[name], at = blob[at:at + size], at + size
    if at != len(blob):
        raise ValueError(f"a snapshot copy of {len(blob)} bytes does not match its header ({at})")
    return out


def exchange(outgoing: Dict[int, bytes], incoming: List[int], group: Any = None) -> Dict[int, bytes]:
    """Send each {rank: message} and receive one message from each rank of `incoming`, all at once: a rank that
    sends its stage's copy to another host and receives that host's copy does both at the same time (the link
    carries both directions at once; one after the other took twice as long). Sizes first, then the bytes."""
    works = []
    for dst, data in sorted(outgoing.items()):
        works.append(dist.isend(torch.tensor([len(data)], dtype=torch.int64), dst, group=group))
        if data:
            works.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group))
    sizes = {src: torch.empty(1, dtype=torch.int64) for src in incoming}
    for src in sorted(incoming):
        dist.irecv(sizes[src], src, group=group).wait()
    bufs = {src: torch.empty(int(sizes[src].item()), dtype=torch.uint8) for src in incoming}
    works += [dist.irecv(bufs[src], src, group=group) for src in sorted(incoming) if bufs[src].numel()]
    for w in works:
        w.wait()
    return {src: bufs[src].numpy().tobytes() for src in incoming}


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


def auto_interval(snapshot_s: float, step_s: float, max_every: int) -> int:
    """(every: auto) Steps from one snapshot to the next: its time over a step's, a quarter to spare, at
    least 1 (no step timed yet: 1), at most `max_every`."""
    if step_s <= 0.0:
        return 1
    return int(min(max_every, max(1, math.ceil(1.25 * snapshot_s / step_s))))


def participants_of(writers: Dict[int, List[int]], buddies: Dict[int, Tuple[int, int]], meta_src: int) -> List[int]:
    """The ranks that take part in a snapshot: every writer, every receiver of a copy, meta.pt's maker."""
    return sorted({r for ws in writers.values() for r in ws} | {d for _, d in buddies.values()} | {meta_src})


class _Plan:
    """Who does what in a snapshot under one plan (the same on every rank): the files a complete step has,
    each stage's writers, the copies for another host, the rank that makes `meta.pt` and one writer per host
    that stores it; the participants (every rank that writes, sends or receives) and their own process
    group (gloo for the background thread; the default backend for a snapshot inside the step). The other
    ranks take no part in the writing: their stage's files come from a replica on the same host."""

    def __init__(self, key: Any, expected: Any, writers: Dict[int, List[int]], buddies: Dict[int, Tuple[int, int]],
                 meta_src: int, meta_writers: List[int], gathers: bool, groups: Any):
        self.key, self.expected, self.writers, self.buddies = key, expected, writers, buddies
        self.meta_src, self.meta_writers, self.gathers = meta_src, set(meta_writers), gathers
        self.participants = participants_of(writers, buddies, meta_src)
        self.group = groups(self.participants)
        #: (background) {receiving rank: (address, port, token)} of its keeper, which takes the copies for
        #: another host straight from the senders' keepers (Snapshots._keeper_addresses); None: the ranks copy
        self.keepers: Optional[Dict[int, Tuple[str, int, str]]] = None

    @classmethod
    def make(cls, key: Any, mapping: List[List[int]], hosts: List[str], by_layer: Dict[int, Any],
             collective: bool, groups: Any) -> "_Plan":
        """(collective) `collective`: gathering this stage's entries is a collective of its replicas (every
        replica calls it at every snapshot); so is any gather of the replicas' own parts, seen in `by_layer`."""
        layers: List[Any] = [None] * dist.get_world_size()
        mine = (sorted(by_layer), any(len(e.get("replicas", [None])) > 1 for ents in by_layer.values()
                                      for e in ents.values()))
        dist.all_gather_object(layers, mine)
        expected = {f"layer_{i:02d}.pt" for ls, _ in layers for i in ls} | {"meta.pt"}
        writers, buddies = plan_writers(mapping, hosts)
        every_writer = sorted({r for ws in writers.values() for r in ws})
        meta_writers = [min(r for r in every_writer if hosts[r] == h) for h in sorted({hosts[r] for r in every_writer})]
        return cls(key, expected, writers, buddies, mapping[0][0], meta_writers,
                   collective or any(g for _, g in layers), groups)


class InterruptedWait(RuntimeError):
    """A wait for the snapshot in flight given up because a peer was lost: in-place recovery takes it for a
    lost peer (its words say so)."""


class Snapshots:
    """A job's snapshots as this rank sees them (`engine.pdv_snapshots`): `take(engine)` after a step,
    `resume(engine)` at start-up. Holds no engine (a move swaps the engine's state for a new one's)."""

    def __init__(self, cfg: Any, engine: Any = None):
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
        # set by `abandon` (in-place recovery): the snapshot in flight, if any, seals nothing after that
        self._abandoned = False
        self._seal_lock = threading.Lock()
        injected.faults(FAULT_ENV, FAULT_PHASES, with_step=True)  # a bad fault spec: said now, not mid-snapshot
        self.resumed: Dict[str, float] = {}  # the last resume: its step and seconds
        #: what this job's seals carry (recovery/store.py): 0, then one more than the newest seen at each resume
        self.generation = 0
        self._plan: Optional[_Plan] = None  # who does what under the current plan (made at its first snapshot)
        self._token = secrets.token_hex(16)  # what a sender's keeper shows this rank's keeper with each copy
        # the process that writes this rank's files (background mode): started below, on a rank the engine's
        # plan has work for, so that its imports overlap the engine's start-up instead of holding up the first
        # snapshot; started later if a plan needs it, closed on a rank that no longer takes part
        self._keeper: Optional[Keeper] = None
        # every: auto: the next snapshot's step, and the interval every rank agreed on at the end of the last one
        self.next_due, self.interval = 1, 1
        self._last_take: Optional[Tuple[int, float]] = None
        self.taken_step: Optional[int] = None  # the step of the last snapshot (every rank takes it, writer or not)
        # the participants' process groups, by participants: made now for the engine's plan (collective, at
        # start-up, not at the first snapshot of a running job), later for a plan a move brings
        self._part_groups: Dict[Tuple[int, ...], Any] = {}
        participants = None
        if engine is not None:
            mapping = current_mapping(engine.module)
            writers, buddies = plan_writers(mapping, self.hosts)
            participants = participants_of(writers, buddies, mapping[0][0])
            self._groups_for(participants)
        if cfg.background and (participants is None or dist.get_rank() in participants):
            self._keeper = Keeper()  # only where the plan has work for it: a keeper's start costs a second of CPU

    def _groups_for(self, participants: List[int]) -> Any:
        """The process group of `participants` for this mode: gloo with the snapshot timeout for the
        background thread, the default backend inside the step (collective the first time: every rank asks
        for the same participants at the same point)."""
        key = tuple(participants)
        if key not in self._part_groups:
            self._part_groups[key] = (dist.new_group(participants, backend="gloo",
                                                     timeout=timedelta(seconds=self.cfg.timeout))
                                      if self.cfg.background else dist.new_group(participants))
        return self._part_groups[key]

    def _keeper_addresses(self, plan: "_Plan", rank: int) -> Optional[Dict[int, Tuple[str, int, str]]]:
        """(collective, background mode) Each rank that receives a copy for another host has its keeper
        listen for it; every rank learns where (one all-gather). None inside the step (`background: false`)."""
        if self._group is None:
            return None
        mine = None
        if any(dst == rank for _, dst in plan.buddies.values()):
            if self._keeper is None:
                self._keeper = Keeper()
            port = self._keeper.request({"op": "listen", "root": self.store.root, "job": self.store.job,
                                         "host": self.store.host, "token": self._token,
                                         "timeout": float(self.cfg.timeout)})["port"]
            mine = (local_address(), int(port), self._token)
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return {r: tuple(a) for r, a in enumerate(every) if a is not None}

    def due(self, engine: Any) -> bool:
        if self.cfg.every == "auto":
            return engine.global_steps > 0 and engine.global_steps >= self.next_due
        return engine.global_steps > 0 and engine.global_steps % self.cfg.every == 0

    def _step_seconds(self, step: int, now: float) -> float:
        """Seconds a training step took since the last snapshot was handed to its thread, before any wait
        for it (this rank's clock; 'auto' agrees on the largest). A wait counted in would make the interval
        that caused it look long enough."""
        prev = self._last_take
        if prev is None or step <= prev[0]:
            return 0.0
        return (now - prev[1]) / (step - prev[0])

    def _host_leader(self, rank: int) -> bool:
        return rank == min(r for r, h in enumerate(self.hosts) if h == self.store.host)

    def wait(self) -> None:
        """Finish the snapshot in flight, if any (its error, if it failed, is raised here)."""
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(0.1)
                # in-place recovery said a peer is lost or a recovery began (torch_comm.set_interrupt): give up
                # instead of waiting on a thread that may wait on the lost peer (or on a live one's silence)
                if interrupted() and self._thread.is_alive():
                    raise InterruptedWait("pdv.snapshots: a peer was lost (or a recovery began) while this rank "
                                          "waited for the snapshot in flight")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"pdv.snapshots: the snapshot in the background failed: {err}") from err

    def wait_sealed(self, step: int, timeout: float = 60.0) -> bool:
        """Finish the snapshot in flight and wait until every rank of this host that writes files of `step`
        has sealed them: True when they did within `timeout` seconds. For a fault placed right after a
        snapshot (`--crash-at`, the recovery tests): a rank whose replica writes its stage's files takes no
        part in the writing and goes on at once, while the writers' keepers may still be at it; a device lost
        then costs the step (the resume takes the one before, as it should). False at once where no snapshot
        of `step` was taken."""
        self.wait()
        plan = self._plan
        if plan is None or self.taken_step != int(step):
            return False  # no snapshot of that step was taken (not due then): nothing to wait for
        sealers = ({r for ws in plan.writers.values() for r in ws} | {d for _, d in plan.buddies.values()}
                   | plan.meta_writers)
        here = {r for r in sealers if self.hosts[r] == self.store.host}
        deadline = time.monotonic() + timeout
        while True:
            if here <= self.store.sealed_by(step):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def take(self, eng: Any) -> Dict[str, float]:
        """Snapshot the engine's state at its current step (collective). What the state is gets settled here,
        on every rank (a copy of it where the writing runs in the background, `background`: default); the
        bytes are written, sent and sealed by a thread while training goes on. Returns this rank's figures of
        the previous snapshot (seconds and their parts, bytes written).

        On the step's path only: this stage's entries and their copy into the keeper's buffer, on the ranks
        that write or send them (`_Plan.participants`), and `meta.pt`'s bytes on the rank that makes them.
        Which files a complete step has, who writes them and who takes part is worked out once per plan (one
        all-gather); the other ranks (the replicas whose files another replica writes) do nothing more."""
        step, rank = int(eng.global_steps), int(eng.global_rank)
        step_s = self._step_seconds(step, time.perf_counter())  # training alone: before this wait
        self.wait()
        t0 = time.perf_counter()
        self.taken_step = step
        self.next_due = step + self.interval  # (every: auto) the interval the last snapshot's end agreed on
        mapping = current_mapping(eng.module)
        key = (tuple(tuple(r) for r in mapping), tuple(int(p) for p in eng.module.parts),
               type(eng.aggregator).__name__)
        # in the background the keeper's buffer takes the one copy (below, before the step goes on), so the
        # entries can be the live tensors; inside the step they are serialized as they are (torch.save of a
        # view writes its whole storage), so copies
        plan = self._plan
        if plan is None or plan.key != key:
            by_layer, pdv, whole = stage_layer_entries(eng, copy=self._group is None)
            plan = self._plan = _Plan.make(key, mapping, self.hosts, by_layer, collect_is_collective(eng),
                                           self._groups_for)
            plan.keepers = self._keeper_addresses(plan, rank)
        elif rank in plan.participants or plan.gathers:  # (the gather: collective over the stage's replicas)
            by_layer, pdv, whole = stage_layer_entries(eng, copy=self._group is None)
        auto = self.cfg.every == "auto" and self._group is not None
        if rank not in plan.participants and self._keeper is not None:  # (started again if a plan needs it)
            self._keeper.close()
            self._keeper = None
        if rank not in plan.participants:
            if auto:  # only to agree on the next interval with the others
                self._thread = threading.Thread(target=self._run_agree, args=(t0, step_s), daemon=True,
                                                name="pdv-snapshot")
                self._thread.start()
            self._last_take = (step, time.perf_counter())
            return self.last
        meta = _bytes(meta_of(eng, pdv, whole), "meta") if rank == plan.meta_src else None
        writes = rank in plan.writers[eng.stage_id]
        sends = writes or any(s == rank for s, _ in plan.buddies.values())
        entries = by_layer if sends else {}
        job = dict(step=step, rank=rank, entries=entries, meta=meta, plan=plan, step_s=step_s, writes=writes,
                   t0=t0)
        if self._group is None:
            self._write(**job, t_collect=time.perf_counter(), background=False)
            return self.last
        if entries:  # into the keeper's shared buffer: training moves on meanwhile
            if self._keeper is None:  # started from this (the main) thread: it dies with the process
                self._keeper = Keeper()
            files = {f"layer_{i:02d}.pt": e for i, e in sorted(entries.items())}
            for name, e in files.items():
                check_plain(e, name)
            job["entries"] = self._keeper.stage(files)
        job.update(t_collect=time.perf_counter(), background=True)
        # a daemon thread: a process that ends (or dies) with a snapshot in flight is not held up by it; the
        # unfinished step is never sealed everywhere, so a resume takes the one before
        self._thread = threading.Thread(target=self._run, kwargs=job, name="pdv-snapshot", daemon=True)
        self._thread.start()
        self._last_take = (step, time.perf_counter())
        return self.last

    def _run(self, **job: Any) -> None:
        try:
            join_host_cpu_thread()  # (the emulator: a real host runs this thread beside the device)
            self._write(**job)
        except BaseException as exc:  # raised in the training thread at the next take / wait
            self._error = exc

    def _run_agree(self, t0: float, step_s: float) -> None:
        try:
            join_host_cpu_thread()
            self.interval = self._agree_interval(time.perf_counter() - t0, step_s, self._group)
        except BaseException as exc:
            self._error = exc

    def _write(self, step: int, rank: int, entries: Any, meta: Optional[bytes], plan: "_Plan", writes: bool,
               t0: float, t_collect: float, background: bool, step_s: float = 0.0) -> None:
        """The writing half, among the participants: `meta.pt` to every host, bytes, this host's files, the
        copies for the next host, the seal, then (every participant sealed) the older steps dropped."""
        store = self.store
        group = plan.group
        buddies, expected = plan.buddies, plan.expected
        box = [meta]
        dist.broadcast_object_list(box, src=plan.meta_src, group=group)  # meta.pt's bytes, one writer per host
        _fault("serialize", step, rank)
        sealed: Dict[str, Dict[str, object]] = {}
        if isinstance(entries, tuple):  # staged for the keeper, which serializes and writes them
            reply = self._keeper.write(*entries, root=self.store.root, job=self.store.job, host=self.store.host,
                                       step=step, write=writes, only_first=_faulty("write", step, rank))
            sealed.update(reply["sealed"])
            if sealed:
                _fault("write", step, rank)  # one file written (the keeper stopped there), the others not
            t_serialize = t_collect + reply["serialize_s"]
            files = {}  # (the keepers copy them to the other host, below)
        else:
            files = {f"layer_{i:02d}.pt": _bytes(e, f"layer {i}") for i, e in sorted(entries.items())}
            t_serialize = time.perf_counter()
            if writes:
                for name, data in files.items():
                    sealed[name] = store.write(step, name, data)
                    _fault("write", step, rank)  # one file written, the others not
        if rank in plan.meta_writers:  # meta on every host
            sealed["meta.pt"] = store.write(step, "meta.pt", box[0])
        t_write = time.perf_counter()
        _fault("send", step, rank)
        outgoing = {dst: pack_files({n: files[n] for n in sorted(files)}) for src, dst in buddies.values()
                    if src == rank and plan.keepers is None}
        incoming = [src for src, dst in buddies.values() if dst == rank]
        if plan.keepers is not None:  # keeper to keeper, on the host's CPU: this thread only waits
            own = sorted(n for n in sealed if n != "meta.pt")
            for dst in sorted(dst for src, dst in buddies.values() if src == rank):
                address, port, token = plan.keepers[dst]
                self._keeper.request({"op": "push", "root": store.root, "job": store.job, "host": store.host,
                                      "step": step, "names": own, "to": [address, port], "token": token,
                                      "sender": rank, "timeout": float(self.cfg.timeout)})
            if incoming:
                sealed.update(self._keeper.request({"op": "collect", "step": step, "senders": incoming,
                                                    "timeout": float(self.cfg.timeout)})["sealed"])
        elif outgoing or incoming:
            for src, blob in sorted(exchange(outgoing, incoming, group).items()):
                for name, data in unpack_files(blob).items():
                    sealed[name] = store.write(step, name, data)
        t_send = time.perf_counter()
        _fault("seal", step, rank)
        if sealed:
            with self._seal_lock:
                if self._abandoned:  # the world it was part of is gone: its step stays unsealed here
                    raise RuntimeError(f"snapshot of step {step} abandoned (in-place recovery)")
                store.seal(step, rank, sealed, expected, generation=self.generation)
        dist.barrier(group=group)  # every participant sealed this step: the older ones can go
        _fault("prune", step, rank)
        if rank in plan.meta_writers:
            store.prune(self.cfg.keep)
        end = time.perf_counter()
        if self.cfg.every == "auto" and background:
            self.interval = self._agree_interval(end - t0, step_s, self._group)
        self.last = {"seconds": end - t0, "bytes": float(sum(int(e["bytes"]) for e in sealed.values())),
                     # where the time went: gathering the stage's state (and the layer list, the meta; a copy
                     # of it in the background mode), turning it into bytes, writing it, sending the copies,
                     # sealing and waiting for the others (in the background mode all but the first off the
                     # step's critical path)
                     "collect_s": t_collect - t0, "serialize_s": t_serialize - t_collect,
                     "write_s": t_write - t_serialize, "send_s": t_send - t_write, "seal_wait_s": end - t_send,
                     "interval": float(self.interval)}

    def _agree_interval(self, seconds: float, step_s: float, group: Any) -> int:
        """(every: auto) Steps until the next snapshot, the same on every rank: the slowest rank's snapshot
        time over the slowest step time, with a quarter to spare, so that the next snapshot finds this one
        done instead of waiting for it (one all-reduce, on the snapshot's own thread and group)."""
        t = torch.tensor([seconds, step_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return auto_interval(float(t[0]), float(t[1]), self.cfg.max_every)

    def wait_briefly(self, seconds: float) -> None:
        """Give the snapshot in flight up to `seconds` to finish (its error, if any, is left unraised)."""
        if self._thread is not None:
            self._thread.join(seconds)

    def abandon(self) -> None:
        """Leave this object's snapshots to themselves, without waiting (a peer died: the snapshot in flight
        may wait on it until its timeout): nothing more is sealed, the keeper is closed. In-place recovery
        then builds a new engine, with a `Snapshots` of its own."""
        with self._seal_lock:
            self._abandoned = True
        if self._keeper is not None:
            self._keeper.close(grace=0)  # its copy may wait on the lost peer
            self._keeper = None
        self._thread = None

    def discard(self, eng: Any) -> None:
        """Remove this job's snapshots from every host's memory (collective; at the end of training: they are
        for restarts, and a tmpfs holds them in RAM)."""
        self.wait()
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
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
        # the steps this run writes from here on are a new timeline: they may reuse numbers an absent host still
        # holds from the old one, and only a step's newest generation counts (every rank computes the same)
        self.generation = newest_generation(by_host) + 1
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
        current = step_entries(by_host, step)  # the hosts that hold this step's newest generation
        step_gen = generation_of(next(iter(current.values())))
        for r, (h, _) in enumerate(listings):
            for name, sha in (current.get(h) or {}).get("files", {}).items():
                holders.setdefault(name, []).append(r)
                shas.setdefault(name, sha)
        mine_now = store.complete().get(step) or {}
        local = set(mine_now.get("files", {})) if generation_of(mine_now) == step_gen else set()
        transfers: Dict[Tuple[int, int], List[str]] = {}  # (from, to) -> what each rank's host lacks
        for r in range(dist.get_world_size()):  # (every rank works out the same)
            have_r = set((current.get(listings[r][0]) or {}).get("files", {}))
            for name in need_by_rank[r]:
                if name not in have_r and name in holders:
                    transfers.setdefault((holders[name][0], r), []).append(name)
        outgoing = {dst: pack_files({n: store.read(step, n, shas[n]) for n in names})
                    for (src, dst), names in sorted(transfers.items()) if src == rank}
        incoming = sorted(src for src, dst in transfers if dst == rank)
        for src, blob in sorted(exchange(outgoing, incoming).items()):  # all at once, both ways
            for name, data in unpack_files(blob).items():
                if name in local:
                    continue
                entry = store.write(step, name, data)
                if entry["sha256"] != shas[name]:
                    raise SnapshotLost([f"snapshots: {name} of step {step} arrived damaged from rank {src}"])
                store.seal(step, rank, {name: entry}, [], label=f"-fetched-{name}", generation=step_gen)
                local.add(name)
        files = (store.complete().get(step) or {}).get("files", {})
        for name in sorted(mine & set(files)):  # what this rank will load: checked before the loader reads it
            store.read(step, name, files[name])
        if self._host_leader(rank):  # what the run that stopped left after this step: written again from here
            store.drop_after(step)
        load_layer_checkpoint(eng, store.base, tag_of(step))
        dist.barrier()
        self.resumed = {"step": float(step), "seconds": time.perf_counter() - t0}
        self.next_due, self.interval, self._last_take = step + 1, 1, None
        return step
