"""The C++ kernels agree with their pure-torch fallbacks (bit for bit, except float64 sums of adasum_dots)."""
import math
import os

import pytest
import torch

from pdv_ext import kernels as K

nan, inf = float("nan"), float("inf")


@pytest.fixture(scope="module")
def cpp():
    if K.backend() != "cpp":
        pytest.skip(f"C++ kernels unavailable: {K._state['reason']}")
    return K


def same(x, y):
    torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def stacks():
    g = torch.Generator().manual_seed(0)
    for m in (1, 2, 3, 4, 5, 8):
        for n in (0, 1, 7, 4097):
            yield torch.randn(m, n, generator=g)
    special = torch.tensor([[nan, 1.0, -inf, 0.0, -0.0, 3.0, nan],
                            [2.0, nan, inf, -0.0, 0.0, 3.0, nan],
                            [inf, 2.0, -inf, 0.0, 0.0, 3.0, 1.0],
                            [-1.0, 0.5, 5.0, 0.0, -0.0, 3.0, nan]])
    for m in (1, 2, 3, 4):
        yield special[:m].contiguous()
    yield torch.zeros(3, 100)
    big = torch.randn(40, 300, generator=g)  # m > 32: the per-column sort path
    big[::7, ::5] = nan
    yield big
    t = torch.randint(-3, 3, (6, 5000), generator=g).float()  # many ties
    yield t
    yield t.double()


def test_median_and_trimmed_mean_match(cpp):
    for s in stacks():
        same(cpp.coordinate_median(s), K.coordinate_median_torch(s))
        for trim in range((s.shape[0] - 1) // 2 + 1):
            same(cpp.trimmed_mean(s, trim), K.trimmed_mean_torch(s, trim))


def test_median_nan_minority_never_wins(cpp):
    s = torch.tensor([[nan, 1.0], [2.0, nan], [3.0, 5.0]])
    assert torch.isfinite(cpp.coordinate_median(s)).all()


def test_trimmed_mean_rejects_too_much_trim(cpp):
    with pytest.raises(ValueError):
        cpp.trimmed_mean(torch.zeros(4, 3), 2)


def topk_cases():
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 9, 1000, 65537):
        for frac in (0.0, 0.01, 0.5, 1.0):
            yield torch.randn(n, generator=g), torch.randn(n, generator=g), int(frac * n)
    ties = torch.randint(-2, 3, (5000,), generator=g).float()
    yield ties, torch.zeros(5000), 777
    yield ties.double(), torch.zeros(5000, dtype=torch.float64), 1234
    sp = torch.tensor([nan, 1.0, -inf, 0.0, -0.0, 3.0, nan, inf, -3.0, 2.0])
    for k in range(0, 11):
        yield sp, torch.zeros(10), k
    yield torch.zeros(100), torch.zeros(100), 10
    yield torch.empty(0), torch.empty(0), 3


def test_topk_error_feedback_matches(cpp):
    for u, r, k in topk_cases():
        r1, r2 = r.clone(), r.clone()
        i1, v1 = cpp.topk_error_feedback(u, r1, k)
        i2, v2 = K.topk_error_feedback_torch(u, r2, k)
        same(i1, i2)
        same(v1, v2)
        same(r1, r2)
        assert i1.numel() == min(k, u.numel())
        if i1.numel() > 1:
            assert bool((i1[1:] > i1[:-1]).all())


def test_topk_is_the_top_k(cpp):
    u = torch.tensor([0.1, -5.0, 2.0, 0.3, -0.2, 4.0])
    r = torch.zeros(6)
    idx, vals = cpp.topk_error_feedback(u, r, 2)
    assert idx.tolist() == [1, 5] and vals.tolist() == [-5.0, 4.0]
    assert r.tolist() == pytest.approx([0.1, 0, 2.0, 0.3, -0.2, 0])
    idx, _ = cpp.topk_error_feedback(torch.zeros(6), r, 1)  # residual carries over: 2.0 is next
    assert idx.tolist() == [2]


