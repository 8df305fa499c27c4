"""The "pdv" section: defaults, did-you-mean errors that name the key path, check-config's contract."""
import json
import subprocess
import sys

import pytest

from pdv_ext.config import ConfigError, PDVConfig, check_file, load_pdv, split_config, validate_pdv


def test_defaults_and_roundtrip():
    cfg = load_pdv({"train_batch_size": 8})
    assert isinstance(cfg, PDVConfig)
    assert cfg.aggregation.type == "mean"
    ds, cfg = split_config({"train_batch_size": 8, "pdv": {"aggregation": {"type": "mean", "prescale": True}}})
    assert ds == {"train_batch_size": 8}
    assert cfg.aggregation.options == {"prescale": True}


@pytest.mark.parametrize("section, expected", [
    ({"aggregation": {"type": "no-such-op"}}, "pdv.aggregation.type: unknown aggregator 'no-such-op'"),
    ({"aggregaton": {}}, "pdv.aggregaton: unknown key (did you mean 'aggregation'?)"),
    ({"aggregation": {"type": "mean", "prescal": True}}, "pdv.aggregation.prescal: unknown key (did you mean 'prescale'?)"),
    ({"placement": {"boundries": [0, 2]}}, "pdv.placement.boundries: unknown key (did you mean 'boundaries'?)"),
    ({"placement": {"boundaries": [0, 4, 4]}}, "pdv.placement.boundaries: must be strictly increasing"),
    ({"placement": {"rank_mapping": [[0, 1], [2]]}}, "pdv.placement.rank_mapping: every stage must have the same"),
    ({"placement": {"rank_mapping": [[0, 1], [1, 2]]}}, "pdv.placement.rank_mapping: must use each rank"),
    ({"aggregation": {"type": "mean", "prescale": "maybe"}}, "pdv.aggregation.prescale:"),
])
def test_errors_name_the_key(section, expected):
    cfg, errors = validate_pdv(section)
    assert cfg is None
    assert len(errors) == 1, errors
    assert errors[0].startswith(expected), errors[0]


def test_unknown_aggregator_lists_known_names():
    _, errors = validate_pdv({"aggregation": {"type": "no-such-op"}})
    assert "known:" in errors[0] and "mean" in errors[0]


def test_all_errors_at_once_and_config_error():
    with pytest.raises(ConfigError) as exc:
        split_config({"pdv": {"aggregaton": {}, "placement": {"boundries": []}}})
    assert len(exc.value.errors) == 2


def test_placement_sections_must_agree():
    _, errors = validate_pdv({"placement": {"boundaries": [0, 2, 4], "rank_mapping": [[0], [1], [2]]}})
    assert errors and "3" in errors[0]


def _check(tmp_path, data):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return subprocess.run([sys.executable, "-m", "pdv_ext.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_check_config_cli_bad(tmp_path):
    proc = _check(tmp_path, {"train_batch_size": 8, "pdv": {"aggregation": {"type": "no-such-op"}}})
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdv.aggregation.type:") and "mean" in lines[0]
    assert "Traceback" not in proc.stderr


def test_check_config_cli_ok_and_unreadable(tmp_path):
    proc = _check(tmp_path, {"train_batch_size": 8, "pdv": {"aggregation": {"type": "mean"}}})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok"
    assert check_file(str(tmp_path / "missing.json"))[0].endswith("cannot read (No such file or directory)")
    (tmp_path / "broken.json").write_text("{not json")
    assert "not valid JSON" in check_file(str(tmp_path / "broken.json"))[0]


def test_initialize_rejects_bad_config_before_any_process_group():
    import torch.distributed as dist

    import pdv_ext

    with pytest.raises(ConfigError) as exc:
        pdv_ext.initialize(model=object(), config={"train_batch_size": 8, "pdv": {"aggregation": {"type": "nope"}}})
    assert "pdv.aggregation.type" in str(exc.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("data, expected", [
    # DeepSpeed ignores unknown top-level keys: these would silently drop the pdv settings
    ({"train_batch_size": 8, "pvd": {"aggregation": {"type": "adasum"}}},
     "pvd: unknown top-level key (did you mean 'pdv'?)"),
    ({"train_batch_size": 8, "aggregation": {"type": "adasum"}}, "train_batch_size: not a pdv section"),
    ({"aggregation": {"type": "adasum"}, "polcy": {}}, "polcy: not a pdv section (did you mean 'policy'?)"),
    ({"train_batch_size": 8, "pdv": {}, "policy": {}}, "policy: a pdv section outside \"pdv\" is not read"),
])
def test_top_level_mistakes_are_errors(tmp_path, data, expected):
    with pytest.raises(ConfigError) as exc:
        split_config(data)
    assert len(exc.value.errors) == 1 and exc.value.errors[0].startswith(expected), exc.value.errors
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    assert check_file(str(path)) == exc.value.errors


def test_bare_section_and_deepspeed_keys_still_accepted():
    assert split_config({"aggregation": {"type": "adasum"}})[1].aggregation.type == "adasum"
    ds, cfg = split_config({"train_batch_size": 8, "fp16": {"enabled": False}, "pipeline": {}})
    assert ds == {"train_batch_size": 8, "fp16": {"enabled": False}, "pipeline": {}} and cfg.aggregation.type == "mean"


def test_planning_options_need_a_cluster():
    _, errors = validate_pdv({"placement": {"profile": "p.json", "solver": "dp"}})
    assert len(errors) == 1 and errors[0].startswith("pdv.placement: profile, solver only apply when planning")
    assert validate_pdv({"placement": {"cluster": "c.yaml", "solver": "dp", "micro_batches": 4}})[1] == []


def test_module_attr_plugins_resolve_from_the_working_directory(tmp_path, monkeypatch):
    from pdv_ext.registry import RegistryError, load_object

    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "plug.py").write_text("class Mine:\n    pass\n")
    cwd_free = [p for p in sys.path if p not in ("", str(tmp_path))]
    monkeypatch.setattr(sys, "path", cwd_free)
    monkeypatch.chdir(tmp_path)
    assert load_object("userpkg.plug:Mine").__name__ == "Mine"
    with pytest.raises(RegistryError, match="cannot import module 'nosuchpkg.x'"):
        load_object("nosuchpkg.x:Y")


def test_pdv_bench_help_lists_the_benchmarks(capsys):
    from pdv_ext.cli import BENCHES, main

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES)
    assert main(["bench"]) == 2 and "aggregate" in capsys.readouterr().err
