"""`pdv bench adaptive --scenario`'s parts that need no emulated cluster: the batch scenario file, the schedules,
the runs of a round and the report (which runs count, the headroom, the ratio)."""
import os

import pytest

from pdv_ext.bench import adaptive, batch_regime as br
from pdv_ext.config_base import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIOS = os.path.join(ROOT, "launch", "scenarios")
CLUSTER = os.path.join(ROOT, "launch", "clusters", "emulated_4equal.yaml")


@pytest.mark.parametrize("name", ["batch_pipeline", "batch_slow_link", "batch_teacher_pipeline",
                                  "batch_teacher_slow_link"])
def test_shipped_batch_scenarios_load(name):
    sc, spec = br.load(os.path.join(SCENARIOS, f"{name}.yaml"))
    assert sc.run.pipe * sc.run.data == len(spec.devices)
    runs = br.runs_of(sc)
    assert [r["micro_batches"] for r in runs if r["kind"] == "fixed"] == [
        b for b in sc.batch.fixed for _ in sc.batch.fixed_lr]
    assert len([r for r in runs if r["kind"] == "schedule"]) == len(sc.batch.schedules) >= 1


def test_parse_schedule():
    assert br.parse_schedule("1,150:4,400:16") == (1, [(150, 4), (400, 16)])
    assert br.parse_schedule(" 2 ") == (2, [])
    for text, words in [("", "empty"), ("x,3:4", "'x' is not a whole number"), ("0", "must be >= 1"),
                        ("1,3-4", "'3-4' is not STEP:MICRO_BATCHES"), ("1,0:4", "a step >= 1"),
                        ("1,5:4,5:8", "steps must increase")]:
        with pytest.raises(ValueError) as e:
            br.parse_schedule(text)
        assert words in str(e.value), (text, str(e.value))


def _write(tmp_path, text):
    p = tmp_path / "b.yaml"
    p.write_text(text)
    return str(p)


def _scenario(batch, run="{pipe: 2, data: 2}"):
    return f"cluster: {CLUSTER}\nrun: {run}\nbatch: {batch}\n"


@pytest.mark.parametrize("batch, run, words", [
    ("{fixed: [1, 0], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2}", "batch.fixed"),
    ("{fixed: [1, 1], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2}", "each batch once"),
    ("{fixed: [], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2}", "batch.fixed"),
    ("{fixed: [2], target_loss: 2, max_samples: 15}", "{pipe: 2, data: 2}",
     "batch.max_samples: 15 is less than one step of the smallest fixed batch (16 samples)"),
    ("{fixed: [1], target_loss: 2, max_samples: 100, schedules: ['1,9:2,4:8']}", "{pipe: 2, data: 2}",
     "batch.schedules.0: schedule '1,9:2,4:8': steps must increase"),
    ("{fixed: [1], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 1}", "pipe x data = 2 ranks"),
    ("{fixed: [1], target_loss: 0, max_samples: 100}", "{pipe: 2, data: 2}", "batch.target_loss"),
    ("{fixed: [1], target_loss: 2, max_samples: 100, adaptive: {plugins: [{name: nosuch}]}}",
     "{pipe: 2, data: 2}", "batch.adaptive.policy.plugins.0.name"),
    ("{fixed: [1], target_loss: 2, max_samples: 100, lr_rule: cubic}", "{pipe: 2, data: 2}", "batch.lr_rule"),
    ("{fixed: [1], fixed_lr: [1, 0], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2}", "batch.fixed_lr"),
    ("{fixed: [1], fixed_lr: [0.5, 0.5], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2}",
     "each multiplier once"),
    ("{fixed: [1], target_loss: 2, max_samples: 100}", "{pipe: 4, data: 1, task: teacher, teacher: {layers: 3}}",
     "run.pipe: 4 stages, but run.teacher.layers is 3"),
    ("{fixed: [1], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2, task: vision}", "run.task"),
    ("{fixed: [1], target_loss: 2, max_samples: 100}", "{pipe: 2, data: 2, task: teacher, teacher: {layers: 1}}",
     "run.teacher.layers"),
])
def test_bad_batch_scenarios_name_the_key(tmp_path, batch, run, words):
    with pytest.raises(ConfigError) as e:
        br.load(_write(tmp_path, _scenario(batch, run)))
    assert any(words in line for line in e.value.errors), e.value.errors


