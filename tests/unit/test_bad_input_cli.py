"""Bad input is one clear error naming the key or flag, raised before any rank, emulation or training starts."""
import json

import pytest
import yaml

import pdv_ext.spawn
from pdv_ext.cli import main as pdv


@pytest.fixture
def no_ranks(monkeypatch):
    """Any rank start fails the test: the bench must reject its arguments first."""
    monkeypatch.setattr(pdv_ext.spawn, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))


def rejected(argv, capsys, words):
    """`pdv ...` exits 2 with one error line (argparse's usage line aside) containing `words`."""
    with pytest.raises(SystemExit) as e:
        pdv(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("usage", " "))]
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err


# ---- 21: pdv plot ----------------------------------------------------------------------------------
def test_plot_skips_rows_longer_than_the_header(tmp_path, capsys):
    from pdv_ext.plot import read_columns

    p = tmp_path / "m.csv"
    p.write_text("step,loss\n1,2.0\n2,1.5,7\n3,1.2\n")
    assert read_columns(str(p)) == {"loss": [(1.0, 2.0), (3.0, 1.2)]}
    err = capsys.readouterr().err
    assert str(p) in err and "line 3" in err and "more fields than the header" in err


# ---- 23: pdv check-config ----------------------------------------------------------------------------
@pytest.mark.parametrize("agg, words", [("os:path", "names a module, not an Aggregator"),
                                        ("json:dumps", "calling the factory 'json:dumps' failed"),
                                        ("os:getcwd", "returned a str, not an Aggregator"),
                                        ("builtins:dict", "returned a dict, not an Aggregator")])
def test_check_config_aggregation_type_must_build_an_aggregator(agg, words):
    from pdv_ext.config import validate_pdv

    errors = validate_pdv({"aggregation": {"type": agg}})[1]
    assert len(errors) == 1 and errors[0].startswith("pdv.aggregation.type:") and words in errors[0], errors


def test_check_config_non_string_type_is_reported_once():
    from pdv_ext.config import validate_pdv

    assert validate_pdv({"aggregation": {"type": 3}})[1] == [
        "pdv.aggregation.type: must be a string naming an aggregator (got 3)"]


def test_check_config_policy_plugin_must_be_a_policy(tmp_path, capsys):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"pdv": {"policy": {"plugins": [{"name": "os:path"}, {"name": "gns_batch_size"}]}}}))
    assert pdv(["check-config", str(p)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["pdv.policy.plugins.0.name: 'os:path' names a module, not a Policy subclass or a factory "
                   "returning one"]


class ClassFactory:
    """A class whose __new__ builds an Aggregator: a factory like any other callable."""

    def __new__(cls, **options):
        from pdv_ext.aggregation.mean import Mean

        return Mean(options)


def test_a_class_that_builds_an_aggregator_is_a_factory():
    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.config import validate_pdv

    spec = {"type": f"{__name__}:ClassFactory"}
    assert validate_pdv({"aggregation": spec})[1] == []
    assert build_aggregator(spec).name == "mean"


# ---- 24: build_aggregator ------------------------------------------------------------------------------
def test_build_aggregator_rejects_what_it_cannot_build():
    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.config_base import ConfigError

    with pytest.raises(TypeError, match="expected an aggregator name"):
        build_aggregator(5)
    with pytest.raises(ConfigError, match="returned a str, not an Aggregator"):
        build_aggregator({"type": "os:getcwd"})
    with pytest.raises(ConfigError) as e:
        build_aggregator({"type": "gossip", "peers": 0, "ratoi": 0.5})
    assert [ln.split(":")[0] for ln in e.value.errors] == ["aggregation.peers", "aggregation.ratoi"]
    assert "did you mean 'ratio'" in e.value.errors[1]


# ---- 25: pdv emulate -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", [["--cpu-budget", "-3"], ["--top-share", "-1"], ["--top-share", "1000"],
                                  ["--timeout", "-5"], ["--timeout", "nan"]])
def test_emulate_numeric_flags_are_checked(flag, capsys):
    rejected(["emulate", "--cluster", "launch/clusters/emulated_4dev.yaml", "--dry-run", *flag], capsys, flag[0])


