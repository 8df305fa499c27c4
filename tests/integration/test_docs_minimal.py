"""The minimal program of docs/getting-started.md, extracted from the page and run as the page says, through
the real `deepspeed` launcher on 2 CPU ranks for a few steps (issue #35: a docs example that rots fails CI).
Its own folder, a free port, a hard timeout, and the launcher's whole process group killed afterwards."""
import os
import re
import sys

import pytest

from pdv_ext.spawn import default_env, free_port, run_command
from tests.unit.test_examples import ROOT, minimal_block

pytestmark = pytest.mark.integration


def run_line() -> str:
    """The page's command that runs it (a ```bash line starting with OMP_NUM_THREADS and naming minimal.py)."""
    text = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.startswith("OMP_NUM_THREADS=1") and "minimal.py" in ln]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.timeout(420)
def test_the_getting_started_minimal_program_runs_on_two_ranks(tmp_path):
    (tmp_path / "minimal.py").write_text(minimal_block("getting-started.md"), encoding="utf-8")
    words = run_line().split()
    env_words = [w for w in words if re.match(r"^[A-Z_]+=", w)]
    argv = words[len(env_words):]
    assert argv[:3] == ["deepspeed", "--num_gpus", "2"] and "minimal.py" in argv, argv
    argv = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--master_port", str(free_port())] + argv[1:]
    argv[argv.index("--steps") + 1] = "3"  # a few steps
    env = {**os.environ, **default_env(), **dict(w.split("=", 1) for w in env_words)}
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the launcher starts minimal.py from its own folder, as a user would
    try:
        rc, tail = run_command(argv, env=env, timeout=400, tail_lines=60)
    finally:
        os.chdir(cwd)
    assert rc == 0, tail
    losses = [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)$", tail, re.M)]
    assert len(losses) == 3 and all(x > 0 for x in losses), tail
    assert "aggregator adasum" in tail  # pdv_ext's start-up summary: it took over the engine
