"""`pdv bench adapt`'s parts that need no emulated cluster: the scenario file, the oracle's split, the
figures computed from a run's per-step times and the emulator's events log, and the plot."""
import json
import os

import pytest

from pdv_ext.bench import adapt
from pdv_ext.config_base import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIOS = os.path.join(ROOT, "launch", "scenarios")


@pytest.mark.parametrize("name", ["dp4_straggler", "transient", "calm", "pipe2x2_straggler", "pipe4_straggler"])
def test_shipped_scenarios_load(name):
    sc, cluster, _, spec, events = adapt.load_scenario(os.path.join(SCENARIOS, f"{name}.yaml"))
    assert sc.run.pipe * sc.run.data == len(cluster) == len(spec.devices)
    # placed by training step, within the run, in order: the same share of the run on any machine
    assert all(e.at is None and 0 < e.at_step < sc.run.steps for e in events)
    assert [e.at_step for e in events] == sorted(e.at_step for e in events)


def test_oracle_is_the_split_for_the_speeds_after_the_last_event():
    sc, cluster, _, _, events = adapt.load_scenario(os.path.join(SCENARIOS, "dp4_straggler.yaml"))
    assert adapt.final_throughputs(cluster, events) == [1.0, 1.0, 1.0, 0.33]
    assert adapt.oracle_shares(cluster, events, sc.run) == [5, 5, 5, 1]
    sc, cluster, _, _, events = adapt.load_scenario(os.path.join(SCENARIOS, "transient.yaml"))
    assert adapt.oracle_shares(cluster, events, sc.run) is None  # it recovers: the equal split


def _write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return str(p)


def test_bad_scenarios_are_one_line_each(tmp_path):
    cluster = os.path.join(ROOT, "launch", "clusters", "emulated_4equal.yaml")
    with pytest.raises(ConfigError) as e:
        adapt.load_scenario(_write(tmp_path, f"cluster: {cluster}\nrun: {{data: 4, steps: 5, micro_batchs: 2}}\n"))
    assert any("run.micro_batchs" in line for line in e.value.errors)
    with pytest.raises(ConfigError) as e:
        adapt.load_scenario(_write(tmp_path, f"cluster: {cluster}\nrun: {{data: 2, steps: 5}}\n"))
    assert "pipe x data = 2 ranks, but the cluster has 4 devices" in e.value.errors[0]
    with pytest.raises(ConfigError) as e:
        adapt.load_scenario(_write(tmp_path, f"cluster: {cluster}\nrun: {{data: 4, steps: 5}}\n"
                                             "events: [{at: 1s, device: d9, throughput: 0.5}]\n"))
    assert "unknown device 'd9'" in e.value.errors[0]
    with pytest.raises(ConfigError) as e:
        adapt.load_scenario(_write(tmp_path, f"cluster: {cluster}\nrun: {{data: 4, steps: 5, policy: "
                                             "{plugins: [{name: rebalnce}]}}\n"))
    assert "rebalnce" in e.value.errors[0] and "did you mean 'rebalance'" in e.value.errors[0]
    with pytest.raises(ConfigError) as e:
        adapt.load_scenario(_write(tmp_path, f"cluster: {cluster}\nrun: {{data: 4, steps: 5, cpu_budget: 0}}\n"))
    assert any("run.cpu_budget" in line for line in e.value.errors)


def test_a_cpu_budget_is_read_and_a_bad_one_refused_before_anything_runs(tmp_path, capsys):
    cluster = os.path.join(ROOT, "launch", "clusters", "emulated_4equal.yaml")
    sc = adapt.load_scenario(_write(tmp_path, f"cluster: {cluster}\nrun: {{data: 4, steps: 5, cpu_budget: 0.5}}\n"
                                              "events: [{at_step: 2, device: d1, throughput: 0.5}]\n"))[0]
    assert sc.run.cpu_budget == 0.5
    assert adapt._budget(None) == round(0.55 * (os.cpu_count() or 1), 3) and adapt._budget(0.5) == 0.5
    with pytest.raises(SystemExit):
        adapt.main(["--scenario", os.path.join(SCENARIOS, "calm.yaml"), "--cpu-budget", "-1"])
    assert "--cpu-budget must be > 0 cores (got -1)" in capsys.readouterr().err


