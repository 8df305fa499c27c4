"""`pdv bench byzantine` / `convergence`: arguments, configurations and the one-JSON-line contract.
The rank functions themselves run in tests/integration/test_agg_ranks.py; here the spawner is faked."""
import json

import pytest

import pdv_ext.spawn
from pdv_ext.cli import main


def fake_spawner(calls, make_rows):
    def run_ranks(target, world, kwargs, timeout):
        calls.append((target, world, kwargs))
        return [make_rows(kwargs)] + [None] * (world - 1)
    return run_ranks


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_byzantine_cli_builds_every_configuration(monkeypatch, capsys):
    calls = []
    rows = lambda kw: [{k: c[k] for k in ("attack", "byzantine", "aggregator")} | {"accuracy": 0.5 + 0.01 * i}
                       for i, c in enumerate(kw["configs"])]
    monkeypatch.setattr(pdv_ext.spawn, "run_ranks", fake_spawner(calls, rows))
    assert main(["bench", "byzantine", "--json", "--attack", "gaussian", "--attack", "tests.x:attack",
                 "--byzantine", "2", "--aggregators", "mean,zeno,trimmed_mean"]) == 0
    out = last_json(capsys)
    target, world, kw = calls[0]
    assert target == "pdv_ext.bench.byzantine:rank_main" and world == 8 and kw["steps"] == 60
    assert out["clean_accuracy"] == 0.5 and len(out["results"]) == 2 * 3
    specs = {c["aggregator"]: c["spec"] for c in kw["configs"][1:]}
    assert specs["zeno"] == {"type": "zeno", "b": 2} and specs["trimmed_mean"] == {"type": "trimmed_mean", "b": 2}
    assert kw["configs"][1]["faults"]["byzantine_ranks"] == [1, 2]


def test_byzantine_cli_rejects_bad_arguments_before_starting_ranks(monkeypatch):
    monkeypatch.setattr(pdv_ext.spawn, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit, match="--attack"):
        main(["bench", "byzantine", "--attack", "nonsense"])
    with pytest.raises(SystemExit, match="--byzantine"):
        main(["bench", "byzantine", "--byzantine", "4"])
    with pytest.raises(SystemExit, match="--aggregators"):
        main(["bench", "byzantine", "--aggregators", "mean,nope"])


def test_convergence_cli_reports_best_lr_per_aggregator(monkeypatch, capsys):
    steps = {("mean", 0.5): 40, ("adasum", 0.5): 20, ("mean", 1.0): 18, ("adasum", 1.0): None}
    rows = lambda kw: [{"aggregator": r["aggregator"], "lr": r["lr"], "final_loss": 0.1,
                        "steps_to_target": steps[(r["aggregator"], r["lr"])]} for r in kw["runs"]]
    calls = []
    monkeypatch.setattr(pdv_ext.spawn, "run_ranks", fake_spawner(calls, rows))
    assert main(["bench", "convergence", "--json", "--lrs", "0.5,1"]) == 0
    out = last_json(capsys)
    assert out["mean_steps_to_target"] == 18 and out["mean_best_lr"] == 1.0
    assert out["adasum_steps_to_target"] == 20 and out["adasum_best_lr"] == 0.5
    assert out["target_loss"] == 0.1 and out["effective_batch"] == 8 * 64
    assert [r["aggregator"] for r in calls[0][2]["runs"]] == ["mean", "adasum", "mean", "adasum"]
