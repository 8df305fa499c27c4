"""The aggregators' CUDA code paths make at most the host syncs their docstrings name, checked on CPU.

The GPU tier (tests/gpu/test_aggregators_gpu.py) counts real synchronising CUDA calls; CI has no GPU, so
here the device paths (`robust.PATHS = "device"`, the torch reference kernels that back Triton) run on CPU
tensors under `tests.sync_audit`, which records what would synchronise on CUDA and what would mix devices.
"""
import pytest
import torch

from pdv_ext.aggregation import build_aggregator, robust
from tests.gpu.test_aggregators_gpu import MAX_SYNCS, SPECS, grads
from tests.sync_audit import HOST, DeviceRegistry
from tests.threadcomm import ThreadComm, run_threads

#: adasum keeps everything on the device: no sync at all (its module docstring)
EXPECTED_MAX = {**MAX_SYNCS, "adasum": 0}
STEPS = 3


def audit(name, m, dtype, steps=STEPS, poison=None):
    reg = DeviceRegistry()
    inputs = [[grads(r, s, dtype, "cpu", byzantine=m - 1) for s in range(steps)] for r in range(m)]
    if poison is not None:
        inputs[poison][0][1][5] = float("nan")
    valid = grads(99, 0, dtype, "cpu")
    reg.mark(inputs)
    reg.mark(valid)

    def fn(comm):
        agg = build_aggregator(dict(SPECS[name]))
        if name == "zeno":
            with reg.mode():  # its flat copy of the device gradients is on the device as well
                agg.set_validation_grads(valid)
        for s in range(steps):
            with reg.mode():
                agg(inputs[comm.rank][s], comm)

    run_threads(m, fn)
    return reg


