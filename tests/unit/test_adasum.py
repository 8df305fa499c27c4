"""adasum on in-process ranks (ThreadComm): the algebra, any rank count, identical replicas."""
import itertools

import pytest
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.aggregation.adasum import PACK_NUMEL, adasum_flat
from tests.threadcomm import run_threads

SHAPES = [(7, 3), (5,), (1,), (64, 33), (2, 2, 2)]


def pair(a, b, eps=1e-8):
    """Reference two-vector Adasum in float64."""
    a, b = a.double(), b.double()
    d, na, nb = (a * b).sum(), (a * a).sum(), (b * b).sum()
    ca = 1 - d / (2 * na) if na >= eps else 1.0
    cb = 1 - d / (2 * nb) if nb >= eps else 1.0
    return ca * a + cb * b


def tree(vecs):
    """Reference of the tree our algorithm (and Horovod's) computes: fold-in of ranks >= P, then pairs."""
    p2 = 1 << (len(vecs).bit_length() - 1)
    vs = [pair(vecs[i], vecs[i + p2]) if i + p2 < len(vecs) else vecs[i].double() for i in range(p2)]
    while len(vs) > 1:
        vs = [pair(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


def run(per_rank, size):
    def fn(comm):
        grads = [t.clone() for t in per_rank[comm.rank]]
        return [g.clone() for g in build_aggregator("adasum")(grads, comm)]
    return run_threads(size, fn)


def rand_grads(size, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in shapes] for _ in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 8])
def test_matches_reference_tree_and_replicas_identical(size):
    per_rank = rand_grads(size, seed=size)
    out = run(per_rank, size)
    for r in range(1, size):
        for x, y in zip(out[0], out[r]):
            assert torch.equal(x, y)  # bit-identical replicas
    for t in range(len(SHAPES)):
        ref = tree([per_rank[r][t].reshape(-1) for r in range(size)])
        torch.testing.assert_close(out[0][t].reshape(-1).double(), ref, rtol=2e-5, atol=1e-6)


MIXED = [(5,), (300, 300), (7, 3), (1,), (70_000,), (2, 2)]  # small ones are packed, large ones are not


@pytest.mark.parametrize("size", [3, 4])
def test_packed_small_tensors_keep_their_own_coefficients(size):
    assert 300 * 300 > PACK_NUMEL and 70_000 > PACK_NUMEL  # both paths run
    per_rank = rand_grads(size, seed=10 + size, shapes=MIXED)
    out = run(per_rank, size)
    for r in range(1, size):
        for x, y in zip(out[0], out[r]):
            assert torch.equal(x, y)
    for t, shape in enumerate(MIXED):
        assert out[0][t].shape == shape
        ref = tree([per_rank[r][t].reshape(-1) for r in range(size)])
        torch.testing.assert_close(out[0][t].reshape(-1).double(), ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("size", [3, 5])
def test_empty_tensors_with_folded_ranks(size):
    shapes = [(5,), (0,), (300, 300), (3,), (0, 4)]  # an empty tensor has no segment in the fold-in
    per_rank = rand_grads(size, seed=20 + size, shapes=shapes)
    out = run(per_rank, size)
    for t, shape in enumerate(shapes):
        assert out[0][t].shape == shape
        if out[0][t].numel():
            ref = tree([per_rank[r][t].reshape(-1) for r in range(size)])
            torch.testing.assert_close(out[0][t].reshape(-1).double(), ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_orthogonal_gradients_add(size):
    n = 24
    per_rank = []
    for r in range(size):  # rank r owns coordinates r, r+size, ... of every tensor: mutually orthogonal
        v = torch.zeros(n)
        v[r::size] = torch.arange(1, len(v[r::size]) + 1, dtype=torch.float32) * (r + 1)
        per_rank.append([v.clone(), v[:12].clone() * -2])
    out = run(per_rank, size)
    for t in range(2):
        torch.testing.assert_close(out[0][t], sum(p[t] for p in per_rank), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_identical_gradients_average(size):
    g = rand_grads(1, seed=3)[0]
    out = run([g] * size, size)
    for x, y in zip(out[size - 1], g):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_rank_order_independent():
    per_rank = rand_grads(4, seed=11)
    base = run(per_rank, 4)
    # swapping partners or whole subtrees keeps the tree: same result up to float rounding
    for perm in ([1, 0, 3, 2], [2, 3, 0, 1], [3, 2, 1, 0]):
        out = run([per_rank[p] for p in perm], 4)
        for x, y in zip(out[0], base[0]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    # inputs on which Adasum is associative (orthogonal groups of identical vectors): any permutation
    e = torch.eye(4)
    special = [[e[0] * 2], [e[0] * 2], [e[1]], [e[1]]]
    expect = run(special, 4)[0][0]
    torch.testing.assert_close(expect, e[0] * 2 + e[1])
    for perm in itertools.permutations(range(4)):
        out = run([special[p] for p in perm], 4)
        torch.testing.assert_close(out[0][0], expect, rtol=1e-6, atol=1e-6)


def test_zero_norm_guard_and_tiny_buffers():
    zeros = [[torch.zeros(3), torch.ones(1)], [torch.ones(3), torch.zeros(1)], [torch.zeros(3), torch.zeros(1)]]
    out = run(zeros, 3)
    torch.testing.assert_close(out[0][0], torch.ones(3))
    torch.testing.assert_close(out[2][1], torch.ones(1))
    # fewer elements than ranks: some ranks hold empty slices
    tiny = [[torch.tensor([float(r + 1)])] for r in range(8)]
    out = run(tiny, 8)
    assert all(torch.equal(o[0], out[0][0]) for o in out)
    torch.testing.assert_close(out[0][0].double(), tree([t[0] for t in tiny]), rtol=1e-6, atol=1e-6)


def test_mixed_dtypes_and_single_rank():
    per_rank = [[torch.randn(5), torch.randn(4, dtype=torch.float64)] for _ in range(2)]
    out = run(per_rank, 2)
    assert out[0][1].dtype == torch.float64
    torch.testing.assert_close(out[0][1], pair(per_rank[0][1], per_rank[1][1]))
    from pdv_ext.comm.base import LocalComm
    g = [torch.randn(3)]
    assert torch.equal(build_aggregator("adasum")([g[0].clone()], LocalComm())[0], g[0])


def test_flat_rejects_wrong_sizes():
    from pdv_ext.comm.base import LocalComm

    class Two(LocalComm):
        def __init__(self):
            self.rank, self.size = 0, 2
    with pytest.raises(ValueError):
        adasum_flat(torch.zeros(5), [2, 2], Two())


def test_options_are_validated():
    from pdv_ext.config_base import ConfigError
    with pytest.raises((ConfigError, ValueError)):
        build_aggregator({"type": "adasum", "epsilon": 1.0})
