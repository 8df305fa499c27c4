"""ElasticBatches: no sample lost or repeated across micro-batch-size changes, resumable position."""
import torch

from pdv_ext.policy.data import ElasticBatches, TextWindows


def _replicas(n, mbs, dp, seed=1):
    x = torch.arange(n)
    return [ElasticBatches((x, x * 10), mbs, d, dp, seed=seed, record=True) for d in range(dp)]


def _step(its, micro_batches):
    out = []
    for it in its:
        for _ in range(micro_batches):
            xb, yb = next(it)
            assert torch.equal(yb, xb * 10)
            out.extend(xb.tolist())
    return out


def test_every_sample_once_per_epoch_across_batch_changes():
    n, dp = 97, 3
    its = _replicas(n, 4, dp)
    seen = []
    plan = [(2, None), (2, None), (3, 2), (1, 5), (4, None), (2, 1), (3, 7), (2, 3)]
    for mb, new_mbs in plan:
        if new_mbs is not None:
            for it in its:
                it.set_micro_batch_size(new_mbs)
        seen += _step(its, mb)
    total = its[0].position
    assert all(it.position == total for it in its) and total == len(seen) > n
    positions = sorted(p for it in its for p in it.seen)
    assert positions == list(range(total))
    ids = its[0].indices(0, total).tolist()
    assert sorted(ids[:n]) == list(range(n))
    assert sorted(seen) == sorted(ids)


def test_state_dict_resumes_the_stream():
    its = _replicas(50, 4, 2)
    _step(its, 3)
    for it in its:
        it.set_micro_batch_size(3)
    _step(its, 2)
    states = [it.state_dict() for it in its]
    expected = _step(its, 2)
    fresh = _replicas(50, 7, 2)
    for it, st in zip(fresh, states):
        it.load_state_dict(st)
    assert _step(fresh, 2) == expected


def test_epochs_are_reshuffled_and_unshuffled_is_ordered():
    it = ElasticBatches((torch.arange(10),), 5, seed=0)
    assert it.indices(0, 10).tolist() != it.indices(10, 10).tolist()
    plain = ElasticBatches((torch.arange(10),), 5, shuffle=False)
    assert next(plain)[0].tolist() == [0, 1, 2, 3, 4]


def test_text_windows():
    ds = TextWindows(b"abcdefghij", 3)
    assert len(ds) == 3
    x, y = ds.fetch(torch.tensor([1]))
    assert bytes(x[0].tolist()) == b"def" and bytes(y[0].tolist()) == b"efg"
    it = ElasticBatches(ds, 2, shuffle=False)
    assert next(it)[0].shape == (2, 3)
