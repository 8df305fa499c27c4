"""The JIT-built ops are built before a bench times its first run, with the ranks' cache and environment: a
first run that builds them alone made `pdv bench faults` read 46 s more start-up for whichever way ran first."""
import subprocess
import sys

from pdv_ext.bench import common
from pdv_ext.source_tree import jit_cache_dir
from pdv_ext.spawn import default_env


def test_the_ops_are_built_in_a_process_with_the_ranks_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = {}

    def run(cmd, env=None, **kw):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    common.ready_jit_ops()
    assert seen["cmd"][0] == sys.executable and "prebuild_jit_ops" in seen["cmd"][-1]
    ranks = default_env()
    assert seen["env"]["TORCH_EXTENSIONS_DIR"] == ranks["TORCH_EXTENSIONS_DIR"] == jit_cache_dir() == str(tmp_path)
    assert seen["env"]["DS_ACCELERATOR"] == ranks["DS_ACCELERATOR"]

