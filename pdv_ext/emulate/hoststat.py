"""How much CPU the hypervisor took from this machine while something ran (steal time, /proc/stat).

The emulator's CPU quotas are ceilings, not guarantees: on a VM whose host steals time, the devices do not
get their quotas and the emulated speeds drift. Measurements made on the emulated cluster (the placement
benchmark, the probe test) report the steal share of their interval so a reader can tell a model's error
from a host that did not deliver the CPU.
"""
from __future__ import annotations

from typing import Optional, Tuple

PROC_STAT = "/proc/stat"


def _cpu_ticks(path: str = PROC_STAT) -> Optional[Tuple[int, int]]:
    """(steal ticks, all ticks) of the machine so far, or None where /proc/stat has no such line."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice; guest time is already in user/nice
    ticks = [int(x) for x in fields[1:9]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


class StealMeter:
    """Steal share of all CPU ticks (busy and idle, all cores) between `__init__` and `fraction()`."""

    def __init__(self, path: str = PROC_STAT):
        self.path = path
        self.start = _cpu_ticks(path)

    def fraction(self) -> Optional[float]:
        """None where the kernel does not report steal time (not Linux)."""
        end = _cpu_ticks(self.path)
        if self.start is None or end is None:
            return None
        total = end[1] - self.start[1]
        return (end[0] - self.start[0]) / total if total > 0 else 0.0