def test_bench_adaptive_refuses_a_bad_scenario_before_anything_runs(tmp_path, capsys):
    path = _write(tmp_path, _scenario("{fixed: [1], target_loss: 2, max_samples: 100, schedules: ['1,x']}"))
    assert adaptive.main(["--scenario", path, "--json"]) == 2
    assert "batch.schedules.0: schedule '1,x': 'x' is not STEP:MICRO_BATCHES" in capsys.readouterr().err


def test_lr_follows_the_rule_and_a_schedule_becomes_the_schedule_policy():
    assert br.lr_factor("sqrt", 4) == 2 and br.lr_factor("linear", 4) == 4 and br.lr_factor("none", 4) == 1
    fixed = {"label": "fixed-4", "kind": "fixed", "micro_batches": 4, "changes": [], "policy": None}
    assert br._policy(fixed, "sqrt") is None
    sched = {"label": "schedule-1,9:4", "kind": "schedule", "micro_batches": 1, "changes": [(9, 4)], "policy": None}
    pol = br._policy(sched, "sqrt")
    assert pol["every"] == 1  # a change lands after the step it names, whatever the step's parity
    assert pol["plugins"] == [{"name": "schedule", "changes": [{"step": 9, "micro_batches": 4, "lr_rule": "sqrt"}]}]


def _rounds(*seconds):
    """Rounds of one run: None = did not reach the target."""
    return [{"reached": s is not None, "seconds_to_target": s, "samples_to_target": 100 if s else None,
             "steps_to_target": 10 if s else None, "samples": 200, "train_seconds": 2.0, "final_loss": 1.8,
             "decisions": [], "trace": []} for s in seconds]


def _sc(adaptive_policy=None):
    from pdv_ext.bench.batch_regime import BatchScenario

    return BatchScenario.model_validate({
        "cluster": "x", "run": {"pipe": 2, "data": 2},
        "batch": {"fixed": [1, 4, 16], "schedules": ["1,50:4", "4,50:16"], "target_loss": 1.9, "max_samples": 999,
                  "adaptive": adaptive_policy}})


def test_report_headroom_ratio_and_runs_that_did_not_reach_the_target():
    sc = _sc({"plugins": [{"name": "gns_batch_size"}]})
    runs = br.runs_of(sc)
    assert [r["label"] for r in runs] == ["fixed-1", "fixed-4", "fixed-16", "schedule-1,50:4", "schedule-4,50:16",
                                          "adaptive"]
    results = {"fixed-1": _rounds(30, 32, 31), "fixed-4": _rounds(20, 19, 21), "fixed-16": _rounds(5, None, 5),
               "schedule-1,50:4": _rounds(17, 16, 18), "schedule-4,50:16": _rounds(None, None, None),
               "adaptive": _rounds(18, 18, 19)}
    out = br.figures(sc, runs, results)
    f16 = out["fixed"][2]
    assert not f16["reached"] and f16["seconds_to_target"] is None and "1 of 3 rounds" in f16["note"]
    assert out["best_fixed"] == {"micro_batches": 4, "seconds_to_target": 20}  # fixed-16 never counts
    assert out["best_schedule"] == {"schedule": "1,50:4", "seconds_to_target": 17}
    assert out["schedule_vs_best_fixed"] == 0.85 and out["headroom"] == 0.15
    assert out["ratio"] == 0.9 and out["fixed"][0]["global_batch"] == 8


def test_no_ratio_when_no_fixed_batch_reached_the_target():
    sc = _sc()
    runs = br.runs_of(sc)
    results = {r["label"]: _rounds(None) for r in runs}
    results["schedule-1,50:4"] = _rounds(10)
    out = br.figures(sc, runs, results)
    assert "no fixed batch reached the target loss 1.9 within 999 samples" in out["error"]
    assert "headroom" not in out and "ratio" not in out and "best_fixed" not in out


