"""Shared fixtures: a clean environment for rank processes and a check that none is left behind."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _children():
    try:
        import psutil
    except ImportError:
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Every test must reap the ranks it started."""
    before = _children()
    yield
    if "integration" not in request.keywords:
        return
    import time

    import psutil

    deadline = time.time() + 10
    left = _children() - before
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = {pid for pid in _children() - before if psutil.pid_exists(pid)}
    assert not left, f"processes left behind: {sorted(left)}"
