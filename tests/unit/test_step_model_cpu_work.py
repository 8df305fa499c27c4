"""The cost model's CPU-bound parts (issue #38's prediction grid): a reduction's own work per byte, the update
timed as one piece, speeds kept relative to the profile's device, and the grid's bookkeeping."""
import pytest

from pdv_ext.bench import grid
from pdv_ext.emulate.train_step_timer import reduce_work
from pdv_ext.placement.cluster import Cluster
from pdv_ext.placement.cost import evaluate, reduce_traffic
from pdv_ext.placement.profile import LayerProfile, Profile, whole_update_seconds


def _cluster(throughputs=(1.0, 1.0, 1.0, 1.0)):
    return Cluster.from_dict({
        "devices": [{"name": f"d{i}", "host": "h", "throughput": t, "memory": 1e9} for i, t in enumerate(throughputs)],
        "links": {"intra_host": {"bandwidth": 1e9, "latency": 0.0}, "inter_host": {"bandwidth": 1e9, "latency": 0.0}}})


def _profile(engine=None):
    return Profile([LayerProfile(f"l{i}", 0.1, 1e6, 1e3, 1e3, update=0.01) for i in range(4)], engine=engine)


def test_reduce_traffic_per_pattern():
    assert reduce_traffic("ring", 1) == 0.0
    assert reduce_traffic("ring", 2) == pytest.approx(1.0)
    assert reduce_traffic("ring", 4) == pytest.approx(1.5)
    assert reduce_traffic("sliced_validation", 4) == pytest.approx(2.25)
    assert reduce_traffic("gossip", 4, gossip_peers=2, gossip_ratio=0.01) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="unknown reduction pattern 'tree'"):
        reduce_traffic("tree", 4)


def test_reduction_work_is_charged_per_byte_sent_and_per_gradient_byte_at_the_slowest_speed():
    per_byte, per_grad = 4e-9, 1e-9
    bare = evaluate(_profile({"micro_batch": 0.0, "step": 0.0}), _cluster(), [0, 4], [[0, 1, 2, 3]], 2)
    cpu = evaluate(_profile({"micro_batch": 0.0, "step": 0.0, "reduce_byte": per_byte, "reduce_grad_byte": per_grad}),
                   _cluster(), [0, 4], [[0, 1, 2, 3]], 2)
    grad = 4e6  # four layers of 1e6 parameter bytes
    assert cpu.stages[0].reduce - bare.stages[0].reduce == pytest.approx(grad * (per_grad + per_byte * 1.5))
    # one device at half speed: the ring goes at its pace
    slow = evaluate(_profile({"reduce_byte": per_byte, "reduce_grad_byte": per_grad}), _cluster((0.5, 1, 1, 1)),
                    [0, 4], [[0, 1, 2, 3]], 2)
    assert slow.stages[0].reduce - bare.stages[0].reduce == pytest.approx(2 * grad * (per_grad + per_byte * 1.5))
    # a stage without replicas reduces nothing
    alone = evaluate(_profile({"reduce_byte": per_byte, "reduce_grad_byte": per_grad}), _cluster(), [0, 1, 2, 3, 4],
                     [[0], [1], [2], [3]], 2)
    assert all(st.reduce == 0.0 for st in alone.stages)


def test_reduce_work_splits_two_group_sizes_into_per_byte_and_per_gradient_byte():
    nbytes, grad, sent = 1e6, 1e-9, 5e-9
    cpu = {w: nbytes * (grad + sent * reduce_traffic("ring", w)) for w in (2, 4)}
    got = reduce_work(nbytes, cpu)
    assert got["reduce_byte"] == pytest.approx(sent) and got["reduce_grad_byte"] == pytest.approx(grad)
    # one size only (a world of two): everything is charged per byte sent
    assert reduce_work(nbytes, {2: 3e-3}) == {"reduce_byte": pytest.approx(3e-9)}
    # a larger group costing less (noise): no negative work per byte sent, the pair's cost per gradient byte
    odd = reduce_work(nbytes, {2: 4e-3, 4: 3e-3})
    assert odd["reduce_byte"] == 0.0 and odd["reduce_grad_byte"] == pytest.approx(4e-9)
    # a pair costing less than its share of the larger group's traffic: nothing per gradient byte
    steep = reduce_work(nbytes, {2: 1e-3, 4: 4e-3})
    assert steep["reduce_grad_byte"] == 0.0 and steep["reduce_byte"] == pytest.approx(4e-3 / 1.5e6)


def test_engine_reduce_numbers_round_trip_scale_and_combine(tmp_path):
    prof = _profile({"micro_batch": 1e-3, "step": 2e-3, "reduce_byte": 4e-9, "reduce_grad_byte": 1e-9})
    path = str(tmp_path / "p.json")
    prof.save(path)
    back = Profile.load(path)
    assert back.engine == prof.engine
    half = back.scaled(0.5)
    assert half.engine["reduce_byte"] == pytest.approx(8e-9) and half.engine["reduce_grad_byte"] == pytest.approx(2e-9)
    both = Profile.combined([prof, half])
    assert both.engine["reduce_byte"] == pytest.approx(6e-9)
    # a profile written before these numbers loads back without them
    old = _profile({"micro_batch": 1e-3, "step": 2e-3})
    old.save(path)
    assert "reduce_byte" not in Profile.load(path).engine


