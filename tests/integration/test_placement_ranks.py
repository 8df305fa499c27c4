"""A dp plan made at start-up (rank 0 plans, broadcasts) takes effect on 4 DeepSpeed ranks."""
import math

import pytest

from pdv_ext.placement.cluster import Cluster
from pdv_ext.placement.profile import LayerProfile, Profile
from pdv_ext.placement.solvers import solve
from pdv_ext.spawn import run_ranks

pytestmark = pytest.mark.integration

CLUSTER = """
devices:
  - {name: slow0, host: a, throughput: 0.25}
  - {name: slow1, host: a, throughput: 0.25}
  - {name: fast0, host: b, throughput: 1.0}
  - {name: fast1, host: b, throughput: 1.0}
links:
  intra_host: {bandwidth: 1 Gbit/s, latency: 100us}
  inter_host: {bandwidth: 100 Mbit/s, latency: 2ms}
"""


@pytest.mark.timeout(240)
def test_startup_dp_plan_applied(tmp_path):
    cluster_path = tmp_path / "c.yaml"
    cluster_path.write_text(CLUSTER)
    # the last layers are heavy: a plan must give them the fast devices (ranks 2, 3), not row-major's
    prof = Profile([LayerProfile(f"l{i}", 1e-3 * (8 if i >= 5 else 1), 4096.0, 512.0, 1024.0) for i in range(8)])
    prof_path = tmp_path / "p.json"
    prof.save(str(prof_path))
    expected = solve("dp", prof, Cluster.load(str(cluster_path)), 2, 2)
    assert expected.boundaries != [0, 4, 8]  # not DeepSpeed's uniform split: the test can tell
    pdv = {"placement": {"cluster": str(cluster_path), "profile": str(prof_path), "solver": "dp",
                         "micro_batches": 2}}
    results = run_ranks("tests.integration.placement_workers:train_with_placement", 4, {"pdv": pdv}, timeout=200)
    for r in results:
        assert r["parts"] == expected.boundaries
        stage = next(s for s, g in enumerate(expected.rank_mapping) if r["rank"] in g)
        assert r["stage"] == stage
        assert r["dp_ranks"] == sorted(expected.rank_mapping[stage])
        assert all(math.isfinite(x) for x in r["losses"])
