"""The emulated network: namespaces, veth pairs, bridges and `tc` limits, all named after one run.

Layout for a run named `pdv-<id>` (nothing is created in the root namespace):

    pdv-<id>-sw        core switch: bridge br0, one port `h<k>` per host
    pdv-<id>-h<k>      host k: bridge br0 (the host's internal fabric) + uplink `up0` to the core switch
    pdv-<id>-d<i>      device i: `eth0` (address 10.251.<k>.<j+1>/16) plugged into its host's bridge

Each device sits in its own namespace behind its host's bridge, so intra-host traffic is a real link that
tc can shape per pair. Limits follow the cluster's links:
- device egress (`eth0`): an htb class per destination device at that pair's bandwidth (intra-host or
  inter-host, including per-pair overrides), with netem delay = the pair's one-way latency where the kernel
  has sch_netem;
- host uplink egress (`up0`): an htb class per destination host at the host pair's bandwidth, so devices of
  one host that talk to another host at the same time share the inter-host link (contention).

Each such class has two leaves: the traffic marked as background (IP TOS `BACKGROUND_TOS`, DSCP CS1: the
snapshot keepers' copies, `recovery.keeper.background_socket`) goes to one served only when the other, all
the rest, has nothing to send (htb's `prio` among classes borrowing from their parent). A real network with
QoS serves CS1 that way, and the copies and the training's own traffic often take different networks; with
one FIFO an 8 KB activation waited behind the copy's queue (3.6 ms round trips on the 100 Mbit/s link
instead of 0.8).
"""
from __future__ import annotations

import re
import subprocess
from typing import List, Optional

from ..recovery.keeper import BACKGROUND_TOS  # (DSCP CS1: served after the rest of a link's traffic)
from .spec import SUBNET, EmuSpec, device_ip

MTU = 9000
NORMAL_LEAF, BACKGROUND_LEAF = 0x100, 0x200  # a link class's leaves: minor + these
STALE_RE = re.compile(r"^pdv-[0-9a-f]{6}-")


class NetError(RuntimeError):
    pass


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise NetError(f"`{' '.join(args)}` failed: {(p.stderr or p.stdout).strip()}")
    return p


def uplink_bandwidth(spec: EmuSpec, bandwidth: List[List[float]], k: int, q: int) -> float:
    """Host k's uplink towards host q runs at the fastest of the pairs between them: one pair alone is
    limited by its own class, pairs sending at once share the uplink."""
    mine = [i for i in range(len(spec.devices)) if spec.host_index(i) == k]
    theirs = [j for j in range(len(spec.devices)) if spec.host_index(j) == q]
    return max(bandwidth[i][j] for i in mine for j in theirs)


