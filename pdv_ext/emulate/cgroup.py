"""CPU quotas per emulated device: cgroup v1 (`cpu.cfs_quota_us`) or v2 (`cpu.max`).

A device's relative speed becomes a share of one core: the fastest device gets `top_share` cores, the
others proportionally less. Every run gets its own parent group `pdv-<run id>` so removal is exact;
`remove()` kills whatever still runs inside before deleting the groups.
"""
from __future__ import annotations

import math
import os
import signal
import time
from typing import List, Optional

V1_ROOT = "/sys/fs/cgroup/cpu"
V2_ROOT = "/sys/fs/cgroup"
MIN_QUOTA_US = 1000  # the kernel's smallest quota
MAX_PERIOD_US = 1000000  # and its longest period
MIN_CORES = MIN_QUOTA_US / MAX_PERIOD_US  # the smallest share a quota can express


def period_us(cores: float) -> int:
    """CFS period for a group allowed `cores`: as short as the 1 ms minimum quota allows (2-10 ms from 0.1
    of a core up, longer below it, so that a slow device gets its share rather than 0.1 of a core).

    A throttled rank cannot answer a message until its next period, so long periods add up to a
    period of stall to every exchange with a slow device; short ones also make millisecond-long
    layers see the average quota.
    """
    return int(min(MAX_PERIOD_US, max(2000, math.ceil(MIN_QUOTA_US / max(cores, MIN_CORES)))))


def quota_us(cores: float, period: int) -> int:
    return max(MIN_QUOTA_US, int(round(cores * period)))


class CgroupError(RuntimeError):
    pass


