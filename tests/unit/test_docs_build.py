"""The documentation site builds with `mkdocs build --strict` (what `make docs` and CI run)."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")
def test_docs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=580)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "WARNING" in line or "ERROR" in line or "Error" in line]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(problems or proc.stderr.splitlines()[-30:])
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "index.html").stat().st_size > 10_000  # mkdocstrings rendered the API
