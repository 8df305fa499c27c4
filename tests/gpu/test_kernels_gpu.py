"""GPU tier: the kernel API on CUDA tensors (Triton, and the torch reference with PDV_KERNELS=torch) against the
torch reference on CPU copies - float32, bfloat16, float16 (and float64), odd sizes, empty tensors, NaN/Inf,
strided views - and no host synchronisation in any call (`torch.cuda.set_sync_debug_mode("error")`).

Expected equality (docs/kernels.md): bit for bit, except adasum_dots' float64 sums (summation order) and
the sign of a zero median / mean. Skipped without CUDA (tests/conftest.py).
"""
import pytest
import torch

from pdv_ext import kernels as K
from pdv_ext.kernels import reference as R

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
nan, inf = float("nan"), float("inf")


@pytest.fixture(params=["triton", "torch"])
def impl(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("PDV_KERNELS", "torch")
    elif K.backend("cuda") != "triton":
        pytest.skip(f"triton unavailable: {K._triton_state['reason']}")
    return request.param


def same(x, y):
    torch.testing.assert_close(x.cpu(), y.cpu(), rtol=0, atol=0, equal_nan=True)


def strided(t):
    return torch.stack([t, torch.full_like(t, 7.0)], dim=-1)[..., 0]


def lists(dt, dev, g):
    sizes = [0, 1, 7, 4095, 4096, 4097, 100_003, 1 << 20]
    a = [torch.randn(s, generator=g).to(dt) * 3 for s in sizes]
    b = [torch.randn(s, generator=g).to(dt) for s in sizes]
    a.append(torch.tensor([nan, 1.0, inf, 2.0], dtype=dt))
    b.append(torch.tensor([1.0, inf, 1.0, -2.0], dtype=dt))
    a, b = [x.to(dev) for x in a], [y.to(dev) for y in b]
    a[3], b[5] = strided(a[3]), strided(b[5])
    return a, b


def cpu(ts):
    return [t.cpu() for t in ts]


@pytest.mark.parametrize("dt", DTYPES)
def test_adasum_on_cuda_matches_reference(impl, dt):
    g = torch.Generator().manual_seed(0)
    a, b = lists(dt, "cuda", g)
    dots = K.adasum_dots(a, b)
    assert all(d.device.type == "cuda" and d.dtype == torch.float64 for d in dots)
    for x, y in zip(dots, R.adasum_dots(cpu(a), cpu(b))):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-12, atol=1e-12, equal_nan=True)
    ca = torch.linspace(-1.5, 2.0, len(a), dtype=torch.float64)
    cb = torch.linspace(0.3, 0.9, len(a), dtype=torch.float64)
    want = R.adasum_combine(cpu(a), cpu(b), ca, cb)
    for coeff_dev in ("cpu", "cuda"):  # ca/cb on any device
        for x, y in zip(K.adasum_combine(a, b, ca.to(coeff_dev), cb.to(coeff_dev)), want):
            same(x, y)
    outs = [strided(torch.zeros(x.shape, dtype=dt, device="cuda")) for x in a]
    K.adasum_combine(a, b, ca, cb, out=outs)
    mine = [x.clone() for x in a]
    K.adasum_combine(mine, b, ca, cb, out=mine)
    for x, y, z in zip(outs, mine, want):
        same(x, z), same(y, z)


@pytest.mark.parametrize("dt", DTYPES)
def test_adasum_on_aligned_and_unaligned_pieces(impl, dt):
    """The Triton list kernels take 16-byte vector accesses when every piece starts on a 16-byte line and
    element-wide ones otherwise (adasum's pieces of one buffer): both give the reference's bits."""
    g = torch.Generator().manual_seed(3)
    sizes = [16, 4096, 4096 * 3 + 16, 100_000]
    for shift in (0, 1):  # 0: every piece aligned; 1: all one element past the line
        flat_a = torch.randn(shift + sum(sizes), generator=g).to(dt).cuda()
        flat_b = torch.randn(shift + sum(sizes), generator=g).to(dt).cuda()
        a = list(torch.split(flat_a[shift:], sizes))
        b = list(torch.split(flat_b[shift:], sizes))
        assert all((t.data_ptr() % 16 == 0) == (shift == 0) for t in a + b)
        for x, y in zip(K.adasum_dots(a, b), R.adasum_dots(cpu(a), cpu(b))):
            torch.testing.assert_close(x.cpu(), y, rtol=1e-12, atol=1e-12)
        ca = torch.linspace(-1.5, 2.0, len(a), dtype=torch.float64)
        cb = torch.linspace(0.3, 0.9, len(a), dtype=torch.float64)
        want = R.adasum_combine(cpu(a), cpu(b), ca, cb)
        K.adasum_combine(a, b, ca, cb, out=a)
        for x, y in zip(a, want):
            same(x, y)