def list_netns() -> List[str]:
    p = run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> List[int]:
    p = run("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _rate(bytes_per_s: float) -> str:
    return f"{max(8000, int(bytes_per_s * 8))}bit"


GSO_PACKET = 65536  # the largest packet a device with GSO hands its qdisc


def _burst(bytes_per_s: float, packet: int = MTU) -> str:
    """htb's token bucket: what an idle link sends at once, before the rate applies. Two packets (the
    shaped veths send no GSO super-packets where `_no_gso` succeeds) or 0.2 ms of traffic: a real link has
    no such credit, and a 2 ms / 128 KiB bucket let half of a 262 KB activation through a 100 Mbit/s link
    at once (10.5 ms instead of 21), which the cost model, rightly, does not know."""
    return f"{max(2 * packet, int(bytes_per_s * 0.0002))}b"


def _no_gso(ns: str, dev: str) -> bool:
    """Packets of at most one MTU on a shaped device: htb charges a 64 KiB GSO super-packet at once, so its
    bucket would have to hold two of them (see `_burst`). False where the kernel or iproute2 cannot."""
    return run("ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", str(MTU), check=False).returncode == 0


class Network:
    """Builds and removes the namespaces of one run."""

    def __init__(self, spec: EmuSpec, run_name: str, netem: Optional[bool] = None):
        self.spec = spec
        self.name = run_name
        self.sw = f"{run_name}-sw"
        self.store_ns = f"{run_name}-st"  # a host of its own for a rendezvous store (`add_store_host`)
        self.host_ns = [f"{run_name}-h{k}" for k in range(len(spec.hosts))]
        self.dev_ns = [f"{run_name}-d{i}" for i in range(len(spec.devices))]
        self.created: List[str] = []
        self._netem = netem
        self._packet = MTU  # largest packet the shaped devices send (see `_no_gso`)

    # -- set-up ---------------------------------------------------------------------------------------
    def _add_ns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.created.append(ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")

    def create(self) -> None:
        spec = self.spec
        self._add_ns(self.sw)
        run("ip", "-n", self.sw, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        run("ip", "-n", self.sw, "link", "set", "br0", "up")
        if self._netem is None:
            self._netem = run("tc", "-n", self.sw, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                              check=False).returncode == 0
            run("tc", "-n", self.sw, "qdisc", "del", "dev", "lo", "root", check=False)
        for k, hns in enumerate(self.host_ns):
            self._add_ns(hns)
            run("ip", "-n", hns, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
            run("ip", "-n", hns, "link", "add", "up0", "mtu", str(MTU), "type", "veth", "peer", "name", f"h{k}",
                "netns", self.sw)
            run("ip", "-n", hns, "link", "set", "up0", "master", "br0")
            run("ip", "-n", self.sw, "link", "set", f"h{k}", "mtu", str(MTU), "master", "br0", "up")
            run("ip", "-n", hns, "link", "set", "up0", "up")
            run("ip", "-n", hns, "link", "set", "br0", "up")
        for i, dns in enumerate(self.dev_ns):
            hns = self.host_ns[spec.host_index(i)]
            self._add_ns(dns)
            run("ip", "-n", dns, "link", "add", "eth0", "mtu", str(MTU), "type", "veth", "peer", "name", f"d{i}",
                "netns", hns)
            run("ip", "-n", hns, "link", "set", f"d{i}", "mtu", str(MTU), "master", "br0", "up")
            run("ip", "-n", dns, "addr", "add", f"{device_ip(spec, i)}/16", "dev", "eth0")
            run("ip", "-n", dns, "link", "set", "eth0", "up")
        for i in range(len(spec.devices)):
            self._shape_device(i)
        for k in range(len(spec.hosts)):
            self._shape_uplink(k)

    def add_store_host(self, address: str) -> None:
        """A namespace on the core switch with `address`, outside every emulated host (its traffic is not
        shaped): where an elastic run's rendezvous store lives, so that losing any host leaves it standing."""
        self._add_ns(self.store_ns)
        run("ip", "-n", self.store_ns, "link", "add", "eth0", "mtu", str(MTU), "type", "veth", "peer", "name", "st0",
            "netns", self.sw)
        run("ip", "-n", self.sw, "link", "set", "st0", "mtu", str(MTU), "master", "br0", "up")
        run("ip", "-n", self.store_ns, "addr", "add", f"{address}/16", "dev", "eth0")
        run("ip", "-n", self.store_ns, "link", "set", "eth0", "up")

    def set_host_link(self, k: int, up: bool) -> None:
        """Host k's uplink to the core switch up or down (a lost host's links drop)."""
        run("ip", "-n", self.host_ns[k], "link", "set", "up0", "up" if up else "down")

    @property
    def netem(self) -> bool:
        return bool(self._netem)

    def _htb_root(self, ns: str, dev: str) -> None:
        if not _no_gso(ns, dev):
            self._packet = GSO_PACKET  # buckets of two super-packets instead (coarser on short transfers)
        run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "0")

    def _htb_class(self, ns: str, dev: str, minor: int, bytes_per_s: float, delay_s: float, match: str) -> None:
        """The link class towards `match` (at its rate) and its two leaves, each with the link's delay: all
        traffic in the first; what is marked as background (`BACKGROUND_TOS`) in the second, which htb serves
        only when the first has nothing to send (the leaves borrow all of their rate from the class, the
        first at the higher priority)."""
        self._htb_rate("add", ns, dev, minor, bytes_per_s)
        for leaf, prio in ((minor + NORMAL_LEAF, "0"), (minor + BACKGROUND_LEAF, "1")):
            self._htb_leaf("add", ns, dev, minor, leaf, bytes_per_s, prio)
            self._delay("add", ns, dev, leaf, delay_s)
        run("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "dst", match, "match", "ip", "tos", f"{BACKGROUND_TOS:#x}", "0xfc",
            "flowid", f"1:{minor + BACKGROUND_LEAF:x}")
        run("tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "2", "u32",
            "match", "ip", "dst", match, "flowid", f"1:{minor + NORMAL_LEAF:x}")

    def _htb_rate(self, verb: str, ns: str, dev: str, minor: int, bytes_per_s: float) -> None:
        run("tc", "-n", ns, "class", verb, "dev", dev, "parent", "1:", "classid", f"1:{minor:x}", "htb", "rate",
            _rate(bytes_per_s), "ceil", _rate(bytes_per_s), "burst", _burst(bytes_per_s, self._packet), "cburst",
            _burst(bytes_per_s, self._packet), "quantum", "65536")
        if verb == "change":  # the leaves may borrow up to the class's new rate
            for leaf, prio in ((minor + NORMAL_LEAF, "0"), (minor + BACKGROUND_LEAF, "1")):
                self._htb_leaf("change", ns, dev, minor, leaf, bytes_per_s, prio)

    def _htb_leaf(self, verb: str, ns: str, dev: str, minor: int, leaf: int, bytes_per_s: float, prio: str) -> None:
        run("tc", "-n", ns, "class", verb, "dev", dev, "parent", f"1:{minor:x}", "classid", f"1:{leaf:x}", "htb",
            "rate", _rate(0), "ceil", _rate(bytes_per_s), "burst", _burst(bytes_per_s, self._packet), "cburst",
            _burst(bytes_per_s, self._packet), "quantum", "65536", "prio", prio)

    def _delay(self, verb: str, ns: str, dev: str, minor: int, delay_s: float) -> None:
        """The class's leaf: netem with the delay where the kernel has it and there is a delay, else a fifo.
        `replace` swaps one for the other on a running class."""
        if self.netem and delay_s > 0:
            run("tc", "-n", ns, "qdisc", verb, "dev", dev, "parent", f"1:{minor:x}", "netem", "delay",
                f"{delay_s * 1e6:.0f}us", "limit", "100000")
        else:
            run("tc", "-n", ns, "qdisc", verb, "dev", dev, "parent", f"1:{minor:x}", "pfifo", "limit", "1000")

    def _shape_device(self, i: int) -> None:
        ns = self.dev_ns[i]
        self._htb_root(ns, "eth0")
        for j in range(len(self.spec.devices)):
            if j != i:
                self._htb_class(ns, "eth0", 16 + j, self.spec.bandwidth[i][j], self.spec.latency[i][j],
                                f"{device_ip(self.spec, j)}/32")

    def _shape_uplink(self, k: int) -> None:
        spec, ns = self.spec, self.host_ns[k]
        others = [q for q in range(len(spec.hosts)) if q != k]
        if not others:
            return
        self._htb_root(ns, "up0")
        for q in others:
            bw = uplink_bandwidth(spec, spec.bandwidth, k, q)
            self._htb_class(ns, "up0", 16 + q, bw, 0.0, f"{SUBNET}.{q}.0/24")

    # -- live changes (emulate/events.py); the classes and leaves `create` made, in this run's namespaces ----
    def set_rate(self, i: int, j: int, bytes_per_s: float) -> None:
        """Device i's rate towards device j."""
        self._htb_rate("change", self.dev_ns[i], "eth0", 16 + j, bytes_per_s)

    def set_delay(self, i: int, j: int, delay_s: float) -> bool:
        """Device i's one-way delay towards device j; False (nothing done) where the kernel has no netem."""
        if not self.netem:
            return False
        for leaf in (NORMAL_LEAF, BACKGROUND_LEAF):
            self._delay("replace", self.dev_ns[i], "eth0", 16 + j + leaf, delay_s)
        return True

    def set_uplink_rate(self, k: int, q: int, bytes_per_s: float) -> None:
        """Host k's shared uplink rate towards host q."""
        self._htb_rate("change", self.host_ns[k], "up0", 16 + q, bytes_per_s)

    # -- tear-down ------------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Delete every namespace of this run (their veths, bridges and qdiscs go with them)."""
        remove_namespaces([ns for ns in list_netns() if ns.startswith(self.name + "-")])
        self.created = []


def remove_namespaces(names: List[str]) -> None:
    import os
    import signal

    for ns in sorted(names, key=lambda n: (n.endswith("-sw"), "-h" in n)):  # devices, hosts, switch
        for pid in ns_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run("ip", "netns", "del", ns, check=False)


def stale_namespaces() -> List[str]:
    return [ns for ns in list_netns() if STALE_RE.match(ns)]
