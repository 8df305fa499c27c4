"""Plan JSON round trip, table, `pdv plan` / `pdv profile` CLI, config keys (the plot: test_plan_picture.py)."""
import json
import os

import pytest

from pdv_ext.config import validate_pdv
from pdv_ext.placement.cli import plan_main, profile_main
from pdv_ext.placement.cluster import synthetic_cluster
from pdv_ext.placement.plan import Plan
from pdv_ext.placement.profile import Profile
from pdv_ext.placement.solvers import solve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plan_json_round_trip(tmp_path):
    prof = Profile.synthetic(10, seed=2)
    plan = solve("dp", prof, synthetic_cluster(4, per_host=2), 2, 4)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    raw = json.load(open(path))
    assert raw["boundaries"] == plan.boundaries and raw["rank_mapping"] == plan.rank_mapping
    back = Plan.load(str(path))
    assert back.to_dict() == plan.to_dict()
    assert "predicted step time" in back.table()
    with pytest.raises(ValueError):
        Plan.from_dict({"boundaries": [0, 1]})


def test_profile_and_plan_cli(tmp_path, capsys):
    prof = tmp_path / "p.json"
    assert profile_main(["--model", "mlp", "--layers", "6", "--hidden", "16", "--micro-batch", "4", "--reps", "2",
                         "--out", str(prof)]) == 0
    p = Profile.load(str(prof))
    assert len(p) == 6 and all(l.fwd_bwd > 0 and l.act_bytes > 0 for l in p.layers)
    assert p.layers[1].param_bytes == (16 * 16 + 16) * 4
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    cluster = os.path.join(ROOT, "launch", "clusters", "emulated_4dev.yaml")
    capsys.readouterr()
    assert plan_main(["--cluster", cluster, "--profile", str(prof), "--stages", "2", "--micro-batches", "4",
                      "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "stage" in text and "predicted step time" in text
    assert json.load(open(out))["boundaries"][-1] == 6 and png.stat().st_size > 1000
    assert plan_main(["--cluster", cluster, "--profile", str(prof), "--stages", "3", "--out", str(out)]) == 2
    assert plan_main(["--cluster", "/nonexistent.yaml", "--profile", str(prof)]) == 2


def test_config_keys():
    ok = {"placement": {"cluster": "c.yaml", "solver": "dp", "profile": "p.json", "num_stages": 2,
                        "micro_batches": 4, "schedule": "gpipe", "input_shape": [4, 16]}}
    assert validate_pdv(ok)[1] == []
    _, errs = validate_pdv({"placement": {"cluster": "c.yaml", "solver": "dpp"}})
    assert any("pdv.placement.solver" in e and "did you mean 'dp'" in e for e in errs)
    _, errs = validate_pdv({"placement": {"cluster": "c.yaml", "plan": "x.json"}})
    assert errs


def test_read_plan_names_the_file_and_what_is_missing(tmp_path):
    """`pdv.placement.plan` is read on rank 0 and broadcast (`startup.on_rank0`); its errors name the key."""
    import json

    from pdv_ext.config_base import ConfigError
    from pdv_ext.placement.startup import read_plan

    with pytest.raises(ConfigError, match="cannot read plan"):
        read_plan(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"boundaries": [0, 2]}))
    with pytest.raises(ConfigError, match="has no 'boundaries'/'rank_mapping'"):
        read_plan(str(bad))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"boundaries": [0, 2, 4], "rank_mapping": [[0], [1]], "predicted": 1.0}))
    assert read_plan(str(good)) == {"boundaries": [0, 2, 4], "rank_mapping": [[0], [1]]}
