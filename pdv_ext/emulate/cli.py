"""`pdv emulate --cluster C.yaml [--timeout S] [--events FILE] -- COMMAND...` and `pdv emulate --cleanup`.

Runs COMMAND once per device of the cluster, each in its own network namespace behind its host's
bridge, with tc-shaped links and a CPU quota proportional to the device's speed (see netns.py and
cgroup.py), and plays the cluster's events (its `events:` and --events FILE) while the ranks run.
Exit code: the first failing rank's, 124 on timeout, 2 when emulation is unavailable or the input is
bad, 1 when an event could not be applied.

With fault events (`{at_step: 30, host: hostB, down: true}`, a device `down`, either coming back with
`down: false`) or `--elastic`, each device runs COMMAND under its own torchrun agent (elastic.py): the job is
restarted on the devices that are left, as under torchrun on a real cluster; the run succeeds when every
agent that was not killed by an event ends with 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..cli_args import check_ranges
from ..config_base import ConfigError
from ..placement.cluster import Cluster
from . import launcher, netns
from .events import CLOCKS, load_timeline
from .spec import device_ip, from_cluster


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdv emulate", description=__doc__.split("\n\n")[1],
                                 usage="pdv emulate --cluster C.yaml [--timeout S] [--events FILE] -- COMMAND...\n"
                                       "       pdv emulate --cleanup")
    ap.add_argument("--cluster", help="cluster YAML (devices, hosts, links)")
    ap.add_argument("--timeout", type=float, default=None, help="kill every rank after S seconds (exit 124)")
    ap.add_argument("--cpu-budget", type=float, default=None,
                    help="cores shared by all devices (default 0.55 x the machine's cores)")
    ap.add_argument("--top-share", type=float, default=None,
                    help="cores given to the fastest device (default: what fits the budget, at most 1)")
    ap.add_argument("--events", default=None, metavar="FILE",
                    help="timeline of events (YAML/JSON: a list, or a mapping with an 'events:' list), merged with "
                         "the cluster's own 'events:'")
    ap.add_argument("--events-log", default=None, metavar="PATH",
                    help="append one JSON line per event (applied or not) to PATH")
    ap.add_argument("--events-clock", choices=CLOCKS, default="launch",
                    help="the events' zero: when the ranks start (launch, default) or when a rank first calls "
                         "pdv_ext.emulate.events.mark_start() (mark)")
    ap.add_argument("--total-steps", type=int, default=None, metavar="N",
                    help="the run's training steps, for events placed 'at_fraction' of the run (events 'at_step' "
                         "need a rank to report its steps: pdv_ext.emulate.events.mark_step)")
    ap.add_argument("--elastic", action="store_true",
                    help="run each device's COMMAND under a torchrun agent even without fault events (with them "
                         "it always is)")
    ap.add_argument("--startup-on-host", action="store_true",
                    help="start each worker on its host's CPU, outside its device's quota, until it calls "
                         "pdv_ext.initialize (start-up runs at a real host's speed whatever its GPU's; a program "
                         "that never calls it runs without a quota)")
    ap.add_argument("--run-name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true",
                    help="print the namespaces, addresses, rates, quotas and the timeline of events")
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
    if em.elastic:
        from .elastic import STORE_IP, STORE_PORT

        lines.append(f"supervision: a torchrun agent per device, rendezvous store at {STORE_IP}:{STORE_PORT} "
                     "(a host of its own); ranks follow the rendezvous, each worker's device is PDV_DEVICE_NAME")
    if em.startup_on_host:
        lines.append("start-up: each worker on its host's CPU (no quota) until it calls pdv_ext.initialize")
    lines.append(describe_timeline(em))
    return "\n".join(lines)


def describe_timeline(em: "launcher.Emulation") -> str:
    if not em.changes:
        return "timeline: no events"
    if em.by_step:
        zero = "by training step, as rank 0 reports it (mark_step)"
    else:
        zero = "from " + ("when the ranks start" if em.events_clock == "launch" else
                          "when a rank first calls mark_start()")
    lines = [f"timeline: {len(em.changes)} event{'s' if len(em.changes) != 1 else ''}, {zero}"]
    lines += [f"event {c.index} at {c.event.when}: {c.text}" for c in em.changes]
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
    check_ranges(ap, args, at_least={"--total-steps": 1}, positive=["--timeout", "--cpu-budget", "--top-share"])
    if args.top_share is not None and args.top_share > (os.cpu_count() or 1):
        ap.error(f"--top-share {args.top_share:g} is more than this machine's {os.cpu_count() or 1} cores")
    try:  # the cluster, then every event checked and worked out here, before anything exists
        cluster = Cluster.load(args.cluster)
        spec = from_cluster(cluster)
        events = load_timeline(cluster.spec.events, args.cluster, args.events, spec)
        em = launcher.Emulation(spec, command, timeout=args.timeout, cpu_budget=args.cpu_budget,
                                top_share=args.top_share, run_name=args.run_name, events=events,
                                events_log=args.events_log, events_clock=args.events_clock,
                                total_steps=args.total_steps, elastic=True if args.elastic else None,
                                startup_on_host=args.startup_on_host)
    except ConfigError as exc:  # one line per problem, each naming its file and key (an event: its index)
        for line in exc.errors:
            print(f"pdv emulate: {line}", file=sys.stderr)
        return 2
    except ValueError as exc:  # the cluster does not fit the emulated network, or a timeline value
        print(f"pdv emulate: {args.cluster}: {exc}", file=sys.stderr)
        return 2
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
    except launcher.EventError as exc:
        print(f"pdv emulate: {exc}; the run was stopped and everything removed", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
