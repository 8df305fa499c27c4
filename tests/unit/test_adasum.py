"""adasum on in-process ranks (ThreadComm): the algebra, any rank count, identical replicas."""
import itertools

import pytest
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.aggregation.adasum import HOROVOD_EPS, PACK_NUMEL, adasum_flat, adasum_tensors
from tests.threadcomm import run_threads

SHAPES = [(7, 3), (5,), (1,), (64, 33), (2, 2, 2)]


def pair(a, b, eps=HOROVOD_EPS):
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


# ---- Horovod's numerics: the sqrt(DBL_MIN) zero-norm guard, float64 sums, any magnitude, fp16/bf16 ----
def test_guard_is_horovods_constant():
    import math
    import sys

    assert HOROVOD_EPS == math.sqrt(sys.float_info.min) and 1.49e-154 < HOROVOD_EPS < 1.50e-154
    assert build_aggregator("adasum").options.eps == HOROVOD_EPS


MAGNITUDES = [(torch.float32, 1e-30), (torch.float32, 1e-20), (torch.float32, 1e-5), (torch.float32, 1e30),
              (torch.float16, 6e-8), (torch.float16, 1e-4), (torch.float16, 4e4),  # subnormal, small, up to 6e4 (max 65504)
              (torch.bfloat16, 1e-30), (torch.bfloat16, 1e30), (torch.float64, 1e-60)]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype,scale", MAGNITUDES)
def test_identical_gradients_average_at_any_magnitude(size, dtype, scale):
    """Horovod returns the mean of identical gradients at every magnitude a gradient can have; with the
    old 1e-8 guard, tiny ones (squared norm < 1e-8) were summed: size times the mean."""
    g = torch.Generator().manual_seed(7)
    shapes = [(6, 5), (3,), (1,), (70_000,)]  # packed small tensors and a large one
    base = [((torch.rand(*s, generator=g, dtype=torch.float64) + 0.5) * scale).to(dtype) for s in shapes]
    assert all(bool((b != 0).all()) and bool(torch.isfinite(b).all()) for b in base)
    base[1] = -base[1]
    out = run([base] * size, size)
    for r in range(size):
        for x, y in zip(out[r], base):
            assert x.dtype == dtype
            torch.testing.assert_close(x, y, rtol=0, atol=0)  # 0.5 a + 0.5 a: exact in every dtype


def test_eps_option_still_selects_a_larger_guard():
    """Raising eps makes a small but non-zero side count as zero (then it is summed), as documented."""
    tiny = [torch.full((4,), 1e-6)]  # squared norm 4e-12
    def fn(comm):
        return build_aggregator({"type": "adasum", "eps": 1e-8})([tiny[0].clone()], comm)[0]
    out = run_threads(2, fn)
    torch.testing.assert_close(out[0], tiny[0] * 2)
    torch.testing.assert_close(run([tiny, tiny], 2)[0][0], tiny[0])  # the default averages


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [3, 4])
def test_half_precision_matches_float64_reference(dtype, size):
    """Dots and norms in float64, combination in float64 rounded once: fp16/bf16 results are within one
    rounding of the float64 reference tree of the same (rounded) inputs."""
    per_rank = [[t.to(dtype) for t in ts] for ts in rand_grads(size, seed=40 + size)]
    out = run(per_rank, size)
    for r in range(1, size):
        assert all(torch.equal(x, y) for x, y in zip(out[0], out[r]))
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for t in range(len(SHAPES)):
        ref = tree([per_rank[r][t].reshape(-1) for r in range(size)])
        torch.testing.assert_close(out[0][t].reshape(-1).double(), ref, rtol=tol, atol=tol)


