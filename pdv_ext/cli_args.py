"""Argument checks shared by the `pdv` commands: a bad flag is one `ap.error` line (exit 2) naming it,
before any rank, process group or long computation starts (a zero count would otherwise fail inside the
ranks, or not at all; a missing output directory after minutes of work)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Dict, Optional, Sequence


def check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace, at_least: Optional[Dict[str, int]] = None,
                 positive: Sequence[str] = ()) -> None:
    """Each flag of `at_least` ({"--ranks": 2}) must be at least its value, each of `positive` a finite
    number > 0 (float() takes nan, inf, -1). Flags left unset (None) are not checked."""
    for flag, low in (at_least or {}).items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < low:
            ap.error(f"{flag} must be >= {low} (got {value})")
    for flag in positive:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and not (math.isfinite(value) and value > 0):
            ap.error(f"{flag} must be a finite number > 0 (got {value:g})")


def check_out(ap: argparse.ArgumentParser, flag: str, path: Optional[str]) -> None:
    """An output path whose directory is missing (or that is a directory) fails now, not after the work."""
    if path is None:
        return
    if os.path.isdir(path):
        ap.error(f"{flag} {path}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        ap.error(f"{flag} {path}: directory {parent} does not exist")
