"""Gradient noise scale estimation and LR scaling rules."""
import math

import pytest
import torch

from pdv_ext.policy.gns import GNSEstimator, adascale_gain, lr_factor, noise_estimates, statistical_efficiency


def test_exact_expectations_recover_g_and_s():
    # E|g_B|² = |G|² + S/B: feed exact expectations, get |G|² and S back
    g2, s = 4.0, 200.0
    for bs, bb in [(8, 32), (4, 16), (16, 64)]:
        est = noise_estimates(g2 + s / bs, g2 + s / bb, bs, bb)
        assert est == pytest.approx((g2, s))


def test_estimator_converges_on_simulated_gradients():
    torch.manual_seed(0)
    d, sigma, b_small, replicas = 50, 2.0, 8, 4
    G = torch.randn(d) * 0.3
    est = GNSEstimator(beta=0.99)
    for _ in range(3000):
        per_sample = G + sigma * torch.randn(replicas, b_small, d)
        local = per_sample.mean(1)  # each replica's gradient
        agg = local.mean(0)
        local_sq = float((local ** 2).sum(1).mean())  # averaged over replicas, as the Monitor does
        est.update(local_sq, float((agg ** 2).sum()), b_small, b_small * replicas)
    true_s, true_g2 = d * sigma ** 2, float((G ** 2).sum())
    assert est.noise == pytest.approx(true_s, rel=0.1)
    assert est.grad_sq == pytest.approx(true_g2, rel=0.25)
    assert est.gns == pytest.approx(true_s / true_g2, rel=0.3)


def test_estimator_state_roundtrip_and_no_estimate_without_dp():
    est = GNSEstimator(0.9)
    assert est.gns is None
    est.update(1.0, 1.0, 8, 8)  # B_big == B_small: no information
    assert est.count == 0
    est.update(2.0, 1.0, 8, 16)
    other = GNSEstimator()
    other.load_state_dict(est.state_dict())
    assert (other.g2, other.s, other.count, other.beta) == (est.g2, est.s, est.count, est.beta)
    with pytest.raises(ValueError):
        noise_estimates(1.0, 1.0, 8, 8)


def test_negative_grad_sq_gives_no_gns():
    est = GNSEstimator(0.0)
    est.update(1.0, 1.0, 8, 16)  # equal norms: |G|² = 1, S = 0
    assert est.gns == 0.0
    est.update(1.0, 0.0, 8, 16)  # |G|² < 0: noise dominates, ratio undefined
    assert est.gns is None


def test_lr_rules():
    assert lr_factor("none", 16, 64) == 1.0
    assert lr_factor("linear", 16, 64) == 4.0
    assert lr_factor("sqrt", 16, 64) == 2.0
    assert lr_factor("adascale", 16, 64, gns=None) == 1.0
    # adascale: ~linear when the noise dominates, ~1 when the batch is far above the noise scale
    assert lr_factor("adascale", 16, 64, gns=1e9) == pytest.approx(4.0, rel=1e-3)
    assert lr_factor("adascale", 16, 64, gns=1e-3) == pytest.approx(1.0, rel=1e-3)
    g = adascale_gain(100.0, 16, 64)
    assert 1.0 < g < 4.0 and g == pytest.approx((100 / 16 + 1) / (100 / 64 + 1))
    with pytest.raises(ValueError):
        lr_factor("cubic", 16, 32)


def test_statistical_efficiency():
    assert statistical_efficiency(100.0, 16, 16) == 1.0
    assert statistical_efficiency(100.0, 16, 64) == pytest.approx(116 / 164)
    assert statistical_efficiency(1e9, 16, 64) == pytest.approx(1.0, rel=1e-6)
    assert statistical_efficiency(None, 16, 64) == 0.25
