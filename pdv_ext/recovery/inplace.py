"""Recovery in place: when a peer dies, the ranks left agree on who goes on, in the processes they run in.

A restart (torchrun's agents starting every worker again) costs the detection of the lost node, a new
rendezvous and every worker's start-up: 8-17 s on the emulated cluster, most of a minute on a GPU node, against
the ~1 s the survivors need to go on where they are (the engine rebuilt for the devices left, the newest complete
snapshot loaded: `integrations/deepspeed/inplace.py`). What they need for that is a place to meet that outlives
any training host, since the process group's own store lives on rank 0's host: a TCPStore such as torchrun's
rendezvous endpoint on a host of its own (`pdv.snapshots.store`).

Keys, under `pdv-inplace/<job>/<epoch>/` (the epoch is drawn at start-up, so a restarted job never reads a
previous life's keys):
- `g<n>/alive/<rank>`: a survivor of generation n-1's failure (its rank there) is ready to go on;
- `g<n>/decision`: the ranks that go on, written once (compare-and-set) by the first survivor whose wait ended:
  every rank has reported, or `settle_s` passed since it reported itself;
- `g<n>/pg/...`: generation n's process group.
A rank missing from the decision (it reported after the others had decided) raises `NotASurvivor`: it leaves,
and the launcher's restart brings it back with everyone (the snapshots' resume).
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

from ..config_base import ConfigError


class NotASurvivor(RuntimeError):
    """This rank reported after the survivors had decided without it."""


def parse_address(address: str) -> "tuple[str, int]":
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError([f"pdv.snapshots.store: '{address}' is not HOST:PORT"])
    return host.strip("[]"), int(port)


def connect(address: str, prefix: Optional[str] = None, timeout_s: float = 30.0) -> Any:
    """A client of the TCPStore at `address` (HOST:PORT), its keys under `prefix` (None: no prefix)."""
    from torch.distributed import PrefixStore, TCPStore

    host, port = parse_address(address)
    store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store if prefix is None else PrefixStore(prefix, store)


def _silent(store: Any, ranks: List[int], uids: List[int], beats: dict, now: float, silent_s: float) -> List[int]:
    """Those of `ranks` whose heartbeat counter has not moved for `silent_s` (`beats`: each one's last count and
    when it was first seen, kept by the caller across polls)."""
    out = []
    for r in ranks:
        c = int(store.add(f"hb/{uids[r]}", 0))
        if r not in beats or beats[r][0] != c:
            beats[r] = (c, now)
        if now - beats[r][1] >= silent_s:
            out.append(r)
    return out


def agree(store: Any, gen: int, rank: int, world: int, settle_s: float, poll_s: float = 0.02,
          clock: Callable[[], float] = time.monotonic, uids: Optional[List[int]] = None,
          silent_s: float = 3.0, beats: Optional[dict] = None) -> List[int]:
    """The ranks of the failed generation (`world` of them) that go on into generation `gen`, in their old
    order: the same list on every survivor. Raises NotASurvivor on a rank the others decided without.

    The wait ends when every rank has reported, or when each one that has not is silent: its heartbeat (`uids`:
    each rank's heartbeat id, `Heartbeat`) has not moved for `silent_s` (a process that is gone), and at the
    latest `settle_s` after this rank reported (without `uids`: always then). A rank that is alive but was
    computing when the peer died beats on, and is waited for (up to `settle_s`)."""
    store.set(f"g{gen}/alive/{rank}", "1")
    start = clock()
    keys = [f"g{gen}/alive/{r}" for r in range(world)]
    beats = {} if beats is None else beats  # (a caller's, kept across rounds: a silence already seen counts)
    while True:
        if store.check([f"g{gen}/decision"]):
            break
        now = clock()
        alive = [r for r, k in enumerate(keys) if store.check([k])]
        missing = [r for r in range(world) if r not in alive]
        silent = uids is not None and len(_silent(store, missing, uids, beats, now, silent_s)) == len(missing)
        if not missing or silent or now - start >= settle_s:
            # the first to get here writes its view; anyone later reads it (compare_set keeps the first)
            store.compare_set(f"g{gen}/decision", "", json.dumps(alive))
            break
        time.sleep(poll_s)
    members = [int(r) for r in json.loads(store.get(f"g{gen}/decision"))]
    if rank not in members:
        raise NotASurvivor(f"pdv in-place recovery: rank {rank} reported after the survivors of generation "
                           f"{gen - 1} had decided without it ({members}); leaving for a restart")
    return members


def confirm(store: Any, gen: int, rank: int, members: List[int], deadline_s: float, poll_s: float = 0.02,
            clock: Callable[[], float] = time.monotonic, uids: Optional[List[int]] = None,
            silent_s: float = 3.0, beats: Optional[dict] = None) -> bool:
    """Whether every member of generation `gen` (`agree`'s list) is still there to form it: the same answer on
    every member. A rank can report and die after (a host whose link dropped first: its rank saw the error,
    reported, and went with the host); the new world would then wait for it to connect. Each member says it
    is ready; when all have, the answer is yes; when one that has not is silent (its heartbeat still for
    `silent_s`, `uids` as in `agree`) or `deadline_s` has passed, it is no, and the caller agrees again in the
    next generation (the silent rank does not report there). The first to know writes the answer
    (compare-and-set), so that no member goes on while another starts over."""
    store.set(f"g{gen}/ready/{rank}", "1")
    start, key = clock(), f"g{gen}/outcome"
    beats = {} if beats is None else beats
    while not store.check([key]):
        now = clock()
        missing = [r for r in members if not store.check([f"g{gen}/ready/{r}"])]
        silent = uids is not None and bool(_silent(store, missing, uids, beats, now, silent_s))
        if not missing or silent or now - start >= deadline_s:
            store.compare_set(key, "", "go" if not missing else "again")
            break
        time.sleep(poll_s)
    return store.get(key) == b"go"


def survivors(store: Any, gen: int, rank: int, world: int, settle_s: float,
              uids: Optional[List[int]] = None, silent_s: float = 3.0,
              warn: Callable[[str], None] = lambda msg: None) -> Tuple[List[int], int]:
    """`agree`, then `confirm`, again in the next generation until a world stays: (its members, its
    generation). Raises NotASurvivor when this rank is left out, or when no world stays in `world` rounds."""
    beats: dict = {}  # one record of the heartbeats for every round: a rank found silent is not timed again
    for _ in range(world):  # each round that ends without a member leaves out at least that one next time
        members = agree(store, gen, rank, world, settle_s, uids=uids, silent_s=silent_s, beats=beats)
        if confirm(store, gen, rank, members, settle_s, uids=uids, silent_s=silent_s, beats=beats):
            return members, gen
        warn(f"pdv in-place recovery: a rank of {members} reported and went silent before generation {gen} "
             "formed; agreeing again")
        gen += 1
    raise NotASurvivor("pdv in-place recovery: the survivors could not agree on a world that stays")


# ---------------------------------------------------------------------------------------------------
# torchrun's agents (torch.distributed.elastic): private layouts, named here only
# ---------------------------------------------------------------------------------------------------
#: the exit barrier every agent of a rendezvous round joins when its workers are done (torch's
#: `SimpleElasticAgent._exit_barrier`: `store_util.barrier` over that round's agents, 300 s by default)
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"


def rendezvous_round(store: Any, run_id: str) -> int:
    """The c10d rendezvous' current round of `run_id`: its state, pickled and base64-encoded under
    `torch.rendezvous.<run_id>` (c10d_rendezvous_backend.py, dynamic_rendezvous.py's `_RendezvousState`)."""
    import base64
    import pickle

    state = pickle.loads(base64.b64decode(store.get(f"torch.rendezvous.{run_id}")))
    return int(state.round)


def fill_exit_barrier(store: Any, run_id: str, lost_agents: int, world_agents: int) -> None:
    """Check the `lost_agents` agents that died with their hosts into the exit barrier of the rendezvous'
    current round (`store`: the rendezvous store, no prefix). Without it the survivors' agents, whose workers
    went on without a restart, wait the barrier's whole timeout for them at the end (300 s)."""
    if lost_agents <= 0:
        return
    prefix = f"torch.rendezvous.{run_id}.{rendezvous_round(store, run_id)}/{EXIT_BARRIER_PREFIX}"
    if store.add(f"{prefix}/num_members", lost_agents) >= world_agents:  # (as torch's barrier: the last one in)
        store.set(f"{prefix}/last_member", "<val_ignored>")


# ---------------------------------------------------------------------------------------------------
# the old world's connections
# ---------------------------------------------------------------------------------------------------
def _tcp_table() -> "dict[int, tuple[str, int, int]]":
    """socket inode -> (remote address, remote port, state) of this network namespace's TCP sockets."""
    import socket
    import struct

    out = {}
    for path, six in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10:
                continue
            addr, port = cols[2].split(":")
            raw = bytes.fromhex(addr)
            if six:  # four 32-bit words, each little-endian
                raw = b"".join(struct.pack("<I", int.from_bytes(raw[i:i + 4], "big")) for i in range(0, 16, 4))
                ip = socket.inet_ntop(socket.AF_INET6, raw)
                if ip.startswith("::ffff:"):
                    ip = ip[7:]
            else:
                ip = socket.inet_ntoa(struct.pack("<I", int.from_bytes(raw, "big")))
            out[int(cols[9])] = (ip, int(port, 16), int(cols[3], 16))
    return out


def peer_addresses(keep: "tuple[str, int]") -> "set[str]":
    """The remote addresses of this process's established TCP connections but `keep` (the recovery store's):
    at start-up, once the process groups have connected, the peers' addresses."""
    table = _tcp_table()
    return {ip for ip, port, st in (table.get(i, ("", 0, 0)) for i in _socket_inodes().values())
            if st == 1 and (ip, port) != keep and ip}


def _socket_inodes() -> "dict[int, int]":
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(fd)] = int(link[8:-1])
    return out


def close_peer_connections(peers: "set[str]", keep: "tuple[str, int]") -> int:
    """Shut down this process's TCP connections to `peers` but `keep`: the old process groups' (gloo cannot be
    aborted). A survivor does it first thing, so that every live peer blocked in a collective with it fails
    at once and joins the agreement, instead of waiting out the group's timeout. Returns how many."""
    import socket

    table = _tcp_table()
    n = 0
    for fd, inode in _socket_inodes().items():
        ip, port, st = table.get(inode, ("", 0, 0))
        if ip in peers and (ip, port) != keep:
            try:
                s = socket.socket(fileno=os.dup(fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    n += 1
                finally:
                    s.close()  # the duplicate only
            except OSError:
                pass
    return n


def begun_key(gen: int) -> str:
    return f"g{int(gen)}/begun"


def begin(store: Any, gen: int) -> None:
    """Say that a recovery into generation `gen` has begun: every rank's heartbeat sees it within its interval
    and makes this rank join, whatever it waits on (`Heartbeat.on_begun`). The first rank that finds a peer
    gone says it; the others' saying it again changes nothing."""
    store.set(begun_key(gen), "1")


class Heartbeat:
    """Each rank's pulse in the recovery store, and its watch on the others': a host that vanishes without
    closing its connections (power, network) leaves its peers blocked in a collective until the group's
    timeout (30 minutes by default); a peer whose counter has not moved for `dead_after_s` is taken for
    lost, and `on_lost` (shutting the old world's connections) makes the blocked collective fail now.

    A thread with a store client of its own; counters, not clocks (hosts' clocks differ). `watch(uids)`
    sets whom to watch (the survivors, after a recovery)."""

    def __init__(self, address: str, prefix: str, uid: int, uids: List[int], on_lost: Callable[[List[int]], None],
                 interval_s: float = 0.5, dead_after_s: float = 4.0,
                 on_begun: Optional[Callable[[int], None]] = None):
        self.address, self.prefix, self.uid = address, prefix, int(uid)
        self.interval_s, self.dead_after_s, self.on_lost, self.on_begun = interval_s, dead_after_s, on_lost, on_begun
        self._watch = [int(u) for u in uids if int(u) != self.uid]
        #: set when a peer is taken for lost or another rank began a recovery (`begin`): a wait of this rank
        #: that no connection ends (the snapshot in flight) gives up on it (cleared by `watch`)
        self.interrupted = threading.Event()
        self.generation = 0  # the world this rank is in: a recovery into the next one is watched for
        self._stop = threading.Event()
        self._fired: set = set()
        self._paused = False
        # `watch` and `pause` move the epoch on: what the thread read from the store before that (a lost peer
        # or a begun recovery of the old world) is not acted on after it (fired late, it shut the connections
        # of the world formed meanwhile)
        self._lock = threading.RLock()
        self._epoch = 0
        self._thread = threading.Thread(target=self._run, name="pdv-heartbeat", daemon=True)
        self._thread.start()
        # stopped before the interpreter finalizes: a daemon thread still inside the store client's C++ then
        # is torn down mid-call, and the process aborts ("terminate called without an active exception",
        # exit -6) at the end of a job that trained to the end (seen under load, 1 run in 5)
        atexit.register(self.stop)

    def watch(self, uids: List[int], generation: Optional[int] = None) -> None:
        """Watch `uids` (this rank's world, after a recovery into `generation`) from now on."""
        with self._lock:
            self._watch = [int(u) for u in uids if int(u) != self.uid]
            self._fired = set()
            if generation is not None:
                self.generation = int(generation)
            self.interrupted.clear()
            self._paused = False
            self._epoch += 1

    def pause(self) -> None:
        """No firing while a recovery runs: its new world's connections are not the old world's. Returns once
        a firing in progress has finished."""
        with self._lock:
            self._paused = True
            self._epoch += 1

    def stop(self, join_s: float = 5.0) -> None:
        """End the thread and wait for it (at most `join_s`: a store call in flight finishes first)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    def _run(self) -> None:
        import logging

        log = logging.getLogger("pdv_ext")
        store, seen, warned = None, {}, False
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if store is None:
                    store = connect(self.address, self.prefix, timeout_s=max(10.0, 4 * self.interval_s))
                store.add(f"hb/{self.uid}", 1)
                with self._lock:
                    epoch, watch, gen = self._epoch, list(self._watch), self.generation + 1
                counts = {u: int(store.add(f"hb/{u}", 0)) for u in watch}
                begun = self.on_begun is not None and store.check([begun_key(gen)])
            except Exception as exc:  # noqa: BLE001 - the store unreachable: try again, say so once
                if not warned:
                    log.warning(f"pdv in-place recovery: heartbeat: the store at {self.address} failed ({exc}); "
                                "retrying")
                    warned = True
                store = None
                self._stop.wait(self.interval_s)
                continue
            for u, c in counts.items():
                if u not in seen or seen[u][0] != c:
                    seen[u] = (c, now)
            self._act(epoch, watch, seen, now, gen, begun)
            self._stop.wait(self.interval_s)

    def _act(self, epoch: int, watch: List[int], seen: dict, now: float, gen: int, begun: bool) -> None:
        """Fire what one poll found, unless a `watch` or `pause` came since it read the store (`epoch`)."""
        with self._lock:
            if epoch != self._epoch or self._paused:
                return
            lost = [u for u in watch if now - seen[u][1] > self.dead_after_s and u not in self._fired]
            if lost:
                self._fired.update(lost)
                self.interrupted.set()
                try:
                    self.on_lost(lost)
                except Exception:  # noqa: BLE001
                    pass
            if begun and ("begun", gen) not in self._fired:
                self._fired.add(("begun", gen))
                self.interrupted.set()
                try:
                    self.on_begun(gen)
                except Exception:  # noqa: BLE001
                    pass
