"""Smoke runs of `pdv bench byzantine` and `pdv bench convergence` (--quick, 4 ranks): the JSON contract."""
import json

import pytest

from pdv_ext.cli import main

pytestmark = pytest.mark.integration


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_bench_byzantine_quick(capsys):
    assert main(["bench", "byzantine", "--quick", "--json", "--ranks", "4", "--steps", "15", "--attack", "scaled",
                 "--aggregators", "mean,zeno"]) == 0
    out = last_json(capsys)
    assert 0.1 < out["clean_accuracy"] <= 1.0
    rows = {r["aggregator"]: r for r in out["results"]}
    assert set(rows) == {"mean", "zeno"} and all(r["attack"] == "scaled" and r["byzantine"] == 1 for r in rows.values())
    assert rows["zeno"]["accuracy"] > rows["mean"]["accuracy"]


def test_bench_byzantine_rejects_bad_arguments():
    with pytest.raises(SystemExit, match="--attack"):
        main(["bench", "byzantine", "--attack", "nonsense"])
    with pytest.raises(SystemExit, match="--byzantine"):
        main(["bench", "byzantine", "--byzantine", "4"])


@pytest.mark.timeout(240)
def test_bench_convergence_quick(capsys):
    assert main(["bench", "convergence", "--quick", "--json", "--ranks", "4", "--lrs", "1"]) == 0
    out = last_json(capsys)
    assert {"mean_steps_to_target", "adasum_steps_to_target", "target_loss"} <= set(out)
    assert [r["aggregator"] for r in out["grid"]] == ["mean", "adasum"]
    assert out["mean_steps_to_target"] is not None  # the quick target is easy
