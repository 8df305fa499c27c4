"""Solvers: dp is the exact optimum of the cost model over its search space (brute force), the
differentiable solver returns a feasible plan no better than dp, baselines are DeepSpeed's partitions."""
import itertools

import numpy as np
import pytest

from pdv_ext.placement.cluster import Cluster, synthetic_cluster
from pdv_ext.placement.cost import evaluate
from pdv_ext.placement.profile import Profile
from pdv_ext.placement.solvers import SOLVERS, divisors_widths, solve
from pdv_ext.placement.solvers.dp import candidate_chains


def brute_force(prof, cluster, stages, micro_batches, schedule="1f1b", aggregator="mean"):
    """Every width, every candidate chain, every split: the dp search space, enumerated."""
    best = float("inf")
    for w in divisors_widths(len(cluster), len(prof), stages):
        s = len(cluster) // w
        for chain in candidate_chains(cluster, w).values():
            for cuts in itertools.combinations(range(1, len(prof)), s - 1):
                cb = evaluate(prof, cluster, [0, *cuts, len(prof)], chain, micro_batches, schedule, aggregator)
                if cb.feasible:
                    best = min(best, cb.step_time)
    return best


def random_instance(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.choice([2, 4, 6]))
    mem = seed % 3 == 0
    devs = [{"name": f"d{i}", "host": f"h{i // 2}", "throughput": float(rng.choice([1.0, 0.5, 0.25])),
             **({"memory": float(rng.uniform(3e7, 2e8))} if mem else {})} for i in range(n)]
    cluster = Cluster.from_dict({"devices": devs, "links": {
        "intra_host": {"bandwidth": float(rng.uniform(1e8, 1e9)), "latency": 1e-4},
        "inter_host": {"bandwidth": float(rng.uniform(1e6, 1e8)), "latency": 1e-3}}})
    prof = Profile.synthetic(int(rng.integers(3, 9)), seed=seed, heavy_every=int(rng.integers(0, 4)))
    stages = None if seed % 2 else int(rng.choice([d for d in range(1, n + 1) if n % d == 0 and d <= len(prof)]))
    if seed % 4:  # a per-step parameter update up to a few micro-batches' compute: the tail matters
        for layer in prof.layers:
            layer.update = float(rng.uniform(0.0, 3.0)) * layer.fwd_bwd
    if seed % 3:  # send/recv work at the boundaries, paid by the stages on both sides
        for layer in prof.layers:
            layer.p2p = float(rng.uniform(0.0, 0.5)) * layer.fwd_bwd
    if seed % 5 in (1, 3):  # DeepSpeed's per-micro-batch and per-step work: per-stage constants
        mean = float(np.mean([l.fwd_bwd for l in prof.layers]))
        prof.engine = {"micro_batch": float(rng.uniform(0.0, 1.0)) * mean, "step": float(rng.uniform(0.0, 2.0)) * mean}
    return prof, cluster, stages, int(rng.integers(1, 9))


@pytest.mark.parametrize("seed", range(24))
def test_dp_equals_brute_force(seed):
    prof, cluster, stages, mb = random_instance(seed)
    schedule = "gpipe" if seed % 5 == 0 else "1f1b"
    aggregator = ["mean", "adasum", "median"][seed % 3]
    expected = brute_force(prof, cluster, stages, mb, schedule, aggregator)
    if expected == float("inf"):
        with pytest.raises(ValueError, match="no memory-feasible plan"):
            solve("dp", prof, cluster, stages, mb, schedule=schedule, aggregator=aggregator)
        return
    plan = solve("dp", prof, cluster, stages, mb, schedule=schedule, aggregator=aggregator)
    assert plan.feasible and plan.meta["exact"]
    assert plan.predicted_step_time == pytest.approx(expected, rel=1e-9)
    # the plan's own evaluation agrees with the score
    cb = evaluate(prof, cluster, plan.boundaries, plan.rank_mapping, mb, schedule, aggregator)
    assert cb.step_time == pytest.approx(plan.predicted_step_time, rel=1e-12)


def test_dp_prefers_fast_devices_for_heavy_stages():
    cluster = Cluster.from_dict({"devices": [
        {"name": "slow0", "host": "a", "throughput": 0.25}, {"name": "slow1", "host": "a", "throughput": 0.25},
        {"name": "fast0", "host": "b", "throughput": 1.0}, {"name": "fast1", "host": "b", "throughput": 1.0}]})
    prof = Profile.synthetic(12, seed=3)
    plan = solve("dp", prof, cluster, 2, 8)
    rm = solve("deepspeed_uniform", prof, cluster, 2, 8)
    assert plan.predicted_step_time <= rm.predicted_step_time
    fast_stage = [s for s, g in enumerate(plan.rank_mapping) if set(g) <= {2, 3}]
    sizes = np.diff(plan.boundaries)
    if fast_stage:  # the fast group gets more layers
        assert sizes[fast_stage[0]] >= sizes.max()


@pytest.mark.parametrize("seed", [1, 2])
def test_differentiable_feasible_and_not_better_than_dp(seed):
    prof = Profile.synthetic(16, seed=seed, heavy_every=5)
    for layer in prof.layers[::seed]:  # every seed-th layer: parameter update and messages (relaxed terms)
        layer.update, layer.p2p = 2.0 * layer.fwd_bwd, 0.2 * layer.fwd_bwd
    prof.engine = {"micro_batch": 0.2 * prof.layers[0].fwd_bwd, "step": 0.5 * prof.layers[0].fwd_bwd}
    cluster = synthetic_cluster(8, per_host=4, generations=(1.0, 0.5))
    dp = solve("dp", prof, cluster, 4, 8)
    diff = solve("differentiable", prof, cluster, 4, 8, steps=40)
    assert diff.feasible and len(diff.boundaries) == 5 and diff.boundaries[-1] == 16
    assert all(b > a for a, b in zip(diff.boundaries, diff.boundaries[1:]))
    assert sorted(r for g in diff.rank_mapping for r in g) == list(range(8))
    assert diff.predicted_step_time >= dp.predicted_step_time * (1 - 1e-12)


def test_baselines_are_deepspeeds_partitions():
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    prof = Profile.synthetic(10, seed=4, heavy_every=3)
    cluster = synthetic_cluster(4, per_host=2)
    p = solve("deepspeed_parameters", prof, cluster, 2, 4)
    u = solve("deepspeed_uniform", prof, cluster, 2, 4)
    weights = [int(round(b)) for b in prof.arrays()["param_bytes"]]
    assert p.boundaries == list(partition_balanced(weights, 2))
    assert u.boundaries == list(partition_uniform(10, 2))
    assert p.rank_mapping == [[0, 1], [2, 3]] == u.rank_mapping


def test_registry_and_bad_stage_count():
    assert {"dp", "differentiable", "deepspeed_parameters", "deepspeed_uniform"} <= set(SOLVERS.names())
    prof = Profile.synthetic(6)
    with pytest.raises(ValueError, match="do not divide"):
        solve("dp", prof, synthetic_cluster(4, per_host=2), 3, 2)
