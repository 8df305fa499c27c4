"""`pdv bench adaptive --schedule`: parsed before any rank starts; bad input is one clear error."""
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
