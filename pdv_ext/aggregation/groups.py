"""One rule for small data-parallel groups (docs/aggregation.md, "Small groups").

A stage's data-parallel group has `m = world_size / num_stages` ranks, and users change both all the time.
The same `"pdv"` section must run on every topology where the algorithm is defined, so an aggregator whose
option needs more ranks than the group has does not fail at its first step: it runs with the option
clamped to the largest value the group supports, and says so once (a `GroupSizeWarning` naming the key),
e.g. `pdv.aggregation.b=2 clamped to 0 for a data-parallel group of 2`. At `m = 1` every built-in is the
identity, silently (there is no other replica to tolerate or talk to). Undefined cases (none among the
built-ins; a plug-in may have some) are errors that `pdv check-config --world-size N --stages S` reports
before launch.

An aggregator takes part by listing its group-dependent options in `group_limits` (option key -> the
largest value a group of m ranks supports) and mixing in `SmallGroups`. The engine may call
`bind(group_size, rank)` as soon as it knows the group (warnings then come before the first step);
otherwise `fit_group(comm)` at the first `aggregate` does the same.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar, Dict, List, Optional, Set, Tuple

from ..config_base import ConfigError

PREFIX = "pdv.aggregation"


class GroupSizeWarning(UserWarning):
    """An aggregation option was clamped to what the stage's data-parallel group supports."""


def clamp_line(key: str, want: int, got: int, size: int, why: str = "") -> str:
    line = f"{PREFIX}.{key}={want} clamped to {got} for a data-parallel group of {size}"
    return f"{line} ({why})" if why else line


class SmallGroups:
    """Mixin of the built-in aggregators: clamp group-dependent options to the group, warn once.

    Subclasses set `group_limits = {key: (largest(m) -> int, why)}`; `requested(key)` is the configured
    value (override for aliases) and `option_key(key)` the key the user wrote (for the message).
    `effective(key)` is the value in force for the group last fitted (the configured one before any)."""

    group_limits: ClassVar[Dict[str, Tuple[Callable[[int], int], str]]] = {}
    group_size: Optional[int] = None
    _effective: Optional[Dict[str, int]] = None
    _warned: Optional[Set[Tuple[str, int, int]]] = None
    _bound_from: Optional[Dict[str, int]] = None

    def requested(self, key: str) -> int:
        return int(getattr(self.options, key))

    def option_key(self, key: str) -> str:
        return key

    def clamps(self, size: int) -> List[Tuple[str, int, int, str]]:
        """(key as written, configured, clamped, why) of every option the group of `size` clamps. A group
        of one is the identity whatever the options: nothing to say."""
        out = []
        if size <= 1:
            return out
        for key, (largest, why) in self.group_limits.items():
            want = self.requested(key)
            got = min(want, max(0, int(largest(size))))
            if got != want:
                out.append((self.option_key(key), want, got, why))
        return out

    def group_errors(self, size: int) -> List[str]:
        """Error lines for a group of `size` ranks where the algorithm is undefined (none for built-ins)."""
        return []

    def bind(self, group_size: int, rank: int = 0) -> Dict[str, int]:
        """Fit the options to a data-parallel group of `group_size` ranks (this rank is `rank` in it):
        clamp, warn once per clamped option (on group rank 0 only, so once per group), return the values
        in force. Idempotent; called again when the group or an option (`set_peers`) changes."""
        errors = self.group_errors(group_size)
        if errors:
            raise ConfigError(errors)
        eff = {key: (self.requested(key) if group_size > 1 else 0) for key in self.group_limits}
        for key, want, got, why in self.clamps(group_size):
            eff[next(k for k in self.group_limits if self.option_key(k) == key)] = got
            if self._warned is None:
                self._warned = set()
            tag = (key, want, group_size)
            if rank == 0 and tag not in self._warned:
                self._warned.add(tag)
                warnings.warn(clamp_line(key, want, got, group_size, why), GroupSizeWarning, stacklevel=3)
        self.group_size, self._effective = group_size, eff
        self._bound_from = {k: self.requested(k) for k in self.group_limits}
        return eff

    def fit_group(self, comm: Any) -> Dict[str, int]:
        """`bind` to `comm`'s group unless already bound to one of that size with the same options: a
        dict lookup per step."""
        if (self.group_size != comm.size or self._effective is None or self._bound_from is None
                or any(self._bound_from[k] != self.requested(k) for k in self.group_limits)):
            return self.bind(comm.size, comm.rank)
        return self._effective

    def effective(self, key: str) -> int:
        if self._effective is None:
            return self.requested(key)
        return self._effective[key]


def group_notes(spec: Any, size: int) -> Tuple[List[str], List[str]]:
    """(clamp notes, errors) of an aggregation spec on a data-parallel group of `size` ranks, without
    running anything (for `pdv check-config --world-size N --stages S`). A spec that does not build
    gives no notes (its own errors are reported by the schema check)."""
    from .base import build_aggregator

    try:
        agg = build_aggregator(spec)
    except Exception:  # noqa: BLE001 - reported by the schema check
        return [], []
    clamps = getattr(agg, "clamps", None)
    notes = [clamp_line(k, w, g, size, why) for k, w, g, why in clamps(size)] if clamps else []
    errs = getattr(agg, "group_errors", None)
    return notes, (errs(size) if errs else [])


def bind_group(aggregator: Any, comm: Any) -> None:
    """Fit `aggregator` to `comm`'s group now, when it has group-dependent options: a clamp warns (or a
    group it cannot run on fails) when the aggregator is chosen, not at its first step."""
    bind = getattr(aggregator, "bind", None)
    if callable(bind):
        bind(comm.size, comm.rank)