def tensor_lists():
    g = torch.Generator().manual_seed(2)
    sizes = [0, 1, 7, 33, 40000, 100003]
    yield [torch.randn(s, generator=g) for s in sizes], [torch.randn(s, generator=g) for s in sizes]
    yield [torch.randn(3, 5, generator=g).double()], [torch.randn(3, 5, generator=g).double()]
    yield [torch.zeros(10), torch.tensor([nan, 1.0, inf])], [torch.ones(10), torch.tensor([1.0, 2.0, 3.0])]


@pytest.mark.parametrize("case", range(3))
def test_adasum_dots_and_combine_match(cpp, case):
    a, b = list(tensor_lists())[case]
    d1 = cpp.adasum_dots(a, b)
    d2 = K.adasum_dots_torch(a, b)
    for x, y in zip(d1, d2):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, equal_nan=True)
    ca = torch.linspace(-1.5, 2.0, len(a), dtype=torch.float64)
    cb = torch.linspace(0.3, 0.9, len(a), dtype=torch.float64)
    for x, y in zip(cpp.adasum_combine(a, b, ca, cb), K.adasum_combine_torch(a, b, ca, cb)):
        same(x, y)
    outs = [x.clone() for x in a]  # in place, aliasing a
    cpp.adasum_combine(outs, b, ca, cb, out=outs)
    for x, y in zip(outs, K.adasum_combine_torch(a, b, ca, cb)):
        same(x, y)


def test_adasum_dots_values(cpp):
    a, b = [torch.tensor([1.0, 2.0]), torch.zeros(3)], [torch.tensor([3.0, -1.0]), torch.ones(3)]
    dot, na, nb = cpp.adasum_dots(a, b)
    assert dot.tolist() == [1.0, 0.0] and na.tolist() == [5.0, 0.0] and nb.tolist() == [10.0, 3.0]


