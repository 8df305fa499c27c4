"""What the emulator needs from a cluster description: devices (host, relative speed), per ordered pair of
devices the link's bandwidth and latency, and where each device sits in the emulated network.

The cluster YAML and its validation belong to the placement package (`pdv_ext.placement.cluster`); this
module only reads its loaded object, so there is one format and one set of error messages.

The address plan (`10.251.<host>.<device + 1>`) follows from the devices' hosts and positions, so it lives
here with them: the network (netns.py) and the launcher read addresses from the spec, and a cluster that does
not fit the plan is rejected when the spec is built, before anything is created.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

SUBNET = "10.251"


@dataclass
class EmuDevice:
    name: str
    host: str
    speed: float  # relative throughput (any unit; only ratios matter)


@dataclass
class EmuSpec:
    devices: List[EmuDevice]
    bandwidth: List[List[float]]  # bytes/s from device i to device j (diagonal unused)
    latency: List[List[float]]  # seconds, one way
    # the cluster's link classes, "intra_host" / "inter_host" -> (bytes/s, seconds one way): what a live
    # change of a whole class (emulate/events.py) reports as its previous value
    links: Dict[str, Tuple[float, float]] = field(default_factory=dict)

    @property
    def hosts(self) -> List[str]:
        seen: List[str] = []
        for d in self.devices:
            if d.host not in seen:
                seen.append(d.host)
        return seen

    def host_index(self, i: int) -> int:
        return self.hosts.index(self.devices[i].host)

    def local_rank(self, i: int) -> int:
        return [j for j, d in enumerate(self.devices) if d.host == self.devices[i].host].index(i)

    def local_size(self, i: int) -> int:
        return sum(1 for d in self.devices if d.host == self.devices[i].host)


def device_ip(spec: EmuSpec, i: int) -> str:
    return f"{SUBNET}.{spec.host_index(i)}.{spec.local_rank(i) + 1}"


def check_address_plan(spec: EmuSpec) -> None:
    """ValueError when the cluster does not fit `10.251.<host>.<device + 1>` (at most 256 hosts of 254
    devices; `.255` would be the host's broadcast address): an octet above 255 is an invalid address that
    `ip` rejects half-way through set-up, so this runs before anything is created."""
    per_host = Counter(d.host for d in spec.devices)
    if len(per_host) > 256:
        raise ValueError(f"{len(per_host)} hosts: the emulated network has room for at most 256 hosts")
    for host, n in per_host.items():
        if n > 254:
            raise ValueError(f"host '{host}' has {n} devices: the emulated network has room for at most 254 "
                             "devices per host (split them over more hosts)")


def load_spec(path: str) -> EmuSpec:
    """Load a cluster YAML through the placement package's loader and keep what the emulator needs."""
    from ..placement.cluster import Cluster

    return from_cluster(Cluster.load(path))


def from_cluster(cluster) -> EmuSpec:
    """The emulator's view of a loaded cluster; ValueError when it does not fit the emulated network."""
    devs = [EmuDevice(d.name, d.host, float(d.throughput)) for d in cluster.devices]
    n = len(devs)
    bw = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                link = cluster.link(i, j)
                bw[i][j] = float(link.bandwidth)
                lat[i][j] = float(link.latency)
    classes = {"intra_host": cluster.spec.links.intra_host, "inter_host": cluster.spec.links.inter_host}
    spec = EmuSpec(devs, bw, lat, {k: (float(v.bandwidth), float(v.latency)) for k, v in classes.items()})
    check_address_plan(spec)
    return spec
