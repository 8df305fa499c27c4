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

import json
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

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


def agree(store: Any, gen: int, rank: int, world: int, settle_s: float, poll_s: float = 0.02,
          clock: Callable[[], float] = time.monotonic) -> List[int]:
    """The ranks of the failed generation (`world` of them) that go on into generation `gen`, in their old
    order: the same list on every survivor. Raises NotASurvivor on a rank the others decided without."""
    store.set(f"g{gen}/alive/{rank}", "1")
    end = clock() + settle_s
    keys = [f"g{gen}/alive/{r}" for r in range(world)]
    while True:
        decided = store.check([f"g{gen}/decision"])
        if decided:
            break
        alive = [r for r, k in enumerate(keys) if store.check([k])]
        if len(alive) == world or clock() >= end:
            # the first to get here writes its view; anyone later reads it (compare_set keeps the first)
            store.compare_set(f"g{gen}/decision", "", json.dumps(alive))
            break
        time.sleep(poll_s)
    members = [int(r) for r in json.loads(store.get(f"g{gen}/decision"))]
    if rank not in members:
        raise NotASurvivor(f"pdv in-place recovery: rank {rank} reported after the survivors of generation "
                           f"{gen - 1} had decided without it ({members}); leaving for a restart")
    return members


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
