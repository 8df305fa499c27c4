"""`pdv check-config FILE [--world-size N [--stages S]] [--import MODULE ...]`: one line per problem naming
the key path, exit 2; `ok` and exit 0 when valid.

It loads what the launch will load: the `"pdv"` section (aggregator and policy names, `module:Class`
plugins imported), and the files `pdv.placement` names (cluster YAML with its units, plan JSON, profile
JSON) with the sizes they must agree on. A config with no `"pdv"` section is an error (the launch would
run it with every default; `"pdv": {}` says that on purpose). A cluster YAML given as FILE is checked as a
cluster. Defaults a cluster fills in (a device without `throughput`, a missing link) are printed as
`warning: ` lines before `ok` (exit 0).

With `--world-size N` the config is also checked for N ranks in S pipeline stages (default: the placement
section's `num_stages`, its plan or rank mapping, else 1): a cluster must have N devices, a plan or rank
mapping must place N ranks, and each stage's data-parallel group has N / S ranks. An aggregation option
that such a group cannot support is clamped at run time with one warning; check-config prints the same
line, prefixed `warning: `, before `ok` (exit 0). Errors (N not divisible by S, a `num_stages` that
disagrees with `--stages`, an aggregator undefined on that group) exit 2 as any other.

`--import MODULE` (repeatable; a module name or a .py file) imports your code first, as
the shipped train scripts' `--import` does (`python -m pdv_ext.examples.train_gpt --import`), so that names it registers with a decorator are known.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from .config import ConfigError, check_file, read_file
from .placement.check import load_cluster
from .placement.cluster import ClusterSpec
from .registry import RegistryError, import_user_modules


def looks_like_cluster(data: dict) -> bool:
    """A cluster YAML (`devices`/`hosts` at the top, nothing but cluster keys), not a config."""
    return bool(data) and ("devices" in data or "hosts" in data) and set(data) <= set(ClusterSpec.model_fields)


def check_cluster_file(path: str, world_size: Optional[int], stages: Optional[int],
                       notes: List[str]) -> Tuple[List[str], str]:
    """(errors, the `ok` line) of a cluster YAML given as the file to check."""
    found: List[str] = []
    cluster, errors = load_cluster(path, "cluster", found)
    notes.extend(line[len("cluster: "):] for line in found)
    if cluster is None:
        return [line[len("cluster: "):] for line in errors], ""
    n = len(cluster)
    if world_size is not None and n != world_size:
        errors.append(f"{path}: describes {n} devices (device i is rank i) but --world-size {world_size}")
    if stages is not None and n % stages:
        errors.append(f"--stages: {stages} stages do not divide the {n} devices of {path}")
    hosts = len(cluster.hosts)
    return errors, f"ok (a cluster YAML: {n} device{'s' if n != 1 else ''} on {hosts} host{'s' if hosts != 1 else ''})"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pdv check-config", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="DeepSpeed config JSON with a \"pdv\" section (or a pdv YAML/JSON, or a cluster YAML)")
    ap.add_argument("--world-size", type=int, default=None, metavar="N",
                    help="also check the config for N ranks (every data-parallel group is N / S ranks)")
    ap.add_argument("--stages", type=int, default=None, metavar="S",
                    help="pipeline stages (with --world-size; default: pdv.placement.num_stages, else 1)")
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                    help="import this module (or .py file) first: names it registers become known (repeatable)")
    args = ap.parse_args(argv)
    if args.stages is not None and args.world_size is None:
        print("--stages: needs --world-size N (the ranks to split into stages)")
        return 2
    try:
        import_user_modules(args.imports)
    except RegistryError as exc:
        print(f"--import: {exc}")
        return 2
    notes: List[str] = []
    what = "ok"
    try:
        data = read_file(args.file)
    except ConfigError as exc:
        errors = exc.errors
    else:
        if looks_like_cluster(data):
            errors, what = check_cluster_file(args.file, args.world_size, args.stages, notes)
        else:
            errors = check_file(args.file, world_size=args.world_size, stages=args.stages, notes=notes)
    if errors:
        for line in errors:
            print(line)
        return 2
    for line in notes:
        print(f"warning: {line}")
    print(what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
