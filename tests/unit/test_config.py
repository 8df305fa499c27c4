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
