"""What the emulator needs from a cluster description: devices (host, relative speed) and, per ordered
pair of devices, the link's bandwidth and latency.

The cluster YAML and its validation belong to the placement package (`pdv_ext.placement.cluster`); this
module only reads its loaded object, so there is one format and one set of error messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List


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
    spec = EmuSpec(devs, bw, lat)
    from .netns import check_address_plan  # the addresses are netns's; checked before anything is created

    check_address_plan(spec)
    return spec