def detect() -> Optional[tuple]:
    """(version, root) of a usable CPU controller, or None."""
    if os.path.exists(os.path.join(V2_ROOT, "cgroup.controllers")):
        with open(os.path.join(V2_ROOT, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return 2, V2_ROOT
    if os.path.exists(os.path.join(V1_ROOT, "cpu.cfs_quota_us")):
        return 1, V1_ROOT
    return None


def shares(speeds: List[float], cpu_budget: float, top_share: Optional[float] = None) -> List[float]:
    """Cores per device, proportional to speed; the fastest gets `top_share` (default: as much as keeps
    the sum within `cpu_budget` cores, at most one core — ranks are single-threaded)."""
    top = max(speeds)
    rel = [s / top for s in speeds]
    if top_share is None:
        top_share = min(1.0, cpu_budget / sum(rel))
    return [r * top_share for r in rel]


MAX_WEIGHT = {1: 262144, 2: 10000}  # cpu.shares (default 1024 per process) / cpu.weight (default 100)


def weights(cores: List[float], version: int) -> List[int]:
    """CFS weights proportional to the quotas, the fastest device at the maximum: on a busy machine the
    run takes its CPU budget first, so quotas, not contention with other work, set the speeds."""
    top = max(cores)
    return [max(2 if version == 1 else 1, int(MAX_WEIGHT[version] * c / top)) for c in cores]


class CpuGroups:
    """One child group per device under `pdv-<run id>`."""

    def __init__(self, run_name: str, cores: List[float], detected: Optional[tuple] = None):
        det = detected or detect()
        if det is None:
            raise CgroupError("no cgroup CPU controller found (looked for cgroup v2 cpu.max and v1 cpu.cfs_quota_us)")
        self.version, root = det
        self.parent = os.path.join(root, run_name)
        self.cores = cores
        self.paths: List[str] = []

    def create(self) -> None:
        os.mkdir(self.parent)
        # Weights as well as ceilings: on a busy machine the quota alone is not reached and every group
        # would get the same share; weights proportional to speed keep the ratios under contention. No
        # CFS burst: banked quota made a rank that had waited (a pipeline stage between micro-batches)
        # run 10-20% above its quota for a while, faster than the same device computing without pauses
        # (measured by its own forward + backward in training); the budget leaves enough idle CPU instead.
        w = weights(self.cores, self.version)
        if self.version == 2:
            _write(os.path.join(self.parent, "cgroup.subtree_control"), "+cpu")
            _write(os.path.join(self.parent, "cpu.weight"), str(MAX_WEIGHT[2]))
        else:
            _write(os.path.join(self.parent, "cpu.shares"), str(MAX_WEIGHT[1]))
        for i, c in enumerate(self.cores):
            path = os.path.join(self.parent, f"d{i}")
            os.mkdir(path)
            self.paths.append(path)
            period = period_us(c)
            quota = quota_us(c, period)
            if self.version == 1:
                _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
                _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
                _write(os.path.join(path, "cpu.shares"), str(w[i]))
            else:
                _write(os.path.join(path, "cpu.max"), f"{quota} {period}")
                _write(os.path.join(path, "cpu.weight"), str(w[i]))

    def set_cores(self, i: int, cores: float) -> None:
        """Give device i a new quota while its rank runs, and every device the weight that follows the quotas
        (the fastest at the maximum, as at creation)."""
        if cores < MIN_CORES:
            raise CgroupError(f"{cores:.6f} cores is below the smallest CPU quota ({MIN_CORES} of a core)")
        period = period_us(cores)
        quota = quota_us(cores, period)
        path = self.paths[i]
        if self.version == 2:
            _write(os.path.join(path, "cpu.max"), f"{quota} {period}")  # both at once
        else:
            # v1 takes them one at a time. The period falls and the quota rises (or stays) with the share
            # (`period_us`), so either intermediate pair is valid and lies between the old and the new share;
            # going down, the quota first keeps the group from ever running above its old share.
            names = ["cpu.cfs_quota_us", "cpu.cfs_period_us"]
            values = {"cpu.cfs_quota_us": quota, "cpu.cfs_period_us": period}
            for name in (names if cores < self.cores[i] else names[::-1]):
                _write(os.path.join(path, name), str(values[name]))
        new = list(self.cores)
        new[i] = cores
        old_w, new_w = weights(self.cores, self.version), weights(new, self.version)
        for j, (w0, w1) in enumerate(zip(old_w, new_w)):
            if w0 != w1:
                _write(os.path.join(self.paths[j], "cpu.shares" if self.version == 1 else "cpu.weight"), str(w1))
        self.cores = new

    def procs_file(self, i: int) -> str:
        return os.path.join(self.paths[i], "cgroup.procs")

    def host_procs(self, host: str) -> str:
        """The `cgroup.procs` file of host `host`'s own group, without a quota (made on first use): the work a
        real host does on the cores its GPUs leave (pdv's snapshot keepers) runs there, on the CPU the
        devices leave idle, at the default weight (below the devices': they come first when the CPU is
        short)."""
        os.makedirs(self._host_path(host), exist_ok=True)
        return os.path.join(self._host_path(host), "cgroup.procs")

    def start_procs(self, i: int) -> str:
        """The `cgroup.procs` file of device i's start-up group, without a quota (made on first use): a worker
        started there runs its start-up (imports, rendezvous, building the model) on its host's CPU, as on a
        real host whatever its GPU's speed, and enters the device's group itself (`pdv_ext.emulated_device`).
        `kill(i)` kills it there too."""
        path = self.paths[i] + "-start"
        os.makedirs(path, exist_ok=True)
        return os.path.join(path, "cgroup.procs")

    def _host_path(self, host: str) -> str:
        return os.path.join(self.parent, f"host-{host}")

    def kill_host(self, host: str, timeout: float = 10.0) -> None:
        """Host `host` is lost: whatever runs in its own group dies with it."""
        path = self._host_path(host)
        if os.path.isdir(path):
            kill_all(path, time.monotonic() + timeout)

    def kill(self, i: int, timeout: float = 10.0) -> None:
        """Device i stops: every process in its group (and in its start-up group) dies at once (SIGKILL), the
        groups stay."""
        deadline = time.monotonic() + timeout
        if os.path.isdir(self.paths[i] + "-start"):
            kill_all(self.paths[i] + "-start", deadline)
        kill_all(self.paths[i], deadline)

    def remove(self) -> None:
        remove_tree(self.parent)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _pids(path: str) -> List[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def kill_all(d: str, deadline: float) -> None:
    """SIGKILL every process in group `d` until none is left (what a process forks meanwhile is killed too:
    it is born in the same group)."""
    while True:
        pids = _pids(d)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise CgroupError(f"processes {pids} in {d} would not die")
        time.sleep(0.05)


def remove_tree(path: str, timeout: float = 10.0) -> None:
    """Kill every process in the group tree, then remove the groups bottom-up."""
    if not os.path.isdir(path):
        return
    dirs = [d for d, _, _ in os.walk(path)][::-1]  # children before parents
    deadline = time.monotonic() + timeout
    for d in dirs:
        kill_all(d, deadline)
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:  # a just-killed task may still be exiting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def stale(prefix: str = "pdv-") -> List[str]:
    """Groups left by earlier runs (their names start with `prefix`)."""
    det = detect()
    if det is None:
        return []
    root = det[1]
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if n.startswith(prefix) and os.path.isdir(os.path.join(root, n))]

