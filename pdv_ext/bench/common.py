"""Shared plumbing of the `pdv bench NAME` commands: argument parsing and the one-JSON-line contract."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence


def parser(name: str, doc: Optional[str]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"pdv bench {name}", description=doc)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    return ap


def check_ranges(ap: argparse.ArgumentParser, args: argparse.Namespace, at_least: Optional[Dict[str, int]] = None,
                 positive: Sequence[str] = ()) -> None:
    """Exit 2 with one `ap.error` line naming the first numeric flag out of range, before any rank starts
    (a zero count would fail inside the ranks, or not at all): each flag of `at_least` ({"--ranks": 2})
    must be at least its value, each of `positive` a finite number > 0 (float() takes nan, inf, -1)."""
    for flag, low in (at_least or {}).items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value < low:
            ap.error(f"{flag} must be >= {low} (got {value})")
    for flag in positive:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if not (math.isfinite(value) and value > 0):
            ap.error(f"{flag} must be a finite number > 0 (got {value})")


def emit(result: Dict[str, Any], as_json: bool) -> None:
    """Print the result: a readable table, or (with --json) exactly one JSON object as the last line."""
    if not as_json:
        width = max((len(k) for k in result), default=0)
        for key, value in result.items():
            print(f"{key:<{width}}  {value}")
        return
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=False, default=float), flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def log(msg: str) -> None:
    """Progress for humans goes to stderr so stdout ends with the JSON line."""
    print(msg, file=sys.stderr, flush=True)
