"""What a rank on an emulated device (`pdv emulate`) knows of it. Its clock: the CPU time it spends, at the
CPU share the device is given.

Why: on a GPU, compute is timed by CUDA events, the device's busy time, whatever the host waited for. An
emulated device is a CPU quota (emulate/cgroup.py), and under a quota a rank that waited between passes runs
the next one partly on unspent quota: its wall time reads it 8-26% faster than it runs once kept busy (the
prediction grid, docs/placement.md). Policies that plan from those speeds (`replan`) then flatter exactly the
devices a move makes the bottleneck. CPU seconds over the quota's cores is what a pass costs the device when
it is busy: the emulated device's busy time, as CUDA events give a GPU's.

`pdv emulate` names each rank's CPU group in `PDV_DEVICE_CGROUP`; the quota is read from it (again at most
every `refresh_s`), so a slowdown the emulator plays mid-run is seen at once. Outside the emulator: None, and
CPU ranks keep the host clock. The engine glue picks the clock (integrations/deepspeed/glue.py).

And its start-up: under `pdv emulate --startup-on-host` a worker starts outside its device's quota and enters
the device's group itself (`enter_device_group`, called by `pdv_ext.initialize`).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

ENV = "PDV_DEVICE_CGROUP"
#: `pdv emulate --startup-on-host`: the device group's `cgroup.procs`, which the worker enters at pdv's start
ENTER_ENV = "PDV_DEVICE_ENTER"


def read_cores(group: str) -> Optional[float]:
    """The cores a cgroup's CPU quota allows (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`);
    None without a quota ("max", -1) or when the files cannot be read."""
    try:
        v2 = os.path.join(group, "cpu.max")
        if os.path.exists(v2):
            with open(v2) as f:
                quota, period = f.read().split()[:2]
        else:
            with open(os.path.join(group, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(group, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        if quota in ("max", "-1"):
            return None
        cores = int(quota) / int(period)
        return cores if cores > 0 else None
    except (OSError, ValueError):
        return None


class DeviceClock:
    """Busy seconds of the emulated device in CPU group `group`: `c = clock.start()`, then
    `clock.seconds_since(c)` (the process's CPU time since, over the quota's cores at the end)."""

    def __init__(self, group: str, refresh_s: float = 0.25):
        self.group = group
        self.refresh_s = float(refresh_s)
        self._cores: Optional[float] = None
        self._read_at = -float("inf")

    def cores(self) -> float:
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            self._cores = read_cores(self.group)
            self._read_at = now
        return self._cores or 1.0  # no quota: a rank runs on one core (single-threaded, OMP_NUM_THREADS=1)

    @staticmethod
    def start() -> float:
        return time.process_time()

    def seconds_since(self, start: float) -> float:
        return (time.process_time() - start) / self.cores()


def device_clock() -> Optional[DeviceClock]:
    """This rank's emulated device clock, or None when it does not run on an emulated device."""
    group = os.environ.get(ENV)
    return DeviceClock(group) if group and os.path.isdir(group) else None


#: `pdv emulate` sets it in every rank's environment (the run's name)
EMULATION_ENV = "PDV_EMULATION"
#: the signal on which a rank under `pdv emulate` prints every thread's Python stack (a run that timed out)
STACKS_SIGNAL = signal.SIGUSR1


def dump_stacks_on_signal() -> bool:
    """Under `pdv emulate`, print every thread's Python stack to stderr on SIGUSR1: the emulator sends it to
    the ranks of a run that timed out, so that a hang says where each rank waits (in CI, where no debugger
    attaches). Not outside the emulator: a user's job may use SIGUSR1 (SLURM's warning before a time limit)."""
    if not os.environ.get(EMULATION_ENV):
        return False
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    return True


def enter_device_group() -> bool:
    """Move this process into its emulated device's CPU group, when `pdv emulate --startup-on-host` started it
    on its host's CPU: its start-up (imports, rendezvous, the model's construction) ran at the host's speed, as
    on a real host whatever its GPU's speed; from here on it runs at the device's. `pdv_ext.initialize` calls
    it first thing. Once per process (the variable is taken out of the environment); False when there is
    nothing to enter."""
    path = os.environ.pop(ENTER_ENV, None)
    if not path:
        return False
    with open(path, "w") as f:
        f.write("0")  # 0: the writer itself (every thread of the process moves with it)
    return True
