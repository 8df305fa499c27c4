"""`pdv bench adaptive --schedule`: parsed before any rank starts; bad input is one clear error."""
import re

import pytest

from pdv_ext.bench.adaptive import main, parse_schedule


def test_parse_schedule():
    assert parse_schedule("16", 2) == [(0, 16)]
    assert parse_schedule("16,150:256", 2) == [(0, 16), (150, 256)]
    assert parse_schedule("16,100:64,300:256", 2) == [(0, 16), (100, 64), (300, 256)]


@pytest.mark.parametrize("text, words", [("16,150", "expected B0,STEP:B1"), ("x", "expected"),
                                         ("15,10:32", "multiple of --ranks (2)"), ("16,10:0", "positive"),
                                         ("16,100:32,50:64", "steps must increase")])
def test_bad_schedule_is_one_error(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_schedule(text, 2)


def test_cli_rejects_before_starting_ranks(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--schedule", "16,150"])
    assert e.value.code == 2
    assert "--schedule '16,150'" in capsys.readouterr().err


def test_policy_options_parse_as_yaml():
    from pdv_ext.bench.adaptive import parse_policy_options

    assert parse_policy_options("goodput", ["plateau_steps=20", "plateau_z=1.5"]) == {"plateau_steps": 20,
                                                                                      "plateau_z": 1.5}
    assert parse_policy_options("gns_batch_size", []) == {}


@pytest.mark.parametrize("item, words", [("plateau_steps", "expected KEY=VALUE"),
                                         ("plateau_stepz=3", "goodput.plateau_stepz: unknown key"),
                                         ("plateau_steps=1", "goodput.plateau_steps: .*greater than or equal to 2"),
                                         ("max_batch_size=8", "max_batch_size: set by the bench")])
def test_bad_policy_option_is_one_error_before_any_rank(item, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--policy", "goodput", "--policy-option", item])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1
    assert re.search(words, err), err