def test_dots_independent_of_thread_count(cpp):
    a = [torch.randn(300_000)]
    b = [torch.randn(300_000)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpp.adasum_dots(a, b)
        torch.set_num_threads(2)
        two = cpp.adasum_dots(a, b)
    finally:
        torch.set_num_threads(old)
    for x, y in zip(one, two):
        same(x, y)


def test_fallback_selected_by_env(monkeypatch):
    monkeypatch.setattr(K.cpu, "_state", {"tried": False, "module": None, "reason": ""})
    monkeypatch.setenv("PDV_KERNELS", "torch")
    assert K.backend() == "torch"
    s = torch.randn(3, 10)
    same(K.coordinate_median(s), K.coordinate_median_torch(s))
    assert math.isfinite(float(K.trimmed_mean(s, 1).sum()))


def test_dots_same_bits_portable_and_native_build(cpp, monkeypatch, tmp_path):
    """The AVX loop of adasum_dots is the portable loop written out: a build without -march=native must
    give the same bits (only the float64 sums' tree is fixed, so any lane mix-up would show)."""
    g = torch.Generator().manual_seed(5)
    a = [torch.randn(n, generator=g) * 3 for n in (0, 5, 8, 9, 40000, 100003)]
    b = [torch.randn(n, generator=g) for n in (0, 5, 8, 9, 40000, 100003)]
    a64, b64 = [x.double() for x in a], [y.double() for y in b]
    native = cpp.adasum_dots(a, b), cpp.adasum_dots(a64, b64)
    monkeypatch.setattr(K.cpu, "_state", {"tried": False, "module": None, "reason": ""})
    monkeypatch.setenv("PDV_KERNELS_NATIVE", "0")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    if K.backend() != "cpp":
        pytest.skip(f"portable build failed: {K.cpu._state['reason']}")
    portable = K.adasum_dots(a, b), K.adasum_dots(a64, b64)
    for n3, p3 in zip(native, portable):
        for x, y in zip(n3, p3):
            same(x, y)


def test_clear_stale_batons_removes_only_old_locks(tmp_path):
    """A killed JIT build leaves torch's lock behind and every later load waits for it forever; a lock as
    young as a running build's is kept."""
    for name in ("old_op", "young_op"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lock").write_text("")
    old = tmp_path / "old_op" / "lock"
    os.utime(old, (old.stat().st_atime - 3600, old.stat().st_mtime - 3600))
    removed = K.clear_stale_batons(str(tmp_path), ["old_op", "young_op", "missing_op"], older_than=600)
    assert removed == [str(old)]
    assert not old.exists() and (tmp_path / "young_op" / "lock").exists()


# ---- the API on any layout, empty lists, clear errors (issue #21); device-friendly reference -------------
def strided(t):
    """The same values as a non-contiguous view."""
    return torch.stack([t, torch.full_like(t, 7.0)], dim=-1)[..., 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_any_layout_equals_contiguous_copies(dtype):
    """Strided, transposed, zero-size and mixed-layout inputs (C++ for float32/64, the reference for the
    16-bit types) give the results of contiguous copies; a strided out is written into."""
    g = torch.Generator().manual_seed(7)
    a = [strided(torch.randn(33, generator=g)).to(dtype), torch.randn(4, 5, generator=g).to(dtype).t(),
         torch.empty(0, dtype=dtype), torch.randn(8, generator=g).to(dtype)]
    b = [torch.randn(33, generator=g).to(dtype), strided(torch.randn(20, generator=g).to(dtype)),
         torch.empty(0, 2, dtype=dtype), torch.randn(2, 4, generator=g).to(dtype)]
    ac, bc = [x.contiguous() for x in a], [y.contiguous() for y in b]
    for x, y in zip(K.adasum_dots(a, b), K.adasum_dots(ac, bc)):
        same(x, y)
    ca, cb = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64), torch.full((4,), 0.75, dtype=torch.float64)
    want = K.adasum_combine(ac, bc, ca, cb)
    for x, y in zip(K.adasum_combine(a, b, ca, cb), want):
        same(x, y)
    outs = [strided(torch.zeros(x.shape, dtype=dtype)) for x in a]
    assert K.adasum_combine(a, b, ca, cb, out=outs) == outs
    for x, y in zip(outs, want):
        same(x, y)
    mine = [x.clone() for x in a]  # aliasing out and a, strided ones included
    mine[0] = strided(a[0].clone())
    K.adasum_combine(mine, b, ca, cb, out=mine)
    for x, y in zip(mine, want):
        same(x, y)

    u = torch.randn(6, 9, generator=g).to(dtype).t()
    r, rc = strided(torch.randn(9, 6, generator=g).to(dtype)), None
    rc = r.contiguous()
    i1, v1 = K.topk_error_feedback(u, r, 11)
    i2, v2 = K.topk_error_feedback(u.contiguous(), rc, 11)
    same(i1, i2), same(v1, v2), same(r, rc)

    s = torch.randn(7, 5, 3, generator=g).to(dtype)
    for view in (s.transpose(1, 2), s[:, 1:4, ::2], s[:, :0]):
        same(K.coordinate_median(view), K.coordinate_median(view.contiguous()))
        same(K.trimmed_mean(view, 2), K.trimmed_mean(view.contiguous(), 2))
    assert K.coordinate_median(s.transpose(1, 2)).shape == (3, 5)


def test_empty_lists_and_zero_size():
    d = K.adasum_dots([], [])
    assert len(d) == 3 and all(x.numel() == 0 and x.dtype == torch.float64 for x in d)
    assert K.adasum_combine([], [], torch.empty(0), torch.empty(0)) == []
    assert K.adasum_combine([], [], torch.empty(0), torch.empty(0), out=[]) == []
    z = [torch.empty(0), torch.empty(0, 4)]
    assert [x.tolist() for x in K.adasum_dots(z, z)] == [[0.0, 0.0]] * 3
    idx, vals = K.topk_error_feedback(torch.empty(0), torch.empty(0), 5)
    assert idx.dtype == torch.int64 and idx.numel() == 0 and vals.numel() == 0
    assert K.coordinate_median(torch.empty(3, 0)).shape == (0,)


@pytest.mark.parametrize("call, words", [
    (lambda: K.adasum_dots([torch.ones(2)], []), "b: 0 tensors, a has 1"),
    (lambda: K.adasum_dots([torch.ones(2), torch.ones(3)], [torch.ones(2), torch.ones(4)]), "b[1]: 4 elements"),
    (lambda: K.adasum_dots([torch.ones(2)], [torch.ones(2, dtype=torch.float64)]), "b[0]: dtype"),
    (lambda: K.adasum_dots([torch.ones(2)], [2.0]), "b[0]: expected a tensor"),
    (lambda: K.adasum_combine([torch.ones(2)], [torch.ones(2)], torch.ones(2), torch.ones(1)), "ca: 2 coefficients"),
    (lambda: K.adasum_combine([torch.ones(2)], [torch.ones(2)], torch.ones(1), torch.ones(1), out=[torch.ones(3)]),
     "out[0]: 3 elements"),
    (lambda: K.topk_error_feedback(torch.ones(4), torch.ones(3), 1), "residual[0]: 3 elements"),
    (lambda: K.topk_error_feedback(torch.ones(4), torch.ones(4).half(), 1), "residual[0]: dtype"),
    (lambda: K.coordinate_median(torch.tensor(1.0)), "stack:"),
    (lambda: K.coordinate_median(torch.ones(0, 3)), "stack:"),
    (lambda: K.trimmed_mean(torch.ones(4, 3), 2), "trim=2"),
])
def test_mismatches_name_the_argument(call, words):
    with pytest.raises(ValueError, match=None) as err:
        call()
    assert words in str(err.value)


def test_reference_keeps_results_as_tensors_without_host_reads(monkeypatch):
    """The reference is what a non-CUDA accelerator runs: no .item()/.tolist() (a host sync per tensor
    there), coefficients read as tensors, dots returned as float64 tensors on the inputs' device."""
    def boom(*_a, **_k):
        raise AssertionError("host read")

    monkeypatch.setattr(torch.Tensor, "tolist", boom)
    monkeypatch.setattr(torch.Tensor, "item", boom)
    monkeypatch.setattr(torch.Tensor, "__float__", boom)
    monkeypatch.setattr(torch.Tensor, "__int__", boom)
    monkeypatch.setattr(torch.Tensor, "__bool__", boom)
    monkeypatch.setenv("PDV_KERNELS", "torch")
    a = [torch.randn(5), torch.randn(0), torch.randn(3, 2)]
    b = [torch.randn(5), torch.randn(0), torch.randn(6)]
    dot, na, nb = K.adasum_dots(a, b)
    assert dot.dtype == torch.float64 and dot.shape == (3,)
    K.adasum_combine(a, b, dot, na, out=a)
    u = torch.tensor([1.0, -2.0, 2.0, 0.5, 2.0, -2.0])
    r = torch.zeros(6)
    idx, vals = K.topk_error_feedback(u, r, 3)
    s = torch.randn(5, 7)
    K.coordinate_median(s), K.trimmed_mean(s, 1)
    monkeypatch.undo()
    assert idx.tolist() == [1, 2, 4] and vals.tolist() == [-2.0, 2.0, 2.0]  # ties at 2: lower indices
    assert r.tolist() == [1.0, 0.0, 0.0, 0.5, 0.0, -2.0]


def test_reference_16bit_dots_are_exact_float64_products():
    """bf16/fp16 products are exact in float64: the dots equal those of float64 copies to summation order."""
    g = torch.Generator().manual_seed(3)
    for dt in (torch.bfloat16, torch.float16):
        a, b = [torch.randn(1000, generator=g).to(dt)], [torch.randn(1000, generator=g).to(dt)]
        for x, y in zip(K.adasum_dots(a, b), K.adasum_dots([a[0].double()], [b[0].double()])):
            torch.testing.assert_close(x, y, rtol=1e-13, atol=0)


def test_dispatch_by_device_and_env(monkeypatch):
    assert K.backend("cpu") in ("cpp", "torch")
    monkeypatch.setenv("PDV_KERNELS", "torch")
    assert K.backend("cpu") == K.backend("cuda") == "torch"
    assert K._impl([torch.ones(2)]) is K.reference
    monkeypatch.delenv("PDV_KERNELS")
    assert K._impl([torch.ones(2).half()]) is K.reference  # no C++ for 16-bit CPU tensors
    assert K._impl([torch.ones(2), torch.ones(2).double()]) is K.reference  # mixed dtypes in one list