def test_whole_update_is_timed_as_one_piece_and_sets_the_layers_total():
    torch = pytest.importorskip("torch")
    from pdv_ext.placement.profile import _Update, profile_layers

    mods = [torch.nn.Linear(64, 64) for _ in range(3)]
    ups = [_Update(list(m.parameters())) for m in mods]
    assert whole_update_seconds(ups, reps=2, warmup=1) > 0
    assert whole_update_seconds([_Update([])], reps=2) == 0.0
    prof = profile_layers(mods, torch.randn(8, 64), reps=2, device="cpu")
    total = sum(l.update for l in prof.layers)
    assert total == pytest.approx(prof.meta["whole_update_seconds"])
    assert prof.meta["update_scale"] > 0


def test_with_throughputs_keeps_the_profiles_reference():
    c = _cluster((1.0, 1.0, 0.5, 0.5))
    slowed = c.with_throughputs([0.4, 1.0, 0.5, 0.5])
    assert [slowed.speed(i) for i in range(4)] == pytest.approx([0.4, 1.0, 0.5, 0.5])
    # every device slower than the reference (the fastest one slowed): speeds are not re-scaled to the new fastest
    all_slow = c.with_throughputs([0.4, 0.8, 0.5, 0.5])
    assert [all_slow.speed(i) for i in range(4)] == pytest.approx([0.4, 0.8, 0.5, 0.5])


