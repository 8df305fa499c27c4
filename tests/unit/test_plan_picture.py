"""`pdv plan --plot` (issue #27 item 5): the picture is the replay of the plan's own schedule, so the title's
predicted step is where the drawing ends, for 1F1B and for GPipe, which are drawn differently; link
transfers are drawn; the table's layer ranges use plan.json's half-open convention."""
import json
import re

import pytest

from pdv_ext.placement.cli import plan_main
from pdv_ext.placement.cluster import Cluster
from pdv_ext.placement.gantt import MAX_DEVICE_ROWS, draw, replay_plan
from pdv_ext.placement.plan import Plan
from pdv_ext.placement.profile import Profile
from pdv_ext.placement.solvers import solve

pytest.importorskip("deepspeed")  # the 1F1B order is DeepSpeed's TrainSchedule
pytest.importorskip("matplotlib")


def cluster(devices_per_host=2):
    """Two hosts, the second half as fast, joined by a slow link (transfers matter)."""
    return Cluster.from_dict({
        "hosts": [{"name": "a", "devices": devices_per_host, "throughput": 1.0},
                  {"name": "b", "devices": devices_per_host, "throughput": 0.5}],
        "links": {"intra_host": {"bandwidth": "1 Gbit/s", "latency": "100us"},
                  "inter_host": {"bandwidth": "100 Mbit/s", "latency": "2ms"}}})


def picture(plan, prof, cl):
    rep = replay_plan(plan, prof, cl)
    fig, end = draw(plan, rep)
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_gid()]
    title = float(re.search(r"predicted step ([0-9.]+) ms", ax.get_title()).group(1))
    return rep, end, bars, title, ax


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_drawn_step_is_the_titles_prediction(schedule):
    prof, cl = Profile.synthetic(8, seed=1), cluster()
    plan = solve("dp", prof, cl, 2, 8, schedule=schedule)
    rep, end, bars, title, _ = picture(plan, prof, cl)
    right = max(p.get_x() + p.get_width() for p in bars)
    assert right == pytest.approx(end) and right == pytest.approx(rep.step_time * 1e3)
    assert title == round(rep.step_time * 1e3, 2)  # the title's number is where the last bar ends
    assert rep.schedule == schedule


def order_on_a_row(bars, y):
    return [p.get_gid() for p in sorted((p for p in bars if abs(p.get_y() + p.get_height() / 2 - y) < 1e-6
                                         and p.get_gid()[0] in "FB"), key=lambda p: p.get_x())]


def test_1f1b_and_gpipe_are_drawn_differently():
    prof, cl = Profile.synthetic(8, seed=1), cluster()
    base = solve("dp", prof, cl, 2, 8)
    orders = {}
    for schedule in ("1f1b", "gpipe"):
        plan = Plan.scored(prof, cl, base.boundaries, base.rank_mapping, 8, schedule=schedule)
        _, _, bars, _, ax = picture(plan, prof, cl)
        first_row = len(ax.get_yticks()) - 1  # stage 0's first device is the top row
        orders[schedule] = order_on_a_row(bars, first_row)
    for order in orders.values():
        assert sorted(order) == sorted([f"F{m}" for m in range(8)] + [f"B{m}" for m in range(8)])
    assert orders["gpipe"] == [f"F{m}" for m in range(8)] + [f"B{m}" for m in range(8)]  # all forwards first
    assert orders["1f1b"][:3] == ["F0", "F1", "B0"]  # stage 0 of 2: one warm-up forward, then alternating


def test_link_transfers_are_drawn_one_per_message():
    prof, cl = Profile.synthetic(8, seed=1), cluster()
    plan = solve("dp", prof, cl, 2, 8)
    rep, _, bars, _, _ = picture(plan, prof, cl)
    width = len(plan.rank_mapping[0])
    acts = [p for p in bars if p.get_gid().startswith("act")]
    grads = [p for p in bars if p.get_gid().startswith("grad")]
    assert len(acts) == len(grads) == 8 * width * (plan.num_stages - 1) == len(rep.messages) // 2
    assert min(p.get_width() for p in acts) > 2.0  # 2 ms of latency at least: the gaps they explain


def test_large_plans_draw_each_stages_slowest_device_and_still_end_at_the_step():
    prof, cl = Profile.synthetic(12, seed=3), cluster(devices_per_host=12)
    plan = solve("dp", prof, cl, 2, 4)
    assert plan.num_stages * len(plan.rank_mapping[0]) > MAX_DEVICE_ROWS
    rep, end, bars, title, ax = picture(plan, prof, cl)
    assert len(ax.get_yticks()) == 2 * plan.num_stages - 1  # one device row per stage, one link row between
    assert end == pytest.approx(rep.step_time * 1e3) and title == round(rep.step_time * 1e3, 2)


def test_one_stage_plan():
    prof, cl = Profile.synthetic(4, seed=0), cluster()
    plan = solve("dp", prof, cl, 1, 3)
    rep, end, bars, title, _ = picture(plan, prof, cl)
    assert not [p for p in bars if p.get_gid().startswith(("act", "grad"))]
    assert end == pytest.approx(rep.step_time * 1e3) and title == round(rep.step_time * 1e3, 2)


def test_table_and_plan_json_share_the_half_open_layer_ranges(tmp_path, capsys):
    prof, cl = Profile.synthetic(8, seed=1), cluster()
    pp, cp = tmp_path / "p.json", tmp_path / "c.yaml"
    prof.save(str(pp))
    cl.save(str(cp))
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert plan_main(["--cluster", str(cp), "--profile", str(pp), "--stages", "2", "--out", str(out),
                      "--plot", str(png)]) == 0
    text = capsys.readouterr().out.splitlines()
    saved = json.load(open(out))
    rows = [line.split() for line in text[1:1 + len(saved["stages"])]]
    for row, stage, lo, hi in zip(rows, saved["stages"], saved["boundaries"], saved["boundaries"][1:]):
        assert stage["layers"] == [lo, hi]
        assert f"{row[1]} {row[2]}" == f"[{lo}, {hi})"  # the table column, e.g. "[0, 5)"
    plan = Plan.load(str(out))
    step = replay_plan(plan, prof, Cluster.load(str(cp))).step_time
    assert any(line.startswith(f"plot written to {png}: replay of the 1f1b schedule, step {step * 1e3:.3f} ms")
               for line in text)
    assert png.stat().st_size > 10_000