# ---- inputs of any layout: strided views, zero-size, mixed layouts across ranks -------------------------
def _strided_inputs(rank, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    mat = torch.randn(40, 9, generator=g)
    keep = mat.clone()
    col = mat[:, 2]  # a matrix column: stride 9
    tr = torch.randn(7, 300, generator=g).t()  # transposed, large (not packed)
    every = torch.randn(70_000 * 2, generator=g)[::2]  # large, stride 2
    empty = torch.empty(0, 5)
    small = torch.randn(5, generator=g)
    # mixed layouts: on odd ranks the 2-D one is a plain contiguous tensor
    mixed = torch.randn(6, 4, generator=g)
    if rank % 2:
        mixed = mixed.t().contiguous().t()
    return [col, tr, every, empty, small, mixed], mat, keep


@pytest.mark.parametrize("size", [2, 3, 4])
def test_strided_views_equal_contiguous_copies(size):
    def fn(comm):
        views, mat, keep = _strided_inputs(comm.rank, 3)
        copies = [v.contiguous().clone() for v in views]
        adasum_tensors(views, comm)
        build_aggregator("adasum")(copies, comm)
        others = torch.cat([mat[:, :2], mat[:, 3:]], 1)
        untouched = torch.equal(others, torch.cat([keep[:, :2], keep[:, 3:]], 1))
        return views, copies, untouched, [v.is_contiguous() for v in views]

    res = run_threads(size, fn)
    for views, copies, untouched, contig in res:
        assert untouched  # only the column was written into its matrix
        assert contig[0] is False and contig[1] is False and contig[2] is False
        for v, c in zip(views, copies):
            assert v.shape == c.shape and torch.equal(v, c)
    for r in range(1, size):
        assert all(torch.equal(x, y) for x, y in zip(res[0][0], res[r][0]))
    inputs = [_strided_inputs(r, 3)[0] for r in range(size)]
    for t in (0, 1, 2, 5):
        ref = tree([inputs[r][t].reshape(-1) for r in range(size)])
        torch.testing.assert_close(res[0][0][t].reshape(-1).double(), ref, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("size", [3, 4])
def test_aggregate_and_flat_take_strided_buffers(size):
    def fn(comm):
        g = torch.Generator().manual_seed(comm.rank)
        mat = torch.randn(50, 4, generator=g)
        flat_view = mat[:, 1]
        copy = flat_view.clone()
        adasum_flat(flat_view, [20, 0, 30], comm)
        adasum_flat(copy, [20, 0, 30], comm)
        direct = [mat[:, 3], torch.empty(0)]
        direct_copy = [t.clone() for t in direct]
        build_aggregator("adasum").aggregate(direct, comm)  # the docs' standalone call, no __call__
        build_aggregator("adasum").aggregate(direct_copy, comm)
        return torch.equal(flat_view, copy) and all(torch.equal(a, b) for a, b in zip(direct, direct_copy))

    assert all(run_threads(size, fn))


def test_bad_inputs_rejected_before_any_communication():
    """Every rank raises the same error at the same call, and nothing was sent (the comm counts calls)."""
    from pdv_ext.aggregation.base import check_tensors

    cases = [
        ([torch.arange(4)], TypeError, "floating"),
        ([torch.ones(3, 1).expand(3, 4)], ValueError, "overlap"),
        ([torch.ones(3).to_sparse()], ValueError, "layout"),
        ([torch.ones(3), "x"], TypeError, "not a torch.Tensor"),
    ]
    for tensors, exc, msg in cases:
        def fn(comm):
            with pytest.raises(exc, match=msg):
                adasum_tensors(tensors, comm)
            with pytest.raises(exc, match=msg):
                build_aggregator("adasum")(tensors, comm)
            return dict(comm.calls)
        assert run_threads(3, fn) == [{}, {}, {}]
    with pytest.raises(ValueError, match="sizes"):
        adasum_flat(torch.zeros(5), [2, 2], run_threads.__globals__["ThreadComm"](run_threads.__globals__["_Hub"](2), 0))
    check_tensors([torch.ones(3, 1).expand(3, 1), torch.empty(0, 3)[:, ::2]])  # no real overlap: accepted


def test_layout_plans_are_cached_per_layout():
    """The segments and their index tensors are built once per layout, not on every call (#20 item 2)."""
    from pdv_ext.aggregation.adasum import _plan

    shapes = [(5,), (300, 300), (7, 3), (1,), (70_001,)]
    per_rank = rand_grads(3, seed=61, shapes=shapes)
    run(per_rank, 3)
    misses = _plan.cache_info().misses
    hits = _plan.cache_info().hits
    run(per_rank, 3)
    assert _plan.cache_info().misses == misses and _plan.cache_info().hits > hits


@pytest.mark.parametrize("size", [2, 4, 8])
def test_kernel_pieces_start_on_16_byte_lines(size, monkeypatch):
    """Tensors whose sizes are multiples of 16 elements (the usual widths): every piece the kernels get
    starts on a 16-byte line (the GPU kernels then move 16 bytes per load), because halving points are
    kept on multiples of 16 elements. Here plain n // 2 halvings would fall mid-line at 8 ranks
    (6592 / 8 = 824 elements, not a multiple of 16)."""
    from pdv_ext import kernels

    seen = []
    dots, combine = kernels.adasum_dots, kernels.adasum_combine

    def spy_dots(a, b):
        seen.extend(t.data_ptr() % 16 for t in list(a) + list(b) if t.numel())
        return dots(a, b)

    def spy_combine(a, b, ca, cb, out=None):
        seen.extend(t.data_ptr() % 16 for t in list(a) + list(b) if t.numel())
        return combine(a, b, ca, cb, out=out)

    monkeypatch.setattr(kernels, "adasum_dots", spy_dots)
    monkeypatch.setattr(kernels, "adasum_combine", spy_combine)
    shapes = [(48, 80), (80,), (16, 48), (48,), (16 * 37,)]  # 6592 elements

    def fn(comm):
        g = torch.Generator().manual_seed(comm.rank)
        return build_aggregator({"type": "adasum"})([torch.randn(s, generator=g) for s in shapes], comm)

    run_threads(size, fn)
    assert seen and not any(seen), sorted(set(seen))
