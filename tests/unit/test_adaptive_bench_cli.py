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


def test_rounds_report_medians_and_never_a_median_of_a_run_that_missed():
    """`--repeats`: each fixed batch's seconds the median of its rounds (None when a round did not reach the
    target), the adaptive run's figures from its median round, every round's seconds beside them."""
    from pdv_ext.bench.adaptive import combine_rounds

    def fixed(b, s, r):
        return {"batch": b, "seconds_to_target": s, "steps_to_target": 10, "samples_to_target": 10 * b, "round": r}

    def ada(s, r):
        return {"round": r, "adaptive_seconds_to_target": s, "adaptive_decisions": [f"round {r}"]}

    res = {"fixed": [fixed(16, 40.0, 0), fixed(256, 30.0, 0), fixed(16, 44.0, 1), fixed(256, None, 1),
                     fixed(16, 42.0, 2), fixed(256, 28.0, 2)],
           "adaptive_rounds": [ada(31.0, 0), ada(29.0, 1), ada(35.0, 2)], "schedules": []}
    out = combine_rounds(res)
    by = {f["batch"]: f for f in out["fixed"]}
    assert by[16]["seconds_to_target"] == 42.0 and by[16]["seconds_rounds"] == [40.0, 44.0, 42.0]
    assert by[256]["seconds_to_target"] is None and "round" not in by[16]
    assert out["adaptive_seconds_to_target"] == 31.0 and out["adaptive_decisions"] == ["round 0"]
    assert out["adaptive_seconds_rounds"] == [31.0, 29.0, 35.0] and "adaptive_rounds" not in out
    one = combine_rounds({"fixed": [fixed(16, 40.0, 0)], "adaptive_rounds": [ada(None, 0)], "schedules": []})
    assert one["fixed"][0]["seconds_to_target"] == 40.0 and one["adaptive_seconds_to_target"] is None
