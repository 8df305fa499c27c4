"""`adaptation_headroom`: the closed form against a brute-force search over fixed batches and the best batch at
every point of the same model (samples to progress (1 + B / Bn), a step C + cB)."""
import math

import pytest

from pdv_ext.policy.gns import adaptation_headroom


def brute(noise, knee):
    """1 - (best schedule's time) / (best fixed batch's time), by search over B on a log grid."""
    def time(b, bn):
        return (1 + b / bn) * (knee / b + 1)

    grid = [math.exp(math.log(1e-3) + i * (math.log(1e6) - math.log(1e-3)) / 20000) for i in range(20001)]
    fixed = min(sum(time(b, bn) for bn in noise) for b in grid)
    best = sum(min(time(b, bn) for b in (math.sqrt(knee * bn),)) for bn in noise)
    return 1 - best / fixed


@pytest.mark.parametrize("growth", [10, 30, 1000])
def test_the_bound_is_the_best_schedule_at_the_knee(growth):
    noise = [5 * growth ** ((i + 0.5) / 200) for i in range(200)]
    out = adaptation_headroom(noise)
    assert brute(noise, out["knee"]) == pytest.approx(out["max_headroom"], abs=2e-4)
    for k in (out["knee"] / 10, out["knee"] * 10):  # elsewhere on the throughput curve a schedule gains less
        assert brute(noise, k) < out["max_headroom"]


def test_the_bound_depends_on_the_spread_not_the_level():
    a = adaptation_headroom([5, 20, 80, 150], [1, 2, 3, 4])
    b = adaptation_headroom([50, 200, 800, 1500], [1, 2, 3, 4])
    assert a["max_headroom"] == pytest.approx(b["max_headroom"]) and b["knee"] == pytest.approx(10 * a["knee"])
    assert adaptation_headroom([40.0] * 5)["max_headroom"] == pytest.approx(0.0, abs=1e-12)
    growth = {r: adaptation_headroom([r ** ((i + 0.5) / 1000) for i in range(1000)])["max_headroom"]
              for r in (10, 30, 100, 1000)}
    assert [round(v, 3) for v in growth.values()] == [0.025, 0.049, 0.078, 0.131]


def test_readings_without_a_value_are_skipped_and_none_left_is_an_error():
    assert adaptation_headroom([None, 10.0, float("nan"), 40.0], [5, 1, 1, 1])["knee"] == pytest.approx(16.0)
    with pytest.raises(ValueError, match="at least one positive noise scale"):
        adaptation_headroom([None, -1.0])
