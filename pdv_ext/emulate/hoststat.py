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


def _steal_share(start: Tuple[int, int], end: Tuple[int, int]) -> float:
    """Steal share of all ticks between two (steal ticks, all ticks) readings."""
    total = end[1] - start[1]
    return (end[0] - start[0]) / total if total > 0 else 0.0


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
        return _steal_share(self.start, end)


class StealSampler:
    """/proc/stat's steal and total ticks sampled every `interval` seconds on a thread, so that the steal share
    of any stretch of a run (the steps before and after a re-plan, say) can be read afterwards (`fraction`).
    `samples`: [wall time, steal ticks, all ticks]; empty where the kernel does not report steal time."""

    def __init__(self, interval: float = 0.5, path: str = PROC_STAT):
        import threading

        self.interval, self.path = interval, path
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdv-steal-sampler", daemon=True)

    def _sample(self) -> None:
        import time

        t = _cpu_ticks(self.path)
        if t is not None:
            self.samples.append([time.time(), t[0], t[1]])

    def _loop(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "StealSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def steal_fraction(samples, start: float, end: float) -> Optional[float]:
    """Steal share of all ticks from the last sample at or before `start` to the first at or after `end`
    (`StealSampler.samples`); None when the samples do not cover that stretch."""
    before = [s for s in samples if s[0] <= start]
    after = [s for s in samples if s[0] >= end]
    if not before or not after:
        return None
    return _steal_share(before[-1][1:], after[0][1:])
