"""Shared plumbing of the `pdv bench NAME` commands: argument parsing and the one-JSON-line contract."""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
from typing import Any, Callable, Dict, Optional, Sequence, TypeVar

from ..cli_args import check_ranges  # noqa: F401  (the benches' flag checks)

T = TypeVar("T")


def parser(name: str, doc: Optional[str]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"pdv bench {name}", description=doc)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    return ap


#: where `emit` writes the JSON line while `json_stdout` holds everything else off stdout (None: sys.stdout)
_json_out: Optional[Any] = None


@contextlib.contextmanager
def json_stdout():
    """Run a bench with --json so that its stdout is the JSON line alone: whatever else is printed meanwhile
    goes to stderr (DeepSpeed's logger, created on first import, writes its warnings to the sys.stdout of that
    moment, so `pdv bench grid --json > out.json` used to start with one), and `emit` writes to the real
    stdout. Processes a bench starts write to their own files or inherit the descriptors, untouched."""
    global _json_out
    real, _json_out = sys.stdout, sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_out = None
        real.flush()


def emit(result: Dict[str, Any], as_json: bool) -> None:
    """Print the result: a readable table, or (with --json) exactly one JSON object as the last line."""
    if not as_json:
        width = max((len(k) for k in result), default=0)
        for key, value in result.items():
            print(f"{key:<{width}}  {value}")
        return
    out = _json_out or sys.stdout
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=False, default=float), file=out, flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def median_item(items: Sequence[T], key: Callable[[T], Optional[float]]) -> T:
    """The item whose key is the median: the lower of the two middle ones of an even count, so the pick is a
    round that ran; a key of None sorts last (a round without the figure is never preferred)."""
    def k(item: T) -> float:
        v = key(item)
        return math.inf if v is None else v
    return sorted(items, key=k)[(len(items) - 1) // 2]


def log(msg: str) -> None:
    """Progress for humans goes to stderr so stdout ends with the JSON line."""
    print(msg, file=sys.stderr, flush=True)


def ready_jit_ops() -> None:
    """Build the JIT ops the ranks load (our CPU kernels, DeepSpeed's CPU shared-memory op) before a bench times
    its first run, in a process with the ranks' environment (`spawn.default_env`: the same cache). Where `make
    setup` did not build them (a fresh clone run by PYTHONPATH, an installed wheel's first bench), the first run
    of a comparison paid the build alone: `pdv bench faults` read 46 s more start-up for whichever way ran first
    (a 40 s build under a slow device's CPU share). A build that fails is left to the ranks, as before."""
    import os
    import subprocess

    from ..spawn import default_env

    code = "from pdv_ext import kernels; kernels.prebuild_jit_ops()"
    log("[bench] the JIT-built ops: built once before the runs are timed (cached after the first time)")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, **default_env()}, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