def test_steps_override_reaches_the_emulator_check(monkeypatch, capsys):
    # --steps re-places the events given as a share of the run; it raised UnboundLocalError before (an import
    # of resolve_steps below its use)
    from pdv_ext.emulate import launcher

    def unavailable():
        raise launcher.EmulationUnavailable("no emulation in this test")

    monkeypatch.setattr(launcher, "check_available", unavailable)
    assert adapt.main(["--scenario", os.path.join(SCENARIOS, "pipe2x2_straggler.yaml"), "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "no emulation in this test" in err and "is not within the run's 10 steps" in err


def _result():
    # 10 steps of 1 s (batch 64) from t=100, an event hit during step 4, a change decided after step 6
    ends = [100.0 + i for i in range(1, 11)]
    return {"start": 100.0, "ends": ends, "durations": [1.0] * 3 + [2.0] * 3 + [1.0] * 4, "global_batch": 64,
            "decisions": [{"step": 6, "shares": [3, 1]}], "shares": [None] * 6 + [[3, 1]] * 4, "samples": 640,
            "held_out_loss": 2.0}


def test_phases_event_steps_and_adaptation_delay():
    res = _result()
    log = [{"index": 0, "applied": True, "wall": 103.5}, {"index": 1, "applied": False, "wall": None}]
    assert adapt.event_steps(res, log) == [4, None]
    ph = adapt.phases(res, log)
    assert [p["steps"] for p in ph] == [3, 7]
    assert ph[0]["samples_per_s"] == pytest.approx(64.0) and ph[1]["samples_per_s"] == pytest.approx(64 * 7 / 10)
    d = adapt.adaptation_delays(res, [4], every=2)[0]
    assert (d["event_step"], d["adapted_at_step"], d["steps"], d["agreement_steps"]) == (4, 6, 3, 2)


def test_after_event_ratio_compares_the_steps_from_the_first_events_step():
    # static: 10 steps of 1 s, the event hits step 4 and every step from it takes 2 s; adaptive: the same, then
    # back to 1.25 s from step 6 (it adapted); the whole-run ratio mixes in the calm steps, the after-event one not
    static = _result() | {"durations": [1.0] * 3 + [2.0] * 7}
    adaptive = _result() | {"durations": [1.0] * 3 + [2.0] * 2 + [1.25] * 5}
    log = [{"index": 0, "applied": True, "wall": 103.5, "at": None, "at_step": 3, "applied_step": 3}]
    for res in (static, adaptive):
        res["events_log"] = log
    st, ad = adapt.summarize("static", static, 2), adapt.summarize("adaptive", adaptive, 2)
    assert st["event_step"] == ad["event_step"] == 4 and st["event_steps"] == [4]
    assert st["after_event_samples_per_s"] == pytest.approx(64 * 7 / 14)
    assert ad["after_event_samples_per_s"] == pytest.approx(64 * 7 / (4 + 6.25))
    assert adapt.after_event_ratio({"static": st, "adaptive": ad}) == pytest.approx(14 / 10.25)
    whole = ad["wall_seconds"] / st["wall_seconds"]
    assert whole == pytest.approx(13.25 / 17) and 1 / whole < adapt.after_event_ratio({"static": st, "adaptive": ad})
    assert adapt.after_event_rate(static, 1) == pytest.approx(64 * 10 / 17)  # an event at step 0: the whole run
    # no event (calm), or one the run never reached: no after-event figure, no ratio
    calm = _result() | {"events_log": []}
    none = adapt.summarize("static", calm, 2)
    assert none["event_step"] is None and none["after_event_samples_per_s"] is None
    assert adapt.after_event_ratio({"static": none, "adaptive": ad}) is None
    assert adapt.after_event_ratio({"adaptive": ad}) is None
    assert adapt.after_event_rate(static, 11) is None and adapt.after_event_rate(static, None) is None


def test_plot_draws_the_three_runs(tmp_path):
    from pdv_ext.plot import plot_adapt

    res = _result()
    res["events_log"] = [{"index": 0, "applied": True, "wall": 103.5}]
    full = {"scenario": "x", "events": [{"at": 3.5, "device": "d3", "throughput": 0.33}], "adaptive_vs_static": 0.6,
            "static": {"wall_seconds": 20.0}, "adaptive": {"wall_seconds": 12.0},
            "series": {"static": res, "adaptive": res, "oracle": res}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(full))
    out = tmp_path / "r.png"
    assert plot_adapt(str(path), str(out)) == ["static", "oracle", "adaptive"]
    assert out.stat().st_size > 10_000


def test_each_run_has_its_event_where_it_met_it():
    """An event placed by training step comes later in a slower run: each run's line at its own time."""
    from pdv_ext.plot import event_lines

    fast = {"start": 100.0, "events_log": [{"index": 0, "applied": True, "wall": 110.0}]}
    slow = {"start": 500.0, "events_log": [{"index": 0, "applied": True, "wall": 525.0},
                                           {"index": 1, "applied": False, "wall": None}]}
    assert event_lines({"static": fast, "oracle": slow}, ["static", "oracle"]) == \
        [("static", 0, 10.0), ("oracle", 0, 25.0)]


def test_a_move_is_reported_with_its_cost_and_predictions():
    res = _result()
    res["decisions"] = [{"step": 6, "replan": True, "boundaries": [0, 3, 6], "rank_mapping": [[1], [0]]}]
    res["moves"] = [{"step": 6, "seconds": 0.5, "bytes_moved": 1000, "new_plan": {}}]
    res["predictions"] = [{"step": 6, "kind": "replan", "predicted_before": 2.1, "predicted_after": 1.1}]
    d = adapt.adaptation_delays(res, [4], every=2)[0]
    assert d["replan"] == {"boundaries": [0, 3, 6], "rank_mapping": [[1], [0]]} and "shares" not in d
    fig = adapt.replan_figures(res, [4])[0]
    assert fig["measured_step_before"] == 2.0 and fig["measured_step_after"] == 1.0
    assert fig["move_in_steps"] == 0.25 and fig["prediction_error_after"] == pytest.approx(0.1)
    assert fig["steps_after"] == 4
    assert fig["host_steal_before"] is None and fig["host_steal_after"] is None  # no samples: unknown
    # the host's steal ticks sampled while it ran: its share during the steps before (3-5: t 102-105) and
    # after the move (7-10: t 106-110), and over the run
    res["host_cpu"] = [[100.0, 0, 0], [102.0, 0, 100], [105.0, 30, 400], [106.0, 30, 500], [110.0, 130, 900]]
    fig = adapt.replan_figures(res, [4])[0]
    assert fig["host_steal_before"] == pytest.approx(0.1) and fig["host_steal_after"] == pytest.approx(0.25)
    res["events_log"] = []
    assert adapt.summarize("adaptive", res, every=2)["host_steal"] == pytest.approx(130 / 900)


def test_the_step_after_a_move_is_every_step_its_plan_ran():
    """The median over the span up to the next change (another move, an event), not the first few steps: a
    short transient after the move does not decide, and the next plan's steps do not count."""
    res = _result()
    res["durations"] = [1.0] * 3 + [2.0] * 3 + [0.5, 0.5, 1.2, 1.2, 1.2, 1.2, 1.2, 3.0, 3.0, 3.0]
    res["moves"] = [{"step": 6, "seconds": 0.5, "bytes_moved": 1000}, {"step": 13, "seconds": 0.5, "bytes_moved": 1}]
    res["predictions"] = [{"step": 6, "kind": "replan", "predicted_before": 2.1, "predicted_after": 1.1},
                          {"step": 13, "kind": "replan", "predicted_before": 3.0, "predicted_after": 2.0}]
    first, second = adapt.replan_figures(res, [4], window=3)
    assert first["steps_after"] == 6 and first["measured_step_after"] == 1.2  # steps 7-12
    assert first["measured_step_after_first"] == 0.5
    assert first["prediction_error_after"] == pytest.approx(0.1 / 1.2)
    assert second["steps_after"] == 3 and second["measured_step_after"] == 3.0
    assert adapt.replan_figures(res, [4, 10], window=3)[0]["steps_after"] == 3  # an event at step 10 ends it


def test_every_rounds_moves_are_checked_against_their_predictions():
    """With --repeats, the median round's moves are reported in full; every round's errors beside them."""
    moved = _result()
    moved["moves"] = [{"step": 6, "seconds": 0.5, "bytes_moved": 1000}]
    moved["predictions"] = [{"step": 6, "kind": "replan", "predicted_before": 2.1, "predicted_after": 1.1}]
    moved["events_log"] = []
    worse = {**moved, "predictions": [{"step": 6, "kind": "replan", "predicted_before": 2.1, "predicted_after": 1.3}]}
    still = {**_result(), "events_log": []}  # a round that did not move
    out = adapt.every_round_errors([moved, worse, still])
    assert out["prediction_errors_after_runs"][0] == [pytest.approx(0.1)]
    assert out["prediction_errors_after_runs"][2] == []
    assert out["max_prediction_error_after"] == pytest.approx(0.3)


def test_replan_plugins_get_the_runs_length():
    pol = adapt._with_total_steps({"every": 2, "plugins": [{"name": "replan"}, {"name": "rebalance"}]}, 82)
    assert pol["plugins"] == [{"name": "replan", "total_steps": 82}, {"name": "rebalance"}]