def test_plot_batch_draws_every_run(tmp_path):
    import json

    from pdv_ext import plot

    res = {"scenario": "t", "target_loss": 1.9, "best_fixed": {"micro_batches": 4, "seconds_to_target": 3.0},
           "schedule_vs_best_fixed": 0.9, "headroom": 0.1,
           "traces": {"fixed-1": [[[10, 80, 1.0, 2.5, 1], [20, 160, 2.0, 2.0, 1], [30, 240, 3.0, 1.8, 1]]],
                      "schedule-1,10:4": [[[10, 80, 1.0, 2.5, 1], [15, 240, 1.8, 1.85, 4]]]}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    out = tmp_path / "r.png"
    assert plot.main(["batch", str(path), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    # with an adaptive run's noise scale (the trace's sixth column): a fourth panel
    res["traces"]["adaptive"] = [[[10, 80, 1.0, 2.5, 1, None], [20, 240, 2.0, 1.95, 2, 12.5],
                                  [25, 400, 2.6, 1.85, 4, 30.0]]]
    path.write_text(json.dumps(res))
    assert plot.plot_batch(str(path), str(out)) == ["fixed-1", "schedule-1,10:4", "adaptive"]
    path.write_text(json.dumps({"target_loss": 1.9}))
    assert plot.main(["batch", str(path), "--out", str(out)]) == 2  # not a batch result: one line, no trace


def test_a_job_without_fixed_runs_reports_no_ratio_and_no_error():
    sc = _sc({"plugins": [{"name": "gns_batch_size"}]})
    runs = [r for r in br.runs_of(sc) if r["kind"] == "adaptive"]  # --only adaptive
    out = br.figures(sc, runs, {"adaptive": _rounds(18)})
    assert "error" not in out and "ratio" not in out and "no fixed batch was run" in out["note"]
    assert out["adaptive"]["seconds_to_target"] == 18


def test_schedule_lr_rule_applies_to_the_schedules_changes_only(tmp_path):
    sc, _ = br.load(_write(tmp_path, _scenario("{fixed: [2], schedules: ['2,5:8'], target_loss: 2, max_samples: "
                                               "100, schedule_lr_rule: none}")))
    fixed, sched = br.runs_of(sc)
    assert br._policy(fixed, sc.batch.schedule_lr_rule or sc.batch.lr_rule) is None
    pol = br._policy(sched, sc.batch.schedule_lr_rule or sc.batch.lr_rule)
    assert pol["lr_scaling"] == "none" and pol["plugins"][0]["changes"] == [{"step": 5, "micro_batches": 8,
                                                                               "lr_rule": "none"}]
    out = br.figures(sc, [fixed], {"fixed-2": _rounds(10)})
    assert (out["lr_rule"], out["schedule_lr_rule"]) == ("sqrt", "none")
    with pytest.raises(ConfigError, match="batch.schedule_lr_rule"):
        br.load(_write(tmp_path, _scenario("{fixed: [2], target_loss: 2, max_samples: 100, "
                                           "schedule_lr_rule: cubic}")))


def test_a_run_with_noise_scales_reports_the_headroom_they_allow():
    trace = [[10, 100, 1.0, 2.5, 1, None], [20, 200, 2.0, 2.2, 1, 10.0], [40, 600, 4.0, 2.0, 2, 100.0]]
    noise = br.noise_scale_figures(trace)
    from pdv_ext.policy.gns import adaptation_headroom

    want = adaptation_headroom([10.0, 100.0], [100, 400])
    assert noise == {"first": 10.0, "last": 100.0, "headroom_bound": round(want["max_headroom"], 4),
                     "knee_samples": round(want["knee"], 1)}
    assert br.noise_scale_figures([r[:5] for r in trace]) is None  # a fixed run: no Monitor, no noise scale
    sc = _sc({"plugins": [{"name": "goodput"}]})
    runs = [r for r in br.runs_of(sc) if r["kind"] == "adaptive"]
    rounds = _rounds(18)
    rounds[0]["trace"] = trace
    assert br.figures(sc, runs, {"adaptive": rounds})["adaptive"]["noise_scale"] == noise


def test_an_lr_grid_runs_each_fixed_batch_at_each_lr_and_compares_its_best(tmp_path, monkeypatch):
    sc, _ = br.load(_write(tmp_path, _scenario("{fixed: [2, 4], fixed_lr: [0.5, 1], lr_rule: none, "
                                               "target_loss: 2, max_samples: 100}")))
    runs = br.runs_of(sc)
    assert [(r["label"], r["micro_batches"], r["lr_scale"]) for r in runs] == [
        ("fixed-2@0.5", 2, 0.5), ("fixed-2@1", 2, 1.0), ("fixed-4@0.5", 4, 0.5), ("fixed-4@1", 4, 1.0)]
    # each run's LR is the rule's times its multiplier
    seen = {}

    class FakeEmulation:
        def __init__(self, spec, cmd, **kw):
            import json
            args = json.load(open(cmd[-1]))
            seen[args["micro_batches"], args["lr"]] = True
            self.out = args["out"]

        def run(self):
            import json
            json.dump({"reached": True}, open(self.out, "w"))
            return 0

    import pdv_ext.emulate.launcher as launcher
    monkeypatch.setattr(launcher, "Emulation", FakeEmulation)
    for r in runs:
        br._run(sc, None, r, str(tmp_path / r["label"]))
    assert sorted(seen) == [(2, 1e-3), (2, 2e-3), (4, 1e-3), (4, 2e-3)]
    results = {"fixed-2@0.5": _rounds(12), "fixed-2@1": _rounds(None), "fixed-4@0.5": _rounds(11),
               "fixed-4@1": _rounds(9)}
    out = br.figures(sc, runs, results)
    assert out["best_fixed"] == {"micro_batches": 4, "seconds_to_target": 9, "lr_scale": 1.0}
    assert out["best_lr_per_batch"] == {"2": {"lr_scale": 0.5, "seconds_to_target": 12},
                                        "4": {"lr_scale": 1.0, "seconds_to_target": 9}}
    assert [f["lr_scale"] for f in out["fixed"]] == [0.5, 1.0, 0.5, 1.0] and out["task"] == "bytes"


def test_teacher_samples_are_a_function_of_their_index_with_the_noise_asked_for():
    import torch

    from pdv_ext.models import TeacherSamples

    data = TeacherSamples(6, 3, noise=0.5, size=5000, seed=3)
    x, y = data.fetch(torch.arange(0, 4000))
    x2, y2 = data.fetch(torch.tensor([17, 3]))
    assert torch.equal(x2[0], x[17]) and torch.equal(y2[1], y[3])  # any order, any batch: the same sample
    resid = y - x @ data.weight.T
    assert abs(resid.std().item() - 0.5) < 0.02 and abs(x.std().item() - 1.0) < 0.03
    clean = TeacherSamples(6, 3, noise=0.5, size=5000, seed=3, clean=True)
    xc, yc = clean.fetch(torch.arange(0, 10))
    assert torch.equal(xc, x[:10]) and torch.allclose(yc, xc @ data.weight.T)  # held-out: the clean targets
    other = TeacherSamples(6, 3, noise=0.5, size=5000, seed=4)
    assert not torch.equal(other.weight, data.weight) and len(data) == 5000


def test_plot_batch_of_a_teacher_grid_draws_each_batch_at_its_best_lr(tmp_path):
    import json

    from pdv_ext import plot

    row = lambda s, loss, b: [s, s * 64, s * 0.1, loss, b]  # noqa: E731
    res = {"scenario": "t", "task": "teacher", "target_loss": 0.003,
           "best_fixed": {"micro_batches": 4, "seconds_to_target": 3.0, "lr_scale": 0.5},
           "best_lr_per_batch": {"4": {"lr_scale": 0.5, "seconds_to_target": 3.0}},
           "traces": {"fixed-4@0.5": [[row(10, 0.5, 4), row(30, 0.002, 4)]],
                      "fixed-4@1": [[row(10, 0.4, 4), row(30, 0.01, 4)]],
                      "fixed-8@1": [[row(10, 0.4, 8), row(30, 0.01, 8)]],
                      "schedule-2,10:8": [[row(10, 0.5, 2), row(20, 0.0025, 8)]]}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    assert plot.plot_batch(str(path), str(tmp_path / "r.png")) == ["fixed-4@0.5", "schedule-2,10:8"]