def test_emulate_rejects_clusters_beyond_the_address_plan(tmp_path, capsys, monkeypatch):
    from pdv_ext.emulate import launcher, netns

    monkeypatch.setattr(netns, "run", lambda *a, **k: pytest.fail("network created"))
    p = tmp_path / "big.yaml"
    p.write_text(yaml.safe_dump({"devices": [{"name": f"d{i}", "host": "a", "throughput": 1.0} for i in range(300)],
                                 "links": {"intra_host": {"bandwidth": "1 Gbit/s", "latency": "1us"},
                                           "inter_host": {"bandwidth": "1 Gbit/s", "latency": "1us"}}}))
    assert pdv(["emulate", "--cluster", str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "300 devices" in err[0] and "254" in err[0]
    from pdv_ext.emulate.spec import load_spec

    with pytest.raises(ValueError, match="at most 254"):
        launcher.Emulation(load_spec(str(p)), ["true"])


# ---- 26: benches ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [(["--ranks", "0"], "--ranks must be >= 2"), (["--mb", "nan"], "--mb"),
                                         (["--mb", "-1"], "--mb"), (["--reps", "0"], "--reps"),
                                         (["--warmup", "-1"], "--warmup"), (["--timeout", "0"], "--timeout"),
                                         (["--only", "adsum"], "did you mean 'adasum'")])
def test_bench_aggregate_rejects_before_ranks(args, words, no_ranks, capsys):
    rejected(["bench", "aggregate", "--no-horovod", *args], capsys, words)


@pytest.mark.parametrize("args, words", [(["--ranks", "0"], "--ranks must be >= 1"),
                                         (["--ranks", "0", "--schedule", "16,150:256"], "--ranks must be >= 1"),
                                         (["--batches", "0", "2", "4"], "--batches must be positive multiples"),
                                         (["--lr", "-1"], "--lr"), (["--target", "nan"], "--target"),
                                         (["--hidden", "30"], "multiple of --heads"),
                                         (["--only", "adaptve"], "--only: unknown run 'adaptve'")])
def test_bench_adaptive_rejects_before_ranks(args, words, no_ranks, capsys):
    rejected(["bench", "adaptive", *args], capsys, words)


@pytest.mark.parametrize("args, words", [(["--repeats", "0"], "--repeats"), (["--steps", "-1"], "--steps"),
                                         (["--micro-batches", "0"], "--micro-batches"),
                                         (["--timeout", "nan"], "--timeout"), (["--hidden", "30"], "multiple of 4")])
def test_bench_placement_rejects_before_emulating(args, words, monkeypatch, capsys):
    from pdv_ext.bench import placement
    from pdv_ext.emulate import launcher

    monkeypatch.setattr(launcher, "check_available", lambda: pytest.fail("emulation checked"))
    monkeypatch.setattr(placement, "_emulate", lambda *a, **k: pytest.fail("emulation started"))
    rejected(["bench", "placement", *args], capsys, words)


def test_bench_placement_stages_must_divide_the_cluster(monkeypatch, capsys):
    from pdv_ext.bench import placement
    from pdv_ext.emulate import launcher

    monkeypatch.setattr(launcher, "check_available", lambda: pytest.fail("emulation checked"))
    assert pdv(["bench", "placement", "--default-stages", "3"]) == 2
    assert "--default-stages 3 must divide the cluster's 4 devices" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["kernels", "--mb", "nan"], "--mb"), (["kernels", "--reps", "0"], "--reps"), (["kernels", "--m", "0"], "--m"),
    (["byzantine", "--ranks", "2"], "--ranks must be >= 3"), (["byzantine", "--steps", "0"], "--steps"),
    (["convergence", "--lrs", "0.5,x"], "--lrs"), (["convergence", "--lrs", "nan"], "--lrs"),
    (["convergence", "--max-steps", "0"], "--max-steps"),
    (["engine", "--ranks", "4", "--stages", "3"], "--stages (3) must divide --ranks (4)"),
    (["engine", "--steps", "0"], "--steps"),
    (["init-search", "--seeds", "0"], "--seeds"), (["init-search", "--candidates", "0"], "--candidates")])
def test_other_benches_reject_before_work(argv, words, no_ranks, monkeypatch, capsys):
    from pdv_ext.bench import kernels

    monkeypatch.setattr(kernels, "run", lambda *a, **k: pytest.fail("kernels timed"))
    rejected(["bench", *argv], capsys, words)
