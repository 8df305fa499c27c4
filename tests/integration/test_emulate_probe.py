"""`pdv probe` under `pdv emulate` recovers the emulated link bandwidths and device speeds within 20% (root).

Device speeds are CPU quotas, which are ceilings, not guarantees: on a VM whose host steals CPU time the
devices do not get them. Where the steal share during the run exceeds STEAL_LIMIT the speeds are held to
the looser NOISY_SPEED_TOL (the run says so), links to 20% always."""
import os
import secrets
import subprocess
import sys
import warnings

import pytest

from pdv_ext.emulate.hoststat import StealMeter

from .test_emulate_cluster import EMULATE_MARKS, ROOT, _leftovers

pytestmark = EMULATE_MARKS

# unequal devices, fast intra-host and slow inter-host links, one slower pair
CLUSTER = """
devices:
  - {name: fast0, host: a, throughput: 2.0}
  - {name: fast1, host: a, throughput: 2.0}
  - {name: slow0, host: b, throughput: 1.0}
links:
  intra_host: {bandwidth: 800 Mbit/s, latency: 50us}
  inter_host: {bandwidth: 200 Mbit/s, latency: 1ms}
  pairs:
    - {a: fast1, b: slow0, bandwidth: 100 Mbit/s}
"""


TOL = 0.2  # the bound, for links and (on a host that delivers the quotas) device speeds
# Seen on this VM kind under heavy steal (2026-11-23, up to 50%): the 0.2-core device at 0.35-0.49 of the
# 0.4-core ones (nominal 0.5); with no steal (2026-11-24): 0.52-0.55 over three probes.
NOISY_SPEED_TOL = 0.4
STEAL_LIMIT = 0.05


@pytest.mark.timeout(150)
def test_probe_recovers_emulated_cluster(tmp_path):
    pytest.importorskip("pdv_ext.placement.probe", reason="pdv probe is not in this build")
    from pdv_ext.placement.cluster import Cluster

    src, out = tmp_path / "emulated.yaml", tmp_path / "probed.yaml"
    src.write_text(CLUSTER)
    run = f"pdv-{secrets.token_hex(3)}"
    meter = StealMeter()
    p = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "emulate", "--cluster", str(src), "--run-name", run,
                        # A quota is a ceiling, not a guarantee: on a VM whose host steals CPU time a fast
                        # device given 0.64 of a core got only ~0.5 while the slow one still got its 0.32, and
                        # the probe (rightly) measured slow/fast = 0.67 (CI, session 2). 0.4 of a core for the
                        # fastest device stays deliverable with up to ~60% steal; the ratios are what is tested.
                        "--top-share", "0.4",
                        "--timeout", "120", "--", sys.executable, "-m", "pdv_ext.cli", "probe", "--out", str(out),
                        # bandwidth-dominated sizes: latency is not emulated without sch_netem, and small
                        # messages to a CPU-throttled rank carry scheduling stalls that skew the fit
                        "--sizes", "2097152", "4194304", "8388608", "--reps", "3",
                        # matmuls long enough to span many CFS periods of the throttled ranks, and enough
                        # rounds that one slow sample does not move the median (single samples swing +-25%)
                        "--matmul-size", "1024", "--rounds", "15"],
                       capture_output=True, text=True, timeout=140, cwd=ROOT)
    steal = meter.fraction() or 0.0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not _leftovers(run)
    want, got = Cluster.load(str(src)), Cluster.load(str(out))
    assert len(got) == len(want)
    n = len(want)
    top_want = max(want.devices[i].throughput for i in range(n))
    top_got = max(got.devices[i].throughput for i in range(n))
    speed_tol = TOL if steal <= STEAL_LIMIT else NOISY_SPEED_TOL
    errors = []
    for i in range(n):
        rel_want = want.devices[i].throughput / top_want
        rel_got = got.devices[i].throughput / top_got
        # Under steal (2026-11-23, 15 interleaved rounds) one 0.1 s matmul sample swung +-25% and the 0.2-core
        # device delivered a median 0.42 of the 0.4-core ones, not 0.5 (docs/playground.md).
        if abs(rel_got - rel_want) > speed_tol * rel_want:
            errors.append(f"device {i} speed {rel_got:.2f} (emulated {rel_want:.2f})")
        for j in range(n):
            if i != j:
                bw_want, bw_got = want.link(i, j).bandwidth, got.link(i, j).bandwidth
                if abs(bw_got - bw_want) > TOL * bw_want:
                    errors.append(f"link {i}->{j} {bw_got * 8 / 1e6:.0f} Mbit/s (emulated {bw_want * 8 / 1e6:.0f})")
    if speed_tol != TOL:
        warnings.warn(f"host steal {steal:.0%} > {STEAL_LIMIT:.0%} during the probe: device speeds checked within "
                      f"{speed_tol:.0%}, not {TOL:.0%}")
    assert not errors, "; ".join(errors) + f" (the VM's steal time during the run: {steal:.0%}; speed tolerance " \
        f"{speed_tol:.0%})"
