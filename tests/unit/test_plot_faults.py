"""`pdv plot faults`: samples/s over time of a `pdv bench faults --out` result, one line per attempt (none across
the restart), the loss as a line, the first step after it marked; a result without series is one clear error."""
import json

import pytest

from pdv_ext import plot


def _result(tmp_path):
    def way(kill, gap):
        t = [10.0 + 0.1 * i for i in range(20)] + [10.0 + 2.0 + gap + 0.1 * i for i in range(20)]
        return {"start": 8.0, "t_kill": 12.0 + 0.05 if kill else None, "t": t, "step": list(range(1, 41)),
                "attempt": [0] * 20 + [1] * 20}
    res = {"scenario": "host_loss.yaml", "global_batch": 96, "recovered_vs_disk_restart": 0.8,
           "recovered": {"wall_s": 20.0, "steps_lost": 1}, "disk_restart": {"wall_s": 25.0, "steps_lost": 5},
           "series": {"recovered": way(True, 5.0), "disk_restart": way(True, 9.0)}}
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(res))
    return path


def test_plot_faults_draws_both_ways(tmp_path, capsys):
    path = _result(tmp_path)
    assert plot.main(["faults", str(path)]) == 0
    assert (tmp_path / "faults.png").stat().st_size > 10_000
    assert "recovered, disk_restart" in capsys.readouterr().out


def test_no_line_across_the_restart(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **k: drawn.append((x, y)) or
                        real(self, x, y, *a, **k))
    plot.plot_faults(str(_result(tmp_path)), str(tmp_path / "p.png"))
    xs = drawn[0][0]
    assert any(x != x for x in xs)  # a NaN between the attempts
    assert max(b - a for a, b in zip(xs, xs[1:]) if a == a and b == b) < 1.0  # no segment spans the gap


def test_a_result_without_series_is_one_error(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"completed": True}))
    assert plot.main(["faults", str(path)]) == 2
    assert "no per-step series" in capsys.readouterr().err
