"""Every aggregator takes tensors of any layout through `Aggregator.__call__` (issue #21): strided views
(a matrix column, a transposed matrix, every other element), zero-size tensors, and a layout that differs
between ranks give the results of contiguous copies, written back into the caller's views; what cannot be
taken is rejected before any communication, on every rank alike."""
import pytest
import torch

from pdv_ext.aggregation import AGGREGATORS, build_aggregator
from tests.threadcomm import run_threads

SPECS = [{"type": "mean"}, {"type": "adasum"}, {"type": "median"}, {"type": "trimmed_mean", "b": 1},
         {"type": "suspicion", "k": 1}, {"type": "zeno", "b": 1}, {"type": "gossip", "peers": 1, "ratio": 0.5}]


def test_every_builtin_is_covered():
    assert {s["type"] for s in SPECS} >= {n for n in AGGREGATORS.names() if not n.startswith(("hvd_test", "test"))}


def _views(rank: int, step: int):
    """(views into bigger tensors, the bigger tensors, their values before) for one rank and step."""
    g = torch.Generator().manual_seed(100 * step + rank)
    mat = torch.randn(30, 5, generator=g)
    wide = torch.randn(9, 200, generator=g)
    strip = torch.randn(2 * 1500, generator=g)
    mixed = torch.randn(4, 6, generator=g)
    if rank % 2:  # the same values, another layout on odd ranks
        mixed = mixed.t().contiguous().t()
    parents = [mat, wide, strip]
    views = [mat[:, 3], wide.t(), strip[::2], torch.empty(0, 3), torch.randn(7, generator=g), mixed,
             torch.empty(4, 0).t()]
    return views, parents, [p.clone() for p in parents]


def _validation(rank: int):
    g = torch.Generator().manual_seed(999)
    return [torch.randn(30, generator=g), torch.randn(200, 9, generator=g), torch.randn(1500, generator=g),
            torch.empty(0, 3), torch.randn(7, generator=g), torch.randn(4, 6, generator=g), torch.empty(0, 4)]


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["type"])
def test_strided_inputs_equal_contiguous_copies(spec, size):
    def fn(comm):
        strided, plain = build_aggregator(dict(spec)), build_aggregator(dict(spec))
        outs = []
        for step in range(2):  # a second step: state (error feedback, RNG) carried alike
            views, parents, before = _views(comm.rank, step)
            copies = [v.contiguous().clone() for v in views]
            for agg in (strided, plain):
                if agg.needs_validation:
                    agg.set_validation_grads(_validation(comm.rank))
            out_s = strided(views, comm)
            out_p = plain(copies, comm)
            written_back = all(o is v for o, v in zip(out_s, views) if not v.is_contiguous())
            # outside the views, the parent tensors are untouched
            rest = [torch.cat([parents[0][:, :3], parents[0][:, 4:]], 1), parents[2][1::2]]
            rest_before = [torch.cat([before[0][:, :3], before[0][:, 4:]], 1), before[2][1::2]]
            untouched = all(torch.equal(a, b) for a, b in zip(rest, rest_before))
            outs.append(([o.clone() for o in out_s], [o.clone() for o in out_p], written_back, untouched,
                         [tuple(o.shape) for o in out_s]))
        return outs

    for rank_res in run_threads(size, fn):
        for out_s, out_p, written_back, untouched, shapes in rank_res:
            assert written_back and untouched
            assert shapes == [tuple(o.shape) for o in out_p]
            for a, b in zip(out_s, out_p):
                assert torch.equal(a, b), spec


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["type"])
def test_rejected_before_any_communication_on_every_rank(spec):
    bad = [torch.randn(5), torch.ones(4, 1).expand(4, 3)]  # an expanded view cannot take results back

    def fn(comm):
        agg = build_aggregator(dict(spec))
        with pytest.raises(ValueError, match="overlap"):
            agg(bad, comm)
        with pytest.raises(ValueError, match="layout"):
            agg([torch.ones(3).to_sparse()], comm)
        return dict(comm.calls), agg.step

    assert run_threads(3, fn) == [({}, 0)] * 3
