"""Plays a timeline of changes (weather.py) on a running emulation, one thread, each change logged.

The zero of the timeline is the ranks' start (`launch`) or the moment a rank first calls
`events.mark_start()` (`mark`: the player polls for the file the launcher named in `PDV_EVENTS_MARK`).
A timeline placed by training step (`at_step`, `at_fraction` resolved) has no clock: the player polls the
step count rank 0 reports through `events.mark_step` (the file named in `PDV_EVENTS_STEP`) and applies each
event once the count reaches its step; if nothing is ever reported it applies nothing, waits for nothing
(the run ends as it would) and says so when stopped. `applied_at` then counts from the ranks' start.
Each applied change is one line on stderr and one JSON line appended to the events log; a change that fails
stops the player and is reported through `error` (the launcher then stops the run); changes still pending
when the player is stopped are logged as not applied. `stop()` returns only when no change is in flight, so
the launcher calls it before it removes the run's cgroups and namespaces.
"""
from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Callable, List, Optional, TextIO

from .events import read_step
from .weather import Change

POLL_S = 0.02  # how often the `mark` clock looks for its file, and a step timeline for the step count
NO_PROGRESS = ("no rank reported training progress: step events need rank 0 to call "
               "pdv_ext.emulate.events.mark_step(n) after each step")


class EventError(RuntimeError):
    """An event could not be applied to the running emulation (the message names it)."""


def wall_iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class EventPlayer:
    """`apply(change)` writes one change to the emulation and returns notes for its log line (e.g. that
    latency is not emulated)."""

    def __init__(self, changes: List[Change], apply: Callable[[Change], List[str]], clock: str = "launch",
                 mark_path: Optional[str] = None, events_log: Optional[str] = None, log=print,
                 step_path: Optional[str] = None):
        self.by_step = bool(changes) and changes[0].event.by_step
        if clock == "mark" and not mark_path and not self.by_step:
            raise ValueError("the mark clock needs the path of its mark file")
        if self.by_step and not step_path:
            raise ValueError("events placed by training step need the path of the step file (mark_step)")
        if any(c.event.at_step is None for c in changes if c.event.by_step):
            raise ValueError("an at_fraction event was not resolved to its step (events.resolve_steps)")
        self.changes = changes
        self.apply = apply
        self.clock = clock
        self.mark_path = mark_path
        self.step_path = step_path
        self.step: Optional[int] = None  # the last step count a rank reported (step timelines)
        self.log = log
        self.error: Optional[str] = None
        self.applied: List[int] = []  # timeline indices, in order
        self.zero: Optional[float] = None  # time.monotonic() of the timeline's zero
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next = 0  # first change not yet applied
        self._file: Optional[TextIO] = open(events_log, "a", encoding="utf-8") if events_log else None

    # -- control (launcher's thread) -------------------------------------------------------------------
    def start(self, launched: float) -> None:
        """`launched`: time.monotonic() when the ranks were started (the zero of the `launch` clock)."""
        if self.clock == "launch" or self.by_step:
            self.zero = launched
        self._thread = threading.Thread(target=self._run, name="pdv-event-player", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop, wait for a change in flight, log what was not applied, close the log. Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.log(f"event player still applying a change after {timeout:.0f}s; cleaning up anyway")
        if self._next < len(self.changes):
            if self.error:
                why = "an earlier event failed"
            elif self.by_step and self.step is None:
                why = NO_PROGRESS
            elif self.by_step:
                why = f"the run ended at step {self.step}"
            elif self.zero is None:
                why = "the run ended before any rank called mark_start()"
            else:
                why = "the run ended first"
            for c in self.changes[self._next:]:
                self._record(c, None, None, applied=False, reason=why)
                self.log(f"event {c.index} at {c.event.when} not applied ({why}): {c.text}")
            self._next = len(self.changes)
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.by_step:
            return self._run_steps()
        while self.zero is None:  # the mark clock: wait for the first rank's mark
            if self._stop.wait(POLL_S):
                return
            try:
                made = os.stat(self.mark_path).st_mtime
            except FileNotFoundError:
                continue
            self.zero = time.monotonic() - max(0.0, time.time() - made)
            self.log(f"timeline started by a rank's mark_start() at {wall_iso(made)}")
        for c in self.changes:
            if self._stop.wait(max(0.0, self.zero + c.event.at - time.monotonic())):
                return
            if not self._apply_one(c):
                return

    def _run_steps(self) -> None:
        """Each event once the reported step count reaches its `at_step` (in step order)."""
        for c in self.changes:
            while self._poll_step() is None or self.step < c.event.at_step:
                if self._stop.wait(POLL_S):
                    return
            if not self._apply_one(c):
                return

    def _poll_step(self) -> Optional[int]:
        got = read_step(self.step_path)
        if got is not None and (self.step is None or got > self.step):  # never backwards
            self.step = got
        return self.step

    def _apply_one(self, c: Change) -> bool:
        """Apply and log one change; False (and `error` set) when it failed."""
        step = self.step if self.by_step else None
        try:
            notes = self.apply(c)
        except Exception as exc:  # report it; the launcher stops the run
            self.error = f"event {c.index} ({c.event.origin}: {c.text}) failed: {exc}"
            self._record(c, None, time.time(), applied=False, reason=f"failed: {exc}")
            self._next += 1
            self.log(self.error)
            return False
        wall, applied_at = time.time(), time.monotonic() - self.zero
        self._record(c, applied_at, wall, applied=True, step=step)
        self._next += 1
        self.applied.append(c.index)
        extra = "".join(f"; {n}" for n in notes)
        if step is None:
            self.log(f"event {c.index} at +{applied_at:.1f}s (wall {wall_iso(wall)}): {c.text}{extra}")
        else:
            placed = "" if step == c.event.at_step else f", placed at step {c.event.at_step}"
            self.log(f"event {c.index} at step {step} (+{applied_at:.1f}s{placed}, wall {wall_iso(wall)}): "
                     f"{c.text}{extra}")
        return True

    def _record(self, c: Change, applied_at: Optional[float], wall: Optional[float], applied: bool,
                reason: Optional[str] = None, step: Optional[int] = None) -> None:
        """One JSON line: seconds since the timeline's zero (`applied_at`) and time.time() (`wall`); a step
        event's line also has `at_step` (`at_fraction`) and `applied_step`, the step count reported when it was
        applied (None: not applied)."""
        if self._file is None:
            return
        line = {"index": c.index, "at": c.event.at,
                "applied_at": None if applied_at is None else round(applied_at, 4),
                "wall": wall, "kind": c.kind, "target": c.target, "before": c.before, "after": c.after,
                "applied": applied}
        if c.event.by_step:
            line["at_step"] = c.event.at_step
            if c.event.at_fraction is not None:
                line["at_fraction"] = c.event.at_fraction
            line["applied_step"] = step
        if reason:
            line["reason"] = reason
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
