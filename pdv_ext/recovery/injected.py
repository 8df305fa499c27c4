"""Faults injected on purpose: the tests kill a rank at one phase of a snapshot (`PDV_SNAPSHOT_FAULT`) or of an
in-place recovery (`PDV_INPLACE_FAULT`). One spec format for both, `PHASE[@STEP]:RANK[,...]`, parsed once per
value; `check` at set-up turns a bad one into a ConfigError then, not half-way through a recovery."""
from __future__ import annotations

import functools
import os
import re
from typing import FrozenSet, Optional, Sequence, Tuple

#: (phase, step or None, rank)
Fault = Tuple[str, Optional[int], int]


@functools.lru_cache(maxsize=None)
def _parse(env: str, spec: str, phases: Tuple[str, ...], with_step: bool) -> FrozenSet[Fault]:
    form = "PHASE@STEP:RANK" if with_step else "PHASE:RANK"
    out = set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        m = re.fullmatch(r"(\w+)(?:@(\d+))?:(\d+)", item)
        if m is None or m.group(1) not in phases or (m.group(2) is not None) != with_step:
            from ..config_base import ConfigError

            raise ConfigError([f"{env}={spec!r}: {item!r} is not {form} (comma-separated), PHASE one of "
                               f"{', '.join(phases)}"])
        out.add((m.group(1), int(m.group(2)) if with_step else None, int(m.group(3))))
    return frozenset(out)


def faults(env: str, phases: Sequence[str], with_step: bool = False) -> FrozenSet[Fault]:
    """The faults `env` asks for (empty when unset); a bad spec is a ConfigError naming `env`."""
    return _parse(env, os.environ.get(env, "").strip(), tuple(phases), with_step)


def fires(env: str, phases: Sequence[str], phase: str, rank: int, step: Optional[int] = None) -> bool:
    """Whether `env` asks for a fault at `phase` (of `step`, when the spec has steps) on `rank`."""
    return (phase, None if step is None else int(step), int(rank)) in faults(env, phases, step is not None)
