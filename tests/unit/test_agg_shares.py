"""Data shares: what each aggregator makes of unequal per-replica sample counts (`samples=`).

"weight" aggregators (mean, gossip, zeno) return the sample-weighted mean, i.e. the exact mean over every
sample of the step when each replica's gradient is the mean over its own samples; "count" aggregators
(adasum, median, trimmed_mean, suspicion) count every replica once. Equal shares take the unweighted code
path bit for bit.
"""
import pytest
import torch

from pdv_ext.aggregation import AGGREGATORS, build_aggregator
from pdv_ext.aggregation.base import unequal_samples
from tests.threadcomm import run_threads

SAMPLES = [24, 8, 16, 16]  # micro-batches x micro-batch size of 4 replicas


def _per_sample_grads(seed=0, n=sum(SAMPLES), shape=(5, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, *shape, generator=g, dtype=torch.float64),
            torch.randn(n, 7, generator=g, dtype=torch.float64)]


def _replica_means(samples):
    """Each replica's gradient: the mean over its own contiguous slice of the per-sample gradients."""
    per = _per_sample_grads()
    bounds = [0]
    for n in samples:
        bounds.append(bounds[-1] + n)
    return [[t[bounds[r]:bounds[r + 1]].mean(0) for t in per] for r in range(len(samples))], per


def _run(spec, samples, validation=None):
    means, per = _replica_means(SAMPLES)

    def fn(comm):
        agg = build_aggregator(spec)
        if validation is not None:
            agg.set_validation_grads([t.mean(0) for t in per])
        grads = [t.clone() for t in means[comm.rank]]
        return [o.clone() for o in agg(grads, comm, samples=samples)]

    return run_threads(len(SAMPLES), fn), per


@pytest.mark.parametrize("spec", [{"type": "mean"}, {"type": "gossip", "ratio": 1.0, "sync_every": 1},
                                  {"type": "zeno", "b": 0}])
def test_weight_aggregators_give_the_exact_mean_over_all_samples(spec):
    out, per = _run(spec, SAMPLES, validation=spec["type"] == "zeno" or None)
    exact = [t.mean(0) for t in per]  # one process on the whole batch
    assert AGGREGATORS.get(spec["type"]).shares == "weight"
    for rank_out in out:
        for o, e in zip(rank_out, exact):
            torch.testing.assert_close(o, e, rtol=1e-12, atol=1e-12)


def test_mean_without_weights_would_be_wrong():
    """The test above can fail: the unweighted mean of the replica means is not the mean over samples."""
    out, per = _run({"type": "mean"}, None)
    assert not torch.allclose(out[0][0], per[0].mean(0), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["mean", "gossip", "zeno", "adasum", "median", "trimmed_mean", "suspicion"])
def test_equal_shares_are_bit_identical_to_no_shares(name):
    spec = {"type": name, **({"b": 1} if name == "zeno" else {})}
    a, _ = _run(spec, [8, 8, 8, 8], validation=True if name == "zeno" else None)
    b, _ = _run(spec, None, validation=True if name == "zeno" else None)
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)


@pytest.mark.parametrize("name", ["adasum", "median", "trimmed_mean", "suspicion"])
def test_count_aggregators_ignore_the_shares(name):
    assert AGGREGATORS.get(name).shares == "count"
    a, _ = _run({"type": name}, SAMPLES)
    b, _ = _run({"type": name}, None)
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)


def test_zeno_weights_only_the_kept_candidates():
    """With one candidate dropped, the kept ones are averaged by their shares."""
    means, per = _replica_means(SAMPLES)
    means[1] = [-50.0 * t for t in means[1]]  # descends nowhere: zeno drops it

    def fn(comm):
        agg = build_aggregator({"type": "zeno", "b": 1})
        agg.set_validation_grads([t.mean(0) for t in per])
        out = [o.clone() for o in agg([t.clone() for t in means[comm.rank]], comm, samples=SAMPLES)]
        return out, agg.report["dropped"]

    res = run_threads(4, fn)
    kept = [0, 2, 3]
    total = sum(SAMPLES[i] for i in kept)
    want = [sum(means[i][k] * SAMPLES[i] for i in kept) / total for k in range(2)]
    for out, dropped in res:
        assert dropped == [1]
        for o, w in zip(out, want):
            torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)


def test_bad_samples_are_one_clear_error():
    with pytest.raises(ValueError, match="one positive integer count per rank of the group of 4"):
        unequal_samples([1, 2, 3], 4)
    with pytest.raises(ValueError, match="positive"):
        unequal_samples([1, 0, 3, 1], 4)
    with pytest.raises(ValueError, match="integer"):
        unequal_samples([1.5, 2, 3, 1], 4)
    assert unequal_samples([3, 3], 2) is None
    assert unequal_samples([3, 1], 2) == [3, 1]
