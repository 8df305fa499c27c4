"""`pdv check-config FILE [--world-size N [--stages S]]`: one line per error naming the key path, exit 2;
`ok` and exit 0 when valid.

With `--world-size N` the config is also checked for N ranks in S pipeline stages (default: the placement
section's `num_stages`, else 1): each stage's data-parallel group has N / S ranks. An aggregation option
that such a group cannot support is clamped at run time with one warning; check-config prints the same
line, prefixed `warning: `, before `ok` (exit 0). Errors (N not divisible by S, a `num_stages` that
disagrees with `--stages`, an aggregator undefined on that group) exit 2 as any other.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pdv check-config", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="DeepSpeed config JSON with a \"pdv\" section (or a pdv YAML/JSON)")
    ap.add_argument("--world-size", type=int, default=None, metavar="N",
                    help="also check the config for N ranks (every data-parallel group is N / S ranks)")
    ap.add_argument("--stages", type=int, default=None, metavar="S",
                    help="pipeline stages (with --world-size; default: pdv.placement.num_stages, else 1)")
    args = ap.parse_args(argv)
    if args.stages is not None and args.world_size is None:
        print("--stages: needs --world-size N (the ranks to split into stages)")
        return 2
    from .config import check_file

    notes: List[str] = []
    errors = check_file(args.file, world_size=args.world_size, stages=args.stages, notes=notes)
    if errors:
        for line in errors:
            print(line)
        return 2
    for line in notes:
        print(f"warning: {line}")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
