"""GPU tier for `monitor.gns_preconditioned` (issue #36): Adam's preconditioner for CUDA gradients equals the one
computed on the CPU, and building it and the scaled norms queues work only (no host synchronisation).
Skipped without CUDA (tests/conftest.py)."""
import pytest
import torch

from pdv_ext.integrations.deepspeed.glue import adam_scales
from pdv_ext.policy.metrics import sum_of_squares

pytestmark = pytest.mark.gpu


def _trained(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return model, opt


def test_cuda_scales_match_the_cpu_and_queue_only():
    cpu_model, cpu_opt = _trained("cpu")
    model, opt = _trained("cuda")
    grads = [p.grad for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scales = adam_scales(opt, grads)
        norm = sum_of_squares([g * s for g, s in zip(grads, scales)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = adam_scales(cpu_opt, [p.grad for p in cpu_model.parameters()])
    for s, w in zip(scales, want):
        assert s.is_cuda and torch.allclose(s.cpu(), w, rtol=1e-4, atol=1e-3)
    assert torch.isfinite(norm).item() and norm.item() > 0
