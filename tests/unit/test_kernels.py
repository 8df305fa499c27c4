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
