"""Comm helpers and the mean aggregator on a single-process group."""
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.comm import LocalComm


def test_local_comm_helpers():
    c = LocalComm()
    assert c.all_gather_object({"a": 1}) == [{"a": 1}]
    assert c.broadcast_object([1, 2]) == [1, 2]
    assert c.all_reduce_scalars([1.5, 2.0]) == [1.5, 2.0]
    assert [t.tolist() for t in c.all_gather_varsize(torch.arange(3.0))] == [[0.0, 1.0, 2.0]]


def test_mean_buckets_and_dtypes():
    grads = [torch.randn(5), torch.randn(3, dtype=torch.float64), torch.randn(7)]
    before = [g.clone() for g in grads]
    agg = build_aggregator({"type": "mean", "bucket_elements": 4})
    out = agg(grads, LocalComm())
    assert all(o is g for o, g in zip(out, grads))  # in place
    assert all(torch.equal(a, b) for a, b in zip(out, before))  # mean over one replica is the identity
    assert agg.step == 1 and agg.state_dict() == {"step": 1}
