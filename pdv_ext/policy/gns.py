"""Gradient noise scale (McCandlish et al. 2018, as in KungFu and AdaptDL) and the LR scaling rules.

From one step's local gradient (batch B_small) and aggregated gradient (B_big):
    |G|² ≈ (B_big |g_big|² - B_small |g_small|²) / (B_big - B_small)
    S    ≈ (|g_small|² - |g_big|²) / (1/B_small - 1/B_big)
both EMA-smoothed (bias-corrected, like Adam's moments); GNS = S / |G|². The estimates of one step are
very noisy (|G|² can even come out negative): only the smoothed ratio is meaningful.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple


def noise_estimates(local_sq: float, agg_sq: float, b_small: float, b_big: float) -> Tuple[float, float]:
    """Unbiased one-step estimates (|G|², S) from the squared norms of a small- and a big-batch gradient."""
    if b_big <= b_small:
        raise ValueError("the aggregated batch must be larger than the local batch (needs data parallelism)")
    g2 = (b_big * agg_sq - b_small * local_sq) / (b_big - b_small)
    s = (local_sq - agg_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, s


class GNSEstimator:
    """EMA of |G|² and S; `gns` is their ratio (None until |G|² is positive)."""

    def __init__(self, beta: float = 0.95):
        self.beta = beta
        self.g2 = 0.0
        self.s = 0.0
        self.count = 0

    def update(self, local_sq: float, agg_sq: float, b_small: float, b_big: float) -> Optional[float]:
        if not (math.isfinite(local_sq) and math.isfinite(agg_sq)) or b_big <= b_small:
            return self.gns
        g2, s = noise_estimates(local_sq, agg_sq, b_small, b_big)
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.s = self.beta * self.s + (1 - self.beta) * s
        self.count += 1
        return self.gns

    def _corrected(self) -> Tuple[float, float]:
        c = 1.0 - self.beta ** self.count if self.count else 1.0
        return self.g2 / c, self.s / c

    @property
    def grad_sq(self) -> Optional[float]:
        return self._corrected()[0] if self.count else None

    @property
    def noise(self) -> Optional[float]:
        return self._corrected()[1] if self.count else None

    @property
    def gns(self) -> Optional[float]:
        if not self.count:
            return None
        g2, s = self._corrected()
        if g2 <= 0:
            return None
        return max(s, 0.0) / g2

    def state_dict(self) -> Dict[str, float]:
        return {"g2": self.g2, "s": self.s, "count": self.count, "beta": self.beta}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.g2, self.s, self.count = float(state["g2"]), float(state["s"]), int(state["count"])
        self.beta = float(state.get("beta", self.beta))


def adascale_gain(gns: Optional[float], old_batch: float, new_batch: float) -> float:
    """AdaScale gain of going from `old_batch` to `new_batch` given the noise scale (S/|G|²):
    r = (S/B_old + |G|²) / (S/B_new + |G|²) = (gns/B_old + 1) / (gns/B_new + 1); between 1 and
    new/old for growth. Without an estimate the gain is 1 (no LR change)."""
    if gns is None or not math.isfinite(gns):
        return 1.0
    return (gns / old_batch + 1.0) / (gns / new_batch + 1.0)


def lr_factor(rule: str, old_batch: float, new_batch: float, gns: Optional[float] = None) -> float:
    """LR multiplier for a batch change under `rule` (none | linear | sqrt | adascale)."""
    if old_batch <= 0 or new_batch <= 0:
        raise ValueError("batch sizes must be positive")
    ratio = new_batch / old_batch
    if rule == "none":
        return 1.0
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "adascale":
        return adascale_gain(gns, old_batch, new_batch)
    raise ValueError(f"unknown LR scaling rule '{rule}' (none, linear, sqrt, adascale)")


def statistical_efficiency(gns: Optional[float], base_batch: float, batch: float) -> float:
    """AdaptDL's efficiency of `batch` relative to `base_batch`: progress per sample,
    (gns + B0) / (gns + B). 1 at the base batch, falling as the batch outgrows the noise scale."""
    if gns is None or not math.isfinite(gns):
        return base_batch / batch
    return (gns + base_batch) / (gns + batch)


def adam_sqrt_efficiency(gns: Optional[float], base_batch: float, batch: float) -> float:
    """Progress per sample of `batch` relative to `base_batch` for Adam-like optimizers under the sqrt LR rule:
    sqrt((gns + B0) / (gns + B)), the square root of `statistical_efficiency`.

    Why: Adam divides each coordinate's step by sqrt(v), v ~ G^2 + s^2 / B (the mean squared gradient, s^2 the
    per-sample variance). With the LR at lr0 sqrt(B / B0) (the sqrt rule, Malladi et al. 2022), a step's
    expected progress is lr G^2 / sqrt(G^2 + s^2 / B), so progress per sample goes as
    1 / sqrt(B G^2 + s^2) = 1 / (|G| sqrt(B + Bn)), Bn = s^2 / G^2 the noise scale: perfect efficiency while
    the noise dominates (B << Bn, where Adam's normalisation makes the sqrt rule exact) and 1 / sqrt(B) once
    the signal does, where SGD's optimal-LR rule (McCandlish et al. 2018) gives 1 / B. On `pdv bench
    adaptive`'s task (Adam, sqrt rule) fixed 256 needed 1.58x the samples of fixed 16, an efficiency of 0.63,
    where the SGD formula predicts 0.16-0.39 from the measured noise scales (5-150) and this one 0.40-0.64."""
    return math.sqrt(statistical_efficiency(gns, base_batch, batch))


def adaptation_headroom(noise_scales: Sequence[float], weights: Optional[Sequence[float]] = None) -> Dict[str, float]:
    """The most any batch schedule can gain over the best fixed batch, from the noise scales of one run.

    With samples to make progress dp growing as (1 + B / Bn(p)) (McCandlish et al. 2018) and a step of B samples
    taking C + cB, the time of a run at fixed B is 1 + kH + k/B + BH (times c x the fewest samples), with
    H = mean(1 / Bn) over the run and k = C / c, smallest at B = sqrt(k / H): 1 + kH + 2 sqrt(kH). The best
    schedule takes B = sqrt(k Bn) at each point: 1 + kH + 2 sqrt(k) M, M = mean(1 / sqrt(Bn)). So the schedule
    saves 2u (1 - M / sqrt(H)) / (1 + u)^2 of the time, u = sqrt(kH), at most (1 - M / sqrt(H)) / 2 where the
    throughput's knee k is 1 / H. That depends only on how much the noise scale *spreads* over the run (not
    on its level: a noise-scale estimate off by a constant factor gives the same bound): a noise scale growing
    10x log-evenly over a run leaves at most 2.5%, 30x 4.9%, 100x 7.8%, 1000x 13%.

    `noise_scales`: readings over the run (positive), `weights`: the progress each stands for (e.g. the
    samples since the reading before; default equal). Returns `max_headroom` and `knee` (the k = C / c, in
    samples, at which a schedule gains that much)."""
    pts = [(float(b), 1.0 if weights is None else float(w))
           for b, w in zip(noise_scales, weights if weights is not None else noise_scales)
           if b is not None and math.isfinite(float(b)) and float(b) > 0]
    total = sum(w for _, w in pts)
    if not pts or total <= 0:
        raise ValueError("adaptation_headroom needs at least one positive noise scale with a positive weight")
    h = sum(w / b for b, w in pts) / total
    m = sum(w / math.sqrt(b) for b, w in pts) / total
    return {"max_headroom": max(0.0, (1.0 - m / math.sqrt(h)) / 2.0), "knee": 1.0 / h}
