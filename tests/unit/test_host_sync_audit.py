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
