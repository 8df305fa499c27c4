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


PROBED = """
devices:
- {name: fast0, host: hostA, throughput: 3.0e10, memory: 1.2e10}
- {name: fast1, host: hostA, throughput: 3.3e10, memory: 1.2e10}
- {name: slow0, host: hostB, throughput: 1.8e10, memory: 1.2e10}
- {name: slow1, host: hostB, throughput: 6.0e9, memory: 1.2e10}
links:
  intra_host: {bandwidth: 1.1e8, latency: 6.0e-05}
  inter_host: {bandwidth: 1.24e7, latency: 0.0}
  pairs: []
"""


def test_probed_cluster_keeps_names_hosts_memory_and_takes_measured_speeds_and_links(tmp_path):
    from pdv_ext.bench.placement import _probed_cluster
    from pdv_ext.placement.cluster import reference_device
    from pdv_ext.placement.profile import LayerProfile, Profile

    path = tmp_path / "probed.yaml"
    path.write_text(PROBED)
    yaml_cluster = Cluster.load(DEFAULT_CLUSTER)
    ref = reference_device(yaml_cluster)
    assert ref == 0
    c = _probed_cluster(yaml_cluster, str(path), ref)
    assert [d.name for d in c.devices] == [d.name for d in yaml_cluster.devices]
    assert [c.memory(i) for i in range(4)] == [yaml_cluster.memory(i) for i in range(4)]  # emulated limits
    assert [round(c.speed(i), 3) for i in range(4)] == [1.0, 1.1, 0.6, 0.2]  # matmul, relative to the profiler
    assert c.link(0, 3).bandwidth == 1.24e7 and c.link(0, 1).latency == 6e-5
    # every device's time for the model's forward + backward, when measured, sets the speeds
    prof = Profile([LayerProfile("l", 1.0, 1.0, 1.0)], meta={"workload_seconds": [0.1, 0.125, 0.2, 0.5]})
    c = _probed_cluster(yaml_cluster, str(path), ref, prof)
    assert [round(c.speed(i), 3) for i in range(4)] == [1.0, 0.8, 0.5, 0.2]
    assert c.link(0, 3).bandwidth == 1.24e7
    # combined: the geometric mean of the two relative speeds (matmul 1.1, 0.6, 0.2; workload 0.8, 0.5, 0.2)
    c = _probed_cluster(yaml_cluster, str(path), ref, prof, combine=True)
    assert [round(c.speed(i), 4) for i in range(4)] == [1.0, round((1.1 * 0.8) ** 0.5, 4), round((0.6 * 0.5) ** 0.5, 4), 0.2]


def test_stage_comparison_takes_each_stages_slowest_rank_per_micro_batch():
    from types import SimpleNamespace

    from pdv_ext.bench.placement import stage_comparison

    cb = SimpleNamespace(stages=[
        SimpleNamespace(stage=0, layers=[0, 2], devices=[0, 1], compute=0.040, time=0.050),
        SimpleNamespace(stage=1, layers=[2, 4], devices=[2, 3], compute=0.080, time=0.090)])
    run = [{"ForwardPass": [40.0, 30.0], "BackwardPass": [80.0, 60.0]},
           {"ForwardPass": [60.0, 30.0], "BackwardPass": [100.0, 70.0]},  # stage 0's slowest
           {"ForwardPass": [100.0, 50.0], "BackwardPass": [300.0, 90.0], "RecvActivation": [500.0, 1.0]},
           {"ForwardPass": [90.0, 40.0], "BackwardPass": [250.0, 80.0]}]
    rows = stage_comparison(cb, [run, None], micro_batches=4)  # a run without a breakdown is skipped
    assert rows[0]["predicted_compute_ms"] == 40.0 and rows[0]["predicted_ms"] == 50.0
    assert rows[0]["measured_fwd_bwd_ms"] == [40.0] and rows[0]["measured_fwd_bwd_cpu_ms"] == [25.0]
    assert rows[1]["measured_fwd_bwd_ms"] == [100.0] and rows[1]["measured_fwd_bwd_cpu_ms"] == [35.0]


def test_calibrated_profile_sums_to_the_whole_pass_and_keeps_shares():
    from pdv_ext.placement.profile import LayerProfile, Profile

    prof = Profile([LayerProfile("a", 0.010, 1.0, 2.0, 3.0, 0.004, 0.001),
                    LayerProfile("b", 0.030, 1.0, 2.0, 3.0, 0.002, 0.001)], meta={"x": 1})
    cal = prof.calibrated(0.050)
    assert [round(l.fwd_bwd, 6) for l in cal.layers] == [0.0125, 0.0375]
    assert [l.update for l in cal.layers] == [0.004, 0.002]  # only the forward + backward is rescaled
    assert cal.meta == {"x": 1, "fwd_bwd_scale": 1.25} and prof.layers[0].fwd_bwd == 0.010
    import pytest
    with pytest.raises(ValueError, match="cannot calibrate"):
        prof.calibrated(0.0)


def test_combined_profile_takes_medians_and_pools_device_timings():
    import pytest

    from pdv_ext.placement.profile import LayerProfile, Profile

    def prof(t, upd, eng_mb, rounds, scale):
        return Profile([LayerProfile("a", t, 8.0, 16.0, 32.0, upd, 0.001), LayerProfile("b", 2 * t, 8.0, 16.0, 32.0, upd, 0.002)],
                       meta={"workload_rounds": rounds, "workload_seconds": [0, 0], "fwd_bwd_scale": scale},
                       engine={"micro_batch": eng_mb, "step": 10 * eng_mb, "slope": 1.0})

    profs = [prof(0.010, 0.004, 0.001, [[1.0, 2.0], [4.0]], 0.9), prof(0.030, 0.001, 0.003, [[3.0], [5.0, 6.0]], 1.1),
             prof(0.020, 0.002, 0.002, [[9.0], [7.0]], 1.0)]
    c = Profile.combined(profs)
    assert [l.fwd_bwd for l in c.layers] == [0.020, 0.040] and [l.update for l in c.layers] == [0.002, 0.002]
    assert [l.param_bytes for l in c.layers] == [8.0, 8.0]
    assert c.engine == {"micro_batch": 0.002, "step": 0.02, "slope": 1.0}
    assert c.meta["workload_rounds"] == [[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0]]
    assert c.meta["workload_seconds"] == [2.5, 5.5]  # medians of the pooled rounds, not of the medians
    assert c.meta["fwd_bwd_scale"] == 1.0 and c.meta["fwd_bwd_scales"] == [0.9, 1.1, 1.0]
    assert c.meta["profiles_combined"] == 3 and profs[0].layers[0].fwd_bwd == 0.010  # inputs untouched
    assert Profile.combined(profs[:1]).layers == profs[0].layers
    # profiles that kept only each device's median: the medians of those
    old = [Profile(p.layers, meta={"workload_seconds": w}) for p, w in zip(profs, ([1, 4], [3, 6], [2, 5]))]
    assert Profile.combined(old).meta["workload_seconds"] == [2, 5]
    assert Profile.combined(old[:1]).meta["workload_seconds"] == [1, 4]
    other = prof(0.01, 0.0, 0.0, [[1.0], [1.0]], 1.0)
    other.layers[1].act_bytes = 99.0
    with pytest.raises(ValueError, match="layer b: act_bytes differ"):
        Profile.combined([profs[0], other])
    with pytest.raises(ValueError, match="at least one"):
        Profile.combined([])