@pytest.mark.parametrize("select", ["torch", "radix"])  # the threshold finder (PDV_TOPK_SELECT)
@pytest.mark.parametrize("dt", DTYPES)
def test_topk_on_cuda_matches_reference(impl, dt, select, monkeypatch):
    if impl == "torch" and select == "radix":
        pytest.skip("the reference has no threshold finder to choose")
    monkeypatch.setenv("PDV_TOPK_SELECT", select)
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randint(-3, 4, (50_000,), generator=g).to(dt), torch.zeros(50_000, dtype=dt), k)
             for k in (1, 777, 25_000, 49_999)]  # ties across blocks
    cases += [(torch.randn(1 << 20, generator=g).to(dt), torch.randn(1 << 20, generator=g).to(dt) * 0.1, 10_000)]
    sp = torch.tensor([nan, 1.0, -inf, 0.0, -0.0, 3.0, nan, inf, -3.0, 2.0], dtype=dt)
    cases += [(sp, torch.zeros(10, dtype=dt), k) for k in range(11)]
    cases += [(torch.empty(0, dtype=dt), torch.empty(0, dtype=dt), 3)]
    for u, r, k in cases:
        r1, r2 = r.cuda(), r.clone()
        i1, v1 = K.topk_error_feedback(u.cuda(), r1, k)
        i2, v2 = R.topk_error_feedback(u, r2, k)
        assert i1.device.type == "cuda" and i1.dtype == torch.int64
        same(i1, i2), same(v1, v2), same(r1, r2)
    u, r = torch.randn(2, 5000, generator=g).to(dt), torch.randn(5000, 2, generator=g).to(dt)
    r1, r2 = r.cuda().t(), r.t().contiguous()  # strided update and residual
    i1, v1 = K.topk_error_feedback(u.cuda().t(), r1, 400)
    i2, v2 = R.topk_error_feedback(u.t().contiguous(), r2, 400)
    same(i1, i2), same(v1, v2), same(r1, r2)


def stacks(dt, g):
    for m in (1, 2, 3, 4, 5, 8, 16, 40):  # 40 > MAX_ROWS: the reference on the device
        s = torch.randn(m, 100_003, generator=g).to(dt)
        s[0, ::7], s[-1, ::5], s[m // 2, ::3] = nan, inf, -inf
        yield s
    yield torch.randint(-2, 3, (6, 9000), generator=g).to(dt)
    yield torch.randn(4, 0).to(dt)
    yield torch.randn(5, 4000, generator=g).to(dt).t().contiguous().t()
    yield torch.randn(3, 3000, 4, generator=g).to(dt)[:, 10:2500:2, 1:3]


@pytest.mark.parametrize("dt", DTYPES)
def test_median_and_trimmed_mean_on_cuda_match_reference(impl, dt):
    g = torch.Generator().manual_seed(2)
    for s in stacks(dt, g):
        got = K.coordinate_median(s.cuda())
        assert got.device.type == "cuda" and got.shape == s.shape[1:]
        same(got, R.coordinate_median(s))
        top = (s.shape[0] - 1) // 2
        for trim in range(top + 1) if s.shape[0] <= 16 else (0, 1, top):
            same(K.trimmed_mean(s.cuda(), trim), R.trimmed_mean(s, trim))


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_no_host_sync(impl, dt):
    """A call only queues work: no .item(), no blocking copy, no nonzero() (each would stall the host)."""
    g = torch.Generator().manual_seed(3)
    a, b = lists(dt, "cuda", g)
    ca_cpu = torch.full((len(a),), 0.5, dtype=torch.float64)
    ca_dev = ca_cpu.cuda()
    u, r = torch.randn(1 << 20, device="cuda").to(dt), torch.zeros(1 << 20, device="cuda", dtype=dt)
    s = torch.randn(5, 1 << 18, device="cuda").to(dt)

    def calls():
        K.adasum_dots(a, b)
        K.adasum_combine(a, b, ca_cpu, ca_cpu, out=a)
        K.adasum_combine(a, b, ca_dev, ca_dev, out=a)
        K.topk_error_feedback(u, r, 1000)
        if impl == "triton":  # torch.topk's threshold (PDV_TOPK_SELECT=torch) as well
            K._triton().topk_error_feedback(u.view(-1), r.view(-1), 1000, select="torch")
        K.coordinate_median(s)
        K.trimmed_mean(s, 1)

    calls()  # compile (Triton) and cache the block tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
