"""The probe's link fit: bandwidth from transfer-dominated sizes, robust to stalls on small messages."""
import numpy as np
import pytest

from pdv_ext.placement.probe import DEFAULT_SIZES, fit_latency_bandwidth


def test_exact_line_is_recovered():
    sizes = np.array(DEFAULT_SIZES, dtype=float)
    lat, bw = fit_latency_bandwidth(sizes, 2e-4 + sizes / 12.5e6)
    assert bw == pytest.approx(12.5e6, rel=1e-6) and lat == pytest.approx(2e-4, rel=1e-6)


def test_stalled_small_messages_do_not_inflate_bandwidth():
    sizes = np.array(DEFAULT_SIZES, dtype=float)
    times = 1e-4 + sizes / 12.5e6
    times[: len(sizes) // 2] += 5e-3  # a throttled host: every small message waits a scheduler slice
    _, bw = fit_latency_bandwidth(sizes, times)
    assert bw == pytest.approx(12.5e6, rel=0.05)