def test_grid_cases_per_depth_and_stage():
    c = _cluster()

    def plan_for(cl, depth):  # the slowed device moves to the last stage's last replica
        devs = sorted(range(4), key=lambda i: -cl.speed(i))
        rows = [devs[s * (4 // depth):(s + 1) * (4 // depth)] for s in range(depth)]
        return list(range(0, depth + 1)), rows

    got = grid.cases(plan_for, c, [1, 2], 0.4)
    kinds = [(x["depth"], x["case"], x["stage"], x["slowed"]) for x in got]
    assert kinds == [(1, "calm", None, None), (1, "before", 0, 0), (1, "after", 0, 0),
                     (2, "calm", None, None), (2, "before", 0, 0), (2, "after", 0, 0), (2, "before", 1, 2),
                     (2, "after", 1, 2)]
    assert got[2]["rank_mapping"] == [[1, 2, 3, 0]]


def test_grid_skips_an_after_run_that_is_the_calm_plan():
    got = grid.cases(lambda cl, d: ([0, 4], [[0, 1, 2, 3]]), _cluster(), [1], 0.4)
    assert [x["case"] for x in got] == ["calm", "before"]


def test_grid_depth_checks_name_the_depth():
    assert grid.check_depths([1, 2, 4], 4, 8, 8) is None
    assert "3 does not divide" in grid.check_depths([3], 4, 8, 8)
    assert "do not share --micro-batches 6" in grid.check_depths([1], 4, 6, 8)
    assert "4 stages for 3 layers" in grid.check_depths([4], 4, 8, 1)


def test_grid_speeds_from_wall_and_from_cpu_at_the_quota():
    prof = _profile()  # 0.1 s forward + backward per layer
    bd = [{"ForwardPass": [100.0, 20.0], "BackwardPass": [100.0, 30.0]},   # 2 layers, 2 micro-batches
          {"ForwardPass": [200.0, 10.0], "BackwardPass": [200.0, 15.0]}]
    wall = grid.measured_speeds(prof, [0, 2, 4], [[0], [1]], 2, bd)
    assert wall == pytest.approx([0.2 / 0.1, 0.2 / 0.2])
    busy = grid.measured_speeds(prof, [0, 2, 4], [[0], [1]], 2, bd, cores=[0.5, 0.25], rate=1.0)
    assert busy == pytest.approx([0.2 / (0.025 / 0.5), 0.2 / (0.0125 / 0.25)])


def test_grid_summary_takes_the_worst_of_each_kind():
    rows = [{"case": "calm", "error": 0.02, "replay_error": 0.03, "wall_speeds_error": 0.1, "stated_speeds_error": 0.2},
            {"case": "after", "error": 0.08, "replay_error": 0.01, "wall_speeds_error": 0.3, "stated_speeds_error": 0.1}]
    s = grid.summary(rows)
    assert s["worst_error"] == 0.08 and s["worst_error_calm"] == 0.02 and s["worst_error_before"] is None
    assert s["worst_wall_speeds_error"] == 0.3 and s["worst_replay_error_after"] == 0.01


def test_grid_bad_depth_is_one_line_before_anything_runs(capsys):
    assert grid.main(["--depths", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pdv bench grid: --depths: 3 does not divide the cluster's 4 devices"]
    with pytest.raises(SystemExit):
        grid.main(["--slow", "1.5"])
    assert "--slow 1.5 is not a slowdown" in capsys.readouterr().err


def test_grid_baseline_profile_drops_the_cpu_work():
    prof = _profile({"micro_batch": 1e-3, "step": 2e-3, "reduce_byte": 4e-9, "reduce_grad_byte": 1e-9})
    prof.meta["update_scale"] = 2.0
    bare = grid.without_cpu_work(prof)
    assert [l.update for l in bare.layers] == pytest.approx([0.005] * 4)
    assert bare.engine == {"micro_batch": 1e-3, "step": 2e-3}
    assert prof.engine["reduce_byte"] == 4e-9 and prof.layers[0].update == 0.01  # the original is untouched
    c = _cluster()
    full = evaluate(prof, c, [0, 4], [[0, 1, 2, 3]], 2).step_time
    assert evaluate(bare, c, [0, 4], [[0, 1, 2, 3]], 2).step_time < full


def _grid_row(measured, predicted, busy, case="calm"):
    row = {"depth": 1, "case": case, "stage": None, "slowed": None, "measured_ms": measured, "replay_ms": predicted,
           "busy_speeds": busy, "wall_speeds": busy, "host_steal": 0.01, "parts_ms": {"ForwardPass": measured}}
    for key in grid.PREDICTIONS:
        row[f"{key}predicted_ms"] = predicted
        row[f"{key}error"] = round(abs(predicted - measured) / measured, 3)
    return row


def test_grid_rounds_merge_into_medians_of_each_case():
    rounds = [[_grid_row(100.0, 90.0, [1.0, 0.5])], [_grid_row(130.0, 100.0, [0.8, 0.4])],
              [_grid_row(110.0, 80.0, [0.9, 0.6])]]
    (row,) = grid.merge_rounds(rounds)
    # the medians of the rounds: measured 110, predicted 90 -> 18.2% off (each round alone: 10%, 23.1%, 27.3%)
    assert row["measured_ms"] == 110.0 and row["predicted_ms"] == 90.0 and row["error"] == 0.182
    assert row["replay_ms"] == 90.0 and row["stated_speeds_error"] == 0.182
    assert row["busy_speeds"] == [0.9, 0.5]
    assert row["parts_ms"] == {"ForwardPass": 110.0}  # the median round's breakdown
    assert [r["error"] for r in row["rounds"]] == [0.1, 0.231, 0.273]
    # one round gives its own row back
    (one,) = grid.merge_rounds([[_grid_row(100.0, 90.0, [1.0, 0.5])]])
    assert one["error"] == 0.1 and one["measured_ms"] == 100.0 and len(one["rounds"]) == 1


def test_grid_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        grid.main(["--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err


def test_grid_repeats_run_every_case_per_round_and_report_medians(tmp_path, monkeypatch, capsys):
    """`pdv bench grid --repeats 2` end to end with the emulated runs faked: a profile and every case per round,
    round 2 on round 1's plans, each case's measured step the median of its rounds, every round's own kept."""
    import json

    from pdv_ext.bench import placement as bench_placement
    from pdv_ext.emulate import launcher

    calls = []

    def fake_emulate(spec, cmd, timeout, label, steal, cpu_budget=None, top_share=None):
        out = cmd[cmd.index("--out") + 1]
        calls.append(label)
        steal[label] = 0.0
        if "profile" in cmd:
            Profile([LayerProfile(f"l{i}", 0.05, 1e6, 1e3, 1e3, update=0.005) for i in range(10)]).save(out)
            return False
        with open(cmd[cmd.index("--plan") + 1]) as f:
            plan = json.load(f)
        n = sum(len(row) for row in plan["rank_mapping"])
        step = 500.0 + 100.0 * calls.count(label) + (50.0 if label.endswith("-r2") else 0.0)
        with open(out, "w") as f:
            json.dump({"median_step_ms": step, "parts": plan["boundaries"], "rank_mapping": plan["rank_mapping"],
                       "breakdown_ms": [{"ForwardPass": [100.0, 20.0], "BackwardPass": [200.0, 40.0]}] * n}, f)
        return False

    monkeypatch.setattr(bench_placement, "_emulate", fake_emulate)
    monkeypatch.setattr(launcher, "check_available", lambda: None)
    monkeypatch.setattr(grid, "ARTIFACTS", str(tmp_path))
    assert grid.main(["--quick", "--repeats", "2", "--cpu-budget", "1.1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cases = len(res["runs"])
    assert calls[0] == "profile" and calls[cases + 1] == "profile-r2" and len(calls) == 2 * (cases + 1)
    assert res["repeats"] == 2 and len(res["profiles"]) == 2 and len(res["worst_error_rounds"]) == 2
    for row in res["runs"]:  # rounds measured 600 and 650 ms: the median 625
        assert [r["measured_ms"] for r in row["rounds"]] == [600.0, 650.0] and row["measured_ms"] == 625.0
        assert row["error"] == round(abs(row["predicted_ms"] - 625.0) / 625.0, 3)
    assert res["worst_round_error"] == max(res["worst_error_rounds"])
    assert (tmp_path / "budget-1.10" / "run0-r2.json").exists() and (tmp_path / "budget-1.10" / "profile-r2.json").exists()
