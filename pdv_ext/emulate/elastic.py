"""Elastic supervision of an emulated job: torchrun's agents, one per device, so that a device or a host can
stop (fault events) and the job goes on with the devices that are left.

Each device runs `torch.distributed.run` (c10d rendezvous, `--nnodes 1:N`, one worker) inside its own
network namespace and CPU group, as a node of a real multi-node job would; the rendezvous store runs on a
host of its own (namespace `<run>-st`, address `STORE_IP`), so losing any emulated host leaves it standing.
When a device stops, its peers' collectives fail, their agents restart the workers, and the rendezvous
closes with the devices that are left (`RDZV_CONF`: a dead node is noticed within ~2 s, the last call waits
2 s); a device that comes back starts a new agent, which the running agents admit at their next restart.
Workers find their device in PDV_DEVICE_NAME and PDV_HOST (torchrun gives ranks in rendezvous order, not in
device order) and their host's memory in PDV_HOST_MEMORY: a folder per host, wiped when the host is lost.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Sequence

from ..recovery.config import host_memory_dir
from .spec import SUBNET

#: the rendezvous store's host, outside every emulated host (10.251.255.254: above every device address of
#: a cluster with fewer than 256 hosts)
STORE_IP = f"{SUBNET}.255.254"
STORE_PORT = 29400
#: torchrun's c10d rendezvous: a dead node dropped after 5 missed 1 s keep-alives, the last call 2 s (its
#: defaults: 5 s x 3 and 30 s). Not 2 missed ones, as docs/recovery.md's one-machine run: on a loaded 2-core
#: machine the running agents' heartbeats then lapsed while a returning host's agents started, and those
#: formed a job of their own beside the running one
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5,is_host=false"
#: the launcher environment torchrun sets for each worker itself
WORKER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MEMORY_ENV = "PDV_HOST_MEMORY"


def memory_root(run_name: str) -> str:
    """Where the run's hosts keep their memory: a folder per host under it (/dev/shm where there is one)."""
    return os.path.join(host_memory_dir(), f"{run_name}-memory")


def agent_command(command: Sequence[str], min_nodes: int, devices: int, local_addr: str, run_id: str,
                  max_restarts: int, procs_file: str, port: int = STORE_PORT) -> List[str]:
    """One device's torchrun agent running `command` (any program: `--no-python`) as its one worker, which
    moves itself into the device's CPU group (`procs_file`) first: the agent, like a real node's, is not
    slowed by the device's quota (a slow device's agent would otherwise join the first rendezvous late)."""
    join = 'echo 0 > "$0" && exec "$@"'  # 0: the writer itself (torchrun reads $$ as an escaped $)
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={min_nodes}:{devices}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={STORE_IP}:{port}", f"--rdzv-id={run_id}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.5", f"--rdzv-conf={RDZV_CONF}",
            f"--local-addr={local_addr}", "--no-python", "sh", "-c", join, procs_file, *command]


def fewest_left(devices: int, changes: Sequence) -> int:
    """The fewest devices up at any point of the timeline (`weather.Change`s): torchrun's MIN nodes. A
    rendezvous closes no smaller, so agents that are still starting (or a lone agent between rounds) never
    make a job of their own."""
    down: set = set()
    least = devices
    for c in changes:
        down.update(getattr(c, "down", []))
        down.difference_update(getattr(c, "up", []))
        least = min(least, devices - len(down))
    return max(least, 1)


def agent_env(rank_env: Dict[str, str], host_memory: str) -> Dict[str, str]:
    """A rank's environment for its agent: torchrun sets the launcher variables; the store is not shared
    with the workers (the workers' own store is on rank 0's device, the agents' on the store host)."""
    env = {k: v for k, v in rank_env.items() if k not in WORKER_KEYS}
    # pdv.snapshots.in_place: the survivors meet on the store host's store, which no emulated host's loss takes
    env.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", MEMORY_ENV: host_memory,
                "PDV_RECOVERY_STORE": f"{STORE_IP}:{STORE_PORT}"})
    return env


def store_command(port: int = STORE_PORT) -> List[str]:
    return [sys.executable, "-m", "pdv_ext.emulate.elastic", "store", str(port)]


def _serve(port: int) -> None:
    """The rendezvous store's host: a TCPStore server until killed."""
    import signal
    import time

    from torch.distributed import TCPStore

    store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    print(f"rendezvous store listening on {STORE_IP}:{port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while store is not None:
        time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "store":
        _serve(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m pdv_ext.emulate.elastic store PORT")
