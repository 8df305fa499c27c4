"""Shared plumbing of the `pdv bench NAME` commands: argument parsing and the one-JSON-line contract."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Dict, Optional, Sequence

from ..cli_args import check_ranges  # noqa: F401  (the benches' flag checks)


def parser(name: str, doc: Optional[str]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"pdv bench {name}", description=doc)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    return ap


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
