"""`monitor.gns_preconditioned`: gradients scaled by Adam's 1 / (sqrt(v_hat) + eps) before the noise scale's
norms (Pollux's estimate for Adam), matched to the optimizer's state by the gradient's storage."""
import pytest
import torch

from pdv_ext.integrations.deepspeed.glue import _MonitorHook, adam_scales
from pdv_ext.policy.config import MonitorConfig


def _model_after_one_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    return model, opt


def test_scales_are_adams_preconditioner_for_each_gradient():
    model, opt = _model_after_one_step()
    grads = [p.grad for p in model.parameters()]
    scales = adam_scales(opt, grads)
    for p, s in zip(model.parameters(), scales):
        st = opt.state[p]
        v_hat = st["exp_avg_sq"] / (1 - 0.99 ** float(st["step"]))
        assert torch.allclose(s, 1 / (v_hat.sqrt() + 1e-6))


def test_no_scales_without_a_second_moment_for_every_gradient():
    model, opt = _model_after_one_step()
    grads = [p.grad for p in model.parameters()]
    assert adam_scales(opt, grads + [torch.ones(3)]) is None  # a gradient the optimizer does not hold
    assert adam_scales(torch.optim.SGD(model.parameters(), lr=0.1), grads) is None
    assert adam_scales(None, grads) is None


class _Mon:
    def __init__(self, on):
        self.config = MonitorConfig(gns_preconditioned=on)
        self.norms_now = True
        self.local, self.agg = [], []

    def add_local_grads(self, g):
        self.local.append([t.clone() for t in g])

    def add_aggregated_grads(self, g):
        self.agg.append([t.clone() for t in g])


class _Engine:
    def __init__(self, opt):
        self.optimizer = opt


@pytest.mark.parametrize("on", [True, False])
def test_the_hook_measures_scaled_gradients_and_hands_on_the_originals(on):
    model, opt = _model_after_one_step()
    grads = [p.grad for p in model.parameters()]
    mon = _Mon(on)
    hook = _MonitorHook(mon)
    assert hook.before(_Engine(opt), grads) is grads  # the aggregator gets the gradients untouched
    agg = [g * 0.5 for g in grads]  # the aggregated gradients: other tensors, same order
    hook.after(_Engine(opt), agg)
    scales = adam_scales(opt, grads) if on else [torch.ones(()) for _ in grads]
    assert all(torch.allclose(m, g * s) for m, g, s in zip(mon.local[0], grads, scales))
    assert all(torch.allclose(m, g * s) for m, g, s in zip(mon.agg[0], agg, scales))
    # before the optimizer's first step (no state): no reading, rather than plain norms mixed into Adam's
    fresh = torch.optim.AdamW(model.parameters())
    mon2 = _Mon(on)
    hook2 = _MonitorHook(mon2)
    hook2.before(_Engine(fresh), grads)
    hook2.after(_Engine(fresh), agg)
    assert (len(mon2.local), len(mon2.agg)) == ((0, 0) if on else (1, 1))


def test_an_optimizer_without_adams_moments_gets_the_plain_noise_scale_and_one_warning():
    model, _ = _model_after_one_step()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = [p.grad for p in model.parameters()]
    sgd.step()  # state: momentum buffers, no exp_avg_sq
    mon = _Mon(True)
    hook = _MonitorHook(mon)
    with pytest.warns(UserWarning, match="gns_preconditioned: the optimizer keeps no Adam second moment"):
        hook.before(_Engine(sgd), grads)
    hook.after(_Engine(sgd), grads)
    assert all(torch.equal(a, b) for a, b in zip(mon.local[0], grads)) and len(mon.agg) == 1
