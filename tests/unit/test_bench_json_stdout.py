"""`pdv bench NAME --json`: stdout carries the JSON line alone, whatever a bench (or DeepSpeed's logger, bound to
the sys.stdout of its first import) prints meanwhile; that goes to stderr."""
import logging
import sys
import types

from pdv_ext import cli
from pdv_ext.bench.common import emit


def _fake_bench(monkeypatch):
    mod = types.ModuleType("pdv_ext.bench.fake_noisy")

    def main(argv):
        print("Setting accelerator to CPU (a library's chatter)")
        handler = logging.StreamHandler(sys.stdout)  # as DeepSpeed's logger binds its handler on import
        lg = logging.getLogger("pdv-test-noisy")
        lg.addHandler(handler)
        try:
            lg.warning("a warning from a logger made during the run")
        finally:
            lg.removeHandler(handler)
        emit({"ratio": 0.5}, "--json" in argv)
        return 0

    mod.main = main
    monkeypatch.setitem(sys.modules, "pdv_ext.bench.fake_noisy", mod)
    monkeypatch.setattr(cli, "BENCHES", cli.BENCHES + ["fake-noisy"])


def test_json_stdout_is_the_json_line_alone(monkeypatch, capsys):
    _fake_bench(monkeypatch)
    assert cli.main(["bench", "fake-noisy", "--json"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ['{"ratio": 0.5}']
    assert "a library's chatter" in err and "a warning from a logger" in err
    assert sys.stdout is not sys.stderr  # the redirect ended with the bench


def test_without_json_the_table_and_the_chatter_stay_on_stdout(monkeypatch, capsys):
    _fake_bench(monkeypatch)
    assert cli.main(["bench", "fake-noisy"]) == 0
    out, _ = capsys.readouterr()
    assert "a library's chatter" in out and "ratio" in out
