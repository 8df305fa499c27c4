"""`pdv emulate --cluster C.yaml [--timeout S] -- COMMAND...` and `pdv emulate --cleanup`.

Runs COMMAND once per device of the cluster, each in its own network namespace behind its host's
bridge, with tc-shaped links and a CPU quota proportional to the device's speed (see netns.py and
cgroup.py). Exit code: the first failing rank's, 124 on timeout, 2 when emulation is unavailable.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..cli_args import check_ranges
from . import launcher, netns
from .spec import device_ip, load_spec


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdv emulate", description=__doc__.split("\n\n")[1],
                                 usage="pdv emulate --cluster C.yaml [--timeout S] -- COMMAND...\n"
                                       "       pdv emulate --cleanup")
    ap.add_argument("--cluster", help="cluster YAML (devices, hosts, links)")
    ap.add_argument("--timeout", type=float, default=None, help="kill every rank after S seconds (exit 124)")
    ap.add_argument("--cpu-budget", type=float, default=None,
                    help="cores shared by all devices (default 0.55 x the machine's cores)")
    ap.add_argument("--top-share", type=float, default=None,
                    help="cores given to the fastest device (default: what fits the budget, at most 1)")
    ap.add_argument("--run-name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="print the namespaces, addresses, rates and quotas")
    ap.add_argument("--cleanup", action="store_true", help="remove namespaces/cgroups left by killed runs")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    return ap


def describe(em: "launcher.Emulation") -> str:
    spec, lines = em.spec, []
    for i, d in enumerate(spec.devices):
        lines.append(f"rank {i}: {d.name} on {d.host} ns={em.name}-d{i} ip={device_ip(spec, i)} "
                     f"cpu={em.cores[i]:.3f} cores")
    for i in range(len(spec.devices)):
        for j in range(len(spec.devices)):
            if i != j:
                lines.append(f"link {i}->{j}: {spec.bandwidth[i][j] * 8 / 1e6:.1f} Mbit/s, "
                             f"{spec.latency[i][j] * 1e6:.0f} us")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cleanup:
        try:
            launcher.check_available()
        except launcher.EmulationUnavailable as exc:
            print(f"pdv emulate: {exc}", file=sys.stderr)
            return 2
        n = launcher.cleanup_stale(log=lambda m: print(f"pdv emulate: {m}", file=sys.stderr))
        print(f"pdv emulate: removed {n} stale resource(s)", file=sys.stderr)
        return 0
    if not args.cluster or (not command and not args.dry_run):
        ap.print_usage(sys.stderr)
        print("pdv emulate: error: needs --cluster C.yaml and a command after --", file=sys.stderr)
        return 2
    check_ranges(ap, args, positive=["--timeout", "--cpu-budget", "--top-share"])
    if args.top_share is not None and args.top_share > (os.cpu_count() or 1):
        ap.error(f"--top-share {args.top_share:g} is more than this machine's {os.cpu_count() or 1} cores")
    try:
        spec = load_spec(args.cluster)
    except Exception as exc:  # the loader's own message names the bad key
        print(f"pdv emulate: {args.cluster}: {exc}", file=sys.stderr)
        return 2
    em = launcher.Emulation(spec, command, timeout=args.timeout, cpu_budget=args.cpu_budget,
                            top_share=args.top_share, run_name=args.run_name)
    if args.dry_run:
        print(describe(em))
        return 0
    try:
        launcher.check_available()
    except launcher.EmulationUnavailable as exc:
        print(f"pdv emulate: {exc}", file=sys.stderr)
        return 2
    print(f"pdv emulate: run {em.name}: {len(spec.devices)} devices on {len(spec.hosts)} hosts", file=sys.stderr)
    try:
        return em.run()
    except KeyboardInterrupt:
        print("pdv emulate: interrupted; everything removed", file=sys.stderr)
        return 130
    except netns.NetError as exc:
        print(f"pdv emulate: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
