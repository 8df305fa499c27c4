"""`pdv_ext.exit_on_config_error`: a ConfigError ends a run with its lines once (rank 0), status 2 on every
rank, no traceback; any other error propagates unchanged."""
import pytest

import pdv_ext
from pdv_ext.config import ConfigError


@pdv_ext.exit_on_config_error
def bad_main():
    raise ConfigError(["pdv.aggregation.type: unknown aggregator 'adasun'", "pdv.policy.every: must be >= 1"])


@pytest.mark.parametrize("env, printed", [({"RANK": "0"}, True), ({"RANK": "3"}, False),
                                          ({"OMPI_COMM_WORLD_RANK": "1"}, False), ({}, True)])
def test_rank_0_prints_the_lines_and_every_rank_exits_2(monkeypatch, capsys, env, printed):
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "HOROVOD_RANK"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exc:
        bad_main()
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == (["pdv_ext: invalid configuration (fix it and run again; `pdv check-config FILE` checks a file):",
                    "  pdv.aggregation.type: unknown aggregator 'adasun'", "  pdv.policy.every: must be >= 1"]
                   if printed else [])


def test_other_errors_propagate_and_results_pass_through():
    @pdv_ext.exit_on_config_error
    def broken():
        raise RuntimeError("not a config problem")

    with pytest.raises(RuntimeError, match="not a config problem"):
        broken()
    assert pdv_ext.exit_on_config_error(lambda x: x + 1)(1) == 2


# -- without the decorator (issue #35 item 3): an uncaught ConfigError from pdv_ext's entry points ends the
# process the same way; a caller can still catch it --------------------------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from pdv_ext import user_errors  # noqa: E402

HEADER = "pdv_ext: invalid configuration (fix it and run again; `pdv check-config FILE` checks a file):"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code, **env):
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                               "PMIX_RANK", "HOROVOD_RANK")}
    clean.update(env, PYTHONPATH=ROOT + os.pathsep + clean.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=clean,
                          timeout=240)


BAD = '{"train_micro_batch_size_per_gpu": 1, "pdv": {"aggregation": {"type": "adasun"}}}'


@pytest.mark.timeout(300)
def test_initialize_with_a_bad_pdv_section_prints_its_lines_once_and_exits_2_without_the_decorator():
    out = _run(f"""
        import pdv_ext
        pdv_ext.initialize(config={BAD})
        """)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.count(HEADER) == 1, out.stderr
    tail = out.stderr.splitlines()[-2:]
    assert tail[0] == HEADER and tail[1].startswith("  pdv.aggregation.type: unknown aggregator 'adasun'"), out.stderr


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_load_pdv_uncaught_only_rank_0_prints_every_rank_exits_2(rank, printed):
    out = _run("""
        import pdv_ext
        pdv_ext.load_pdv({"policy": {"every": 0}})
        """, RANK=rank)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (HEADER in out.stderr) is printed and out.stdout == ""
    assert ("pdv.policy.every" in out.stderr) is printed


def test_a_caller_can_still_catch_the_config_error(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the hook installed below stays in this test
    with pytest.raises(ConfigError) as exc:
        pdv_ext.load_pdv({"aggregation": {"type": "adasun"}})
    assert any("adasun" in line for line in exc.value.errors)
    assert sys.excepthook is user_errors._exit_hook  # installed, acts only on one nothing catches


def test_the_hook_passes_other_errors_and_interactive_sessions_on(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(user_errors, "_previous_hook", lambda *a: seen.append(a[1]))
    err = RuntimeError("not a config problem")
    user_errors._exit_hook(RuntimeError, err, None)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # a REPL: the traceback, and the session goes on
    cfg = ConfigError(["pdv.x: bad"])
    user_errors._exit_hook(ConfigError, cfg, None)
    assert seen == [err, cfg] and capsys.readouterr().err == ""
