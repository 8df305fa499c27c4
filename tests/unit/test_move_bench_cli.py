"""`pdv bench move` rejects a bad plan with one error naming the flag, before any rank starts."""
import pytest

import pdv_ext.spawn
from pdv_ext.cli import main as pdv


@pytest.mark.parametrize("args, words", [
    (["--rank-mapping", "[[0], [1], [2]]"], "--rank-mapping: must place the bench's 4 ranks"),
    (["--rank-mapping", "[[0, 1], [2, x]]"], "--boundaries / --rank-mapping: not JSON"),
    (["--boundaries", "[0, 2, 3, 6]"], "--boundaries: 5 values from 0 to 6"),
    (["--layers", "2"], "--boundaries: 5 values from 0 to 4"),
    (["--steps", "0"], "--steps"),
])
def test_bench_move_rejects_before_ranks(args, words, monkeypatch, capsys):
    monkeypatch.setattr(pdv_ext.spawn, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as e:
        pdv(["bench", "move", *args])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("usage", " "))]
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err
