"""`pdv bench placement` helpers that run without the emulator."""
import os

from pdv_ext.bench.placement import DEFAULT_CLUSTER, _without_latency
from pdv_ext.placement.cluster import Cluster


def test_cluster_without_latency_keeps_devices_and_bandwidths():
    cluster = Cluster.load(DEFAULT_CLUSTER)
    flat = _without_latency(cluster)
    assert os.path.exists(DEFAULT_CLUSTER) and len(flat) == len(cluster)
    for a in range(len(cluster)):
        assert flat.speed(a) == cluster.speed(a) and flat.host_of(a) == cluster.host_of(a)
        for b in range(len(cluster)):
            if a != b:
                assert flat.link(a, b).latency == 0.0
                assert flat.link(a, b).bandwidth == cluster.link(a, b).bandwidth
    assert cluster.link(0, 3).latency > 0  # the original is untouched
