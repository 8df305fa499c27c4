"""Plays a timeline of changes (weather.py) on a running emulation, one thread, each change logged.

The zero of the timeline is the ranks' start (`launch`) or the moment a rank first calls
`events.mark_start()` (`mark`: the player polls for the file the launcher named in `PDV_EVENTS_MARK`).
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

from .weather import Change

POLL_S = 0.02  # how often the `mark` clock looks for its file


class EventError(RuntimeError):
    """An event could not be applied to the running emulation (the message names it)."""


def wall_iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class EventPlayer:
    """`apply(change)` writes one change to the emulation and returns notes for its log line (e.g. that
    latency is not emulated)."""

    def __init__(self, changes: List[Change], apply: Callable[[Change], List[str]], clock: str = "launch",
                 mark_path: Optional[str] = None, events_log: Optional[str] = None, log=print):
        if clock == "mark" and not mark_path:
            raise ValueError("the mark clock needs the path of its mark file")
        self.changes = changes
        self.apply = apply
        self.clock = clock
        self.mark_path = mark_path
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
        if self.clock == "launch":
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
            elif self.zero is None:
                why = "the run ended before any rank called mark_start()"
            else:
                why = "the run ended first"
            for c in self.changes[self._next:]:
                self._record(c, None, None, applied=False, reason=why)
                self.log(f"event {c.index} at +{c.event.at:.1f}s not applied ({why}): {c.text}")
            self._next = len(self.changes)
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
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
            try:
                notes = self.apply(c)
            except Exception as exc:  # report it; the launcher stops the run
                self.error = f"event {c.index} ({c.event.origin}: {c.text}) failed: {exc}"
                self._record(c, None, time.time(), applied=False, reason=f"failed: {exc}")
                self._next += 1
                self.log(self.error)
                return
            wall, applied_at = time.time(), time.monotonic() - self.zero
            self._record(c, applied_at, wall, applied=True)
            self._next += 1
            self.applied.append(c.index)
            extra = "".join(f"; {n}" for n in notes)
            self.log(f"event {c.index} at +{applied_at:.1f}s (wall {wall_iso(wall)}): {c.text}{extra}")

    def _record(self, c: Change, applied_at: Optional[float], wall: Optional[float], applied: bool,
                reason: Optional[str] = None) -> None:
        """One JSON line: seconds since the timeline's zero (`applied_at`) and time.time() (`wall`)."""
        if self._file is None:
            return
        line = {"index": c.index, "at": c.event.at,
                "applied_at": None if applied_at is None else round(applied_at, 4),
                "wall": wall, "kind": c.kind, "target": c.target, "before": c.before, "after": c.after,
                "applied": applied}
        if reason:
            line["reason"] = reason
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