@pytest.fixture(autouse=True)
def device_paths(monkeypatch):
    """The CUDA code paths on CPU tensors, over a comm whose payloads stay on the host: NCCL as pdv's
    integrations run it (`TorchComm` with its gloo twin, `host_twin`)."""
    monkeypatch.setattr(robust, "PATHS", "device")
    monkeypatch.setenv("PDV_KERNELS", "torch")
    monkeypatch.setattr(ThreadComm, "payload_device", property(lambda self: HOST), raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("m", [3, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_syncs_per_call_within_docstring(name, m, dtype):
    reg = audit(name, m, dtype)
    per_call = len(reg.syncs) / (m * STEPS)
    assert per_call <= EXPECTED_MAX[name], f"{name}: {len(reg.syncs)} syncs in {m * STEPS} calls: " + \
        "; ".join(sorted(set(reg.syncs))[:8])
    assert not reg.mixes, f"{name}: host and device tensors mixed: " + "; ".join(sorted(set(reg.mixes))[:8])
    assert not reg.divides, f"{name}: device-dependent divisions: " + "; ".join(sorted(set(reg.divides))[:8])


@pytest.mark.parametrize("name", ["mean", "median", "zeno", "gossip"])
def test_nonfinite_input_stays_within_budget(name):
    """A NaN on one rank: naming the culprit may cost a second sync, never one per tensor."""
    m = 4
    reg = audit(name, m, torch.float32, steps=1, poison=2)
    assert len(reg.syncs) / m <= 2, f"{name}: " + "; ".join(sorted(set(reg.syncs))[:8])
    assert not reg.mixes, "; ".join(sorted(set(reg.mixes))[:8])


@pytest.mark.parametrize("name,limit", [("adasum", 1), ("gossip", 2)])
@pytest.mark.parametrize("poison", [None, 2])
def test_nonfinite_guard_around_the_call(name, limit, poison):
    """The engine's NaN/Inf guard (`NonFiniteGuard`) around an aggregator that cannot filter: adasum keeps
    one sync per call with the guard (both flags read together), gossip two (its own, and the agreement
    before aggregating). With a NaN on rank 2 every rank raises, naming it, at most one sync later."""
    from pdv_ext.aggregation.faults import NonFiniteGradients, NonFiniteGuard

    m, reg = 4, DeviceRegistry()
    inputs = [grads(r, 0, torch.float32, "cpu") for r in range(m)]
    if poison is not None:
        inputs[poison][1][5] = float("nan")
    reg.mark(inputs)
    errors = []

    def fn(comm):
        agg = build_aggregator(dict(SPECS[name]))
        try:
            with reg.mode():
                NonFiniteGuard().run(agg, inputs[comm.rank], comm, step=3)
        except NonFiniteGradients as e:
            errors.append((e.ranks, e.step))

    run_threads(m, fn)
    assert len(reg.syncs) / m <= limit + (poison is not None), "; ".join(sorted(set(reg.syncs))[:8])
    assert not reg.mixes, "; ".join(sorted(set(reg.mixes))[:8])
    assert errors == ([] if poison is None else [([poison], 3)] * m)


def test_the_audit_sees_a_sync_and_a_mix():
    """The audit itself: a host read of a device tensor and a host/device mix are both recorded."""
    reg = DeviceRegistry()
    dev = torch.ones(4)
    reg.mark([dev])
    with reg.mode():
        s = dev.sum()
        float(s)
        dev + torch.ones(4)  # a host tensor of 4 elements meets a device one
        host = dev.cpu()
        host.tolist()  # a host tensor: free
        fresh = torch.zeros(2, device=dev.device)
        fresh.add_(1).max().item()
    assert len(reg.syncs) == 3 and reg.syncs[0].startswith("__float__"), reg.syncs
    assert "cpu (device to host)" in reg.syncs[1] and reg.syncs[2].startswith("item"), reg.syncs
    assert len(reg.mixes) == 1 and reg.mixes[0].startswith("add"), reg.mixes


def test_the_healthy_check_of_fp16_gradients_is_one_read():
    """Loss-scaled fp16 gradients summing past 65504 must not send every step down the exact path."""
    from pdv_ext.aggregation.base import sums_finite

    assert sums_finite([torch.full((1000,), 300.0, dtype=torch.float16)])
    assert not sums_finite([torch.tensor([1.0, float("nan")], dtype=torch.float16)])


def test_the_audit_sees_host_values_written_into_the_device():
    """What the GPU tier of 2026-11-26 found and this audit missed: `acc[idx] = 0` (kernels/reference.py)
    copies the 0 to the device and waits. A host value at tensor indices, into one element, or a blocking
    host-to-device copy is a sync; a slice fill, index_fill_ and a non_blocking upload are not."""
    reg = DeviceRegistry()
    dev = torch.zeros(8)
    idx = torch.tensor([1, 3])
    reg.mark([dev, idx])
    with reg.mode():
        dev[idx] = 0
        dev[idx] = torch.ones(2)  # host tensor values at tensor indices
        dev[[0, 2]] = 1.0  # a list index becomes tensor indices
        dev[3] = 1.0  # one element: copy_ of a host scalar
        host = torch.ones(8)
        dev.copy_(host)
        host.to(dev.device)
        # free on CUDA:
        dev[1:3] = 0  # fill_
        dev.index_fill_(0, idx, 0)
        dev[idx] = dev[idx] * 2  # device values
        host.to(dev.device, non_blocking=True)
        dev.copy_(host, non_blocking=True)
    assert len(reg.syncs) == 6, reg.syncs
    assert all(s.startswith("__setitem__") for s in reg.syncs[:4]), reg.syncs
    assert reg.syncs[4].startswith("copy_ (host to device") and reg.syncs[5].startswith("to (host to device"), reg.syncs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_kernels_make_no_host_sync(dtype):
    """Every op of the torch reference (what CUDA runs without Triton, PDV_KERNELS=torch, and top-k with
    k = n under Triton) only queues work: no sync in any call, top-k's general and k = n paths included."""
    from pdv_ext.kernels import reference as R

    g = torch.Generator().manual_seed(0)
    reg = DeviceRegistry()
    a = [torch.randn(s, generator=g).to(dtype) for s in (5, 64, 300)]
    b = [torch.randn(s, generator=g).to(dtype) for s in (5, 64, 300)]
    u, r = torch.randn(1000, generator=g).to(dtype), torch.zeros(1000, dtype=dtype)
    stack = torch.randn(5, 200, generator=g).to(dtype)
    coef = torch.full((3,), 0.5, dtype=torch.float64)
    reg.mark([a, b, u, r, stack, coef])
    with reg.mode():
        R.adasum_dots(a, b)
        R.adasum_combine(a, b, coef, coef, out=a)
        for k in (1, 100, 999, 1000):
            R.topk_error_feedback(u, r, k)
        R.coordinate_median(stack), R.coordinate_median(stack[:4])
        for trim in (0, 1, 2):
            R.trimmed_mean(stack, trim)
    assert reg.syncs == [] and reg.mixes == [], (reg.syncs, reg.mixes)
    # the same bits on every device: no division by a number (the float64 trimmed mean was 1 ulp off on CUDA)
    assert reg.divides == [], reg.divides


def test_the_audit_sees_a_division_by_a_number():
    """CUDA divides by a Python number as a product with its rounded reciprocal: 1 float64 quotient in ~6 by
    3 differs from the CPU's in the last bit (GPU tier 2026-11-26: the float64 trimmed mean on torch CUDA).
    Powers of two and divisions by a device tensor are exact alike everywhere."""
    reg = DeviceRegistry()
    dev = torch.ones(4, dtype=torch.float64)
    reg.mark([dev])
    with reg.mode():
        dev / 3
        dev.div(3.0)
        torch.true_divide(dev, 7)
        dev / 2, dev / 0.25, dev / torch.full((), 3.0, dtype=torch.float64, device=dev.device)
        dev * (1 / 3)
    assert len(reg.divides) == 3 and reg.divides[0].startswith("div by 3"), reg.divides
