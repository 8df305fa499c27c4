"""Bad input to placement (pdv plan / predict / profile / probe, profile JSON, cluster YAML): one clear error
naming the offending key or flag, raised before the work starts."""
import json
import os
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from pdv_ext.config_base import ConfigError
from pdv_ext.placement import predictor as P
from pdv_ext.placement import probe
from pdv_ext.placement.cli import plan_main, predict_main, profile_main
from pdv_ext.placement.cluster import Cluster, synthetic_cluster
from pdv_ext.placement.config import PlacementConfig
from pdv_ext.placement.cost import aggregator_pattern
from pdv_ext.placement.profile import Profile
from pdv_ext.placement.solvers import SOLVERS, divisors_widths, solve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "launch", "clusters", "homogeneous.yaml")  # 8 devices


def _pdv(*args):
    """(exit code, stderr) of the real `pdv` command."""
    r = subprocess.run([sys.executable, "-m", "pdv_ext.cli", *args], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    return r.returncode, r.stderr


def _call(main, argv, capsys):
    """(exit code, stderr) of a CLI entry point called in-process (argparse errors raise SystemExit)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def prof_path(tmp_path):
    path = tmp_path / "p.json"
    Profile.synthetic(6).save(str(path))
    return str(path)


# -- pdv plan -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mb", ["-3", "0"])
def test_plan_micro_batches_must_be_positive(prof_path, mb):
    code, err = _pdv("plan", "--cluster", CLUSTER, "--profile", prof_path, "--micro-batches", mb)
    assert code == 2 and "--micro-batches must be >= 1" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="micro-batches must be an integer >= 1"):
        solve("dp", Profile.synthetic(6), synthetic_cluster(8, per_host=4), 2, int(mb))


def test_unknown_aggregator_is_an_error(prof_path, capsys):
    code, err = _call(plan_main, ["--cluster", CLUSTER, "--profile", prof_path, "--aggregator", "meen"], capsys)
    assert code == 2 and "unknown aggregator 'meen' (did you mean 'mean'?)" in err and "adasum" in err
    with pytest.raises(ValidationError, match="unknown aggregator 'nope'"):
        PlacementConfig(cluster="c.yaml", aggregator="nope")
    assert aggregator_pattern("adasum") == "halving_doubling"


def test_registered_aggregator_without_a_pattern_is_costed_as_a_ring():
    from pdv_ext.aggregation import AGGREGATORS

    AGGREGATORS.register("my_test_agg", type("MyAgg", (), {}))
    try:
        assert aggregator_pattern("my_test_agg") == "ring"
        assert PlacementConfig(cluster="c.yaml", aggregator="my_test_agg").aggregator == "my_test_agg"
    finally:
        AGGREGATORS.unregister("my_test_agg")


@pytest.mark.parametrize("solver", ["dp", "differentiable", "deepspeed_uniform", "deepspeed_parameters"])
@pytest.mark.parametrize("stages,msg", [(0, "stages must be an integer >= 1"), (-2, ">= 1"),
                                        (8, "8 stages but only 6 layers"), (3, "do not divide 8 devices")])
def test_stage_count_is_checked_for_every_solver(solver, stages, msg):
    with pytest.raises(ValueError, match=msg):
        solve(solver, Profile.synthetic(6), synthetic_cluster(8, per_host=4), stages, 4)


def test_zero_stages_says_at_least_one():
    with pytest.raises(ValueError, match=">= 1") as exc:
        divisors_widths(8, 6, 0)
    assert "divide" not in str(exc.value)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        PlacementConfig(cluster="c.yaml", num_stages=0)


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_plan_output_directory_checked_before_solving(prof_path, flag, capsys, monkeypatch):
    import pdv_ext.placement.solvers as S

    monkeypatch.setattr(S, "solve", lambda *a, **k: pytest.fail("solved before checking the output path"))
    code, err = _call(plan_main, ["--cluster", CLUSTER, "--profile", prof_path, flag, "/nonexistent/d/x.json"],
                      capsys)
    assert code == 2 and f"{flag} /nonexistent/d/x.json: directory /nonexistent/d does not exist" in err


def test_module_function_solver_with_wrong_signature_or_return(prof_path):
    code, err = _pdv("plan", "--cluster", CLUSTER, "--profile", prof_path, "--solver", "json:dumps")
    assert code == 2 and "solver 'json:dumps' cannot be called as solver(profile, cluster" in err
    assert "Traceback" not in err
    SOLVERS.register("returns_none_for_test", lambda profile, cluster, num_stages, micro_batches, **kw: None)
    try:
        with pytest.raises(ValueError, match="solver 'returns_none_for_test' returned NoneType, not a Plan"):
            solve("returns_none_for_test", Profile.synthetic(6), synthetic_cluster(8, per_host=4), 2, 4)
    finally:
        SOLVERS.unregister("returns_none_for_test")


# -- profile JSON ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit,line", [
    (lambda d: d.update(meta=5), "meta: Input should be a valid dictionary"),
    (lambda d: d.update(engine=5), "engine: Input should be a valid dictionary"),
    (lambda d: d["layers"][3].update(fwd_bwd=-1.0), "layers.3.fwd_bwd: Input should be greater than or equal to 0"),
    (lambda d: d["layers"][2].update(param_bytes=-5), "layers.2.param_bytes: Input should be greater than or equal"),
    (lambda d: d.update(micro_batch=0), "micro_batch: Input should be greater than or equal to 1"),
    (lambda d: d["layers"][1].update(saved_bytes=None), "layers.1.saved_bytes: Input should be a valid number"),
    (lambda d: d["layers"][3].update(fwd_bwd="abc"), "layers.3.fwd_bwd: Input should be a valid number"),
    (lambda d: d["layers"][0].update(act_bytes=float("inf")), "layers.0.act_bytes: Input should be a finite number"),
    (lambda d: d.update(engine={"micro_batch": -1.0}), "engine.micro_batch: Input should be greater than or equal"),
])
def test_profile_errors_name_the_file_and_key(tmp_path, edit, line):
    d = Profile.synthetic(6).to_dict()
    edit(d)
    path = str(tmp_path / "bad.json")
    json.dump(d, open(path, "w"))
    with pytest.raises(ConfigError) as exc:
        Profile.load(path)
    assert len(exc.value.errors) == 1 and exc.value.errors[0].startswith(f"{path}.{line}")


def test_profile_not_a_mapping_or_unreadable(tmp_path, prof_path):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a layer profile"):
        Profile.load(str(path))
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match="x.json: cannot read profile JSON"):
        Profile.load(str(path))
    code, err = _pdv("plan", "--cluster", CLUSTER, "--profile", str(path))
    assert code == 2 and "x.json: cannot read profile JSON" in err and "Traceback" not in err


def test_valid_profiles_keep_loading(tmp_path):
    prof = Profile.synthetic(5)
    prof.engine = {"micro_batch": 1e-3, "step": 2e-3, "slope": 0.1, "times": {"1": 0.5}, "layers": 5}
    prof.meta = {"model": "gpt"}
    path = str(tmp_path / "p.json")
    prof.save(path)
    back = Profile.load(path)
    assert back.to_dict() == prof.to_dict() and back.engine_step == 2e-3


# -- cluster YAML ---------------------------------------------------------------------------------------
def test_large_host_group_loads_fast(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("hosts: [{name: a, devices: 20000}]\n")
    t0 = time.perf_counter()
    assert len(Cluster.load(str(path))) == 20000
    assert time.perf_counter() - t0 < 5.0  # the quadratic duplicate check took ~10 s


def test_cluster_numbers_must_be_finite(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("devices: [{name: a, host: h, throughput: .inf, memory: 1e400}]\n"
                    "links: {inter_host: {bandwidth: 1e400, latency: .inf}}\nreference_throughput: .inf\n")
    with pytest.raises(ConfigError) as exc:
        Cluster.load(str(path))
    errs = exc.value.errors
    assert all(e.startswith(f"{path}.") and "finite" in e for e in errs) and len(errs) == 5


def test_non_utf8_cluster_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe devices: []")
    with pytest.raises(ConfigError) as exc:
        Cluster.load(str(path))
    errs = exc.value.errors
    assert len(errs) == 1 and errs[0].startswith(f"{path}: cannot read cluster YAML: ") and "utf-8" in errs[0]


# -- pdv predict ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["{}", "[]", '{"meshes": []}', "PROFILE", '{"meshes": [{"mesh_shape": 4}]}'])
def test_predict_fit_rejects_what_is_not_a_database(tmp_path, prof_path, content, capsys):
    db = tmp_path / "db.json"
    db.write_text(open(prof_path).read() if content == "PROFILE" else content)
    code, err = _call(predict_main, ["fit", "--db", str(db), "-o", str(tmp_path / "m.json")], capsys)
    assert code == 2 and f"cannot read database '{db}'" in err and "expected a profiling database" in err


def test_predict_fit_bad_cluster_prints_its_lines(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: [{name: a, host: h, throughput: -1}]\n")
    code, err = _call(predict_main, ["fit", "--cluster", str(bad), "-o", str(tmp_path / "m.json")], capsys)
    assert code == 2 and err.strip() == f"{bad}.devices.0.throughput: Input should be greater than 0 (got -1)"


@pytest.mark.parametrize("content", [None, '{"curves": {', "[1]", "PROFILE", "{}"])
def test_predict_eval_rejects_what_is_not_a_model(tmp_path, prof_path, content, capsys):
    model = tmp_path / "m.json"
    if content is not None:
        model.write_text(open(prof_path).read() if content == "PROFILE" else content)
    code, err = _call(predict_main, ["eval", "--model", str(model)], capsys)
    assert code == 2 and err.startswith(f"pdv predict eval: cannot read model '{model}': ")
    assert len(err.strip().splitlines()) == 1


def test_hold_out_names_must_exist_and_leave_something(capsys, tmp_path):
    db = P.load_db()
    with pytest.raises(ValueError, match="unknown held-out mesh '9x9'.*the database has 2x8"):
        P.split_meshes(db, ["9x9"])
    with pytest.raises(ValueError, match="nothing left to fit on"):
        P.split_meshes(db, [P.mesh_name(m) for m in db["meshes"]])
    code, err = _call(predict_main, ["fit", "--hold-out", "9x9", "-o", str(tmp_path / "m.json")], capsys)
    assert code == 2 and "unknown held-out mesh '9x9'" in err


def test_predict_fit_output_directory_checked_before_fitting(capsys, monkeypatch):
    monkeypatch.setattr(P.Predictor, "fit", classmethod(lambda *a, **k: pytest.fail("fitted first")))
    code, err = _call(predict_main, ["fit", "-o", "/nonexistent/m.json"], capsys)
    assert code == 2 and "--out /nonexistent/m.json: directory /nonexistent does not exist" in err


# -- pdv profile / pdv probe ----------------------------------------------------------------------------
@pytest.mark.parametrize("args,msg", [
    (["--reps", "0"], "--reps must be >= 1"), (["--heads", "0"], "--heads must be >= 1"),
    (["--hidden", "9", "--heads", "2"], "--hidden 9 must be a multiple of --heads 2"),
    (["--layers", "-3"], "--layers must be >= 1"), (["--micro-batch", "0"], "--micro-batch must be >= 1"),
    (["--seq-len", "0"], "--seq-len must be >= 1"),
])
def test_profile_flags_are_checked(tmp_path, args, msg, capsys):
    out = tmp_path / "p.json"
    code, err = _call(profile_main, ["--out", str(out), *args], capsys)
    assert code == 2 and msg in err and not out.exists()


def test_profile_output_directory_checked_before_profiling(capsys):
    code, err = _call(profile_main, ["--out", "/nonexistent/x.json"], capsys)
    assert code == 2 and "--out /nonexistent/x.json: directory /nonexistent does not exist" in err


@pytest.mark.parametrize("args,msg", [(["--matmul-size", "0"], "--matmul-size must be >= 1"),
                                      (["--backend", "bogus"], "--backend bogus: not available"),
                                      (["--reps", "0"], "--reps must be >= 1"),
                                      (["--rounds", "0"], "--rounds must be >= 1"),
                                      (["--sizes"], "--sizes: give at least one message size")])
def test_probe_flags_are_checked_before_the_process_group(tmp_path, args, msg, capsys, monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("process group started"))
    code, err = _call(probe.main, ["--out", str(tmp_path / "c.yaml"), *args], capsys)
    assert code == 2 and msg in err
