"""Shared fixtures: a clean environment for rank processes and a check that none is left behind."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip where CUDA is absent, `multigpu` ones below two GPUs: with the reason shown (-ra)."""
    gpus = None
    for item in items:
        need = 2 if "multigpu" in item.keywords else 1 if "gpu" in item.keywords else 0
        if not need:
            continue
        gpus = _cuda_count() if gpus is None else gpus
        if gpus < need:
            why = "no CUDA device" if gpus == 0 else f"{gpus} CUDA device(s), needs {need}"
            item.add_marker(pytest.mark.skip(reason=f"GPU tier: {why} (run `make test-gpu` on a GPU machine)"))


def _children():
    try:
        import psutil
    except ImportError:
        return set()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _deepspeed_shm():
    import glob

    return set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Every test must reap the ranks it started, and leave none of DeepSpeed's CPU all-reduce workspaces
    (~69 MB each in /dev/shm, never unlinked by DeepSpeed) behind: one left is removed and named in a warning
    with the test that left it."""
    before, shm_before = _children(), _deepspeed_shm()
    yield
    left_shm = sorted(_deepspeed_shm() - shm_before)
    if left_shm:
        import warnings

        for path in left_shm:
            try:
                os.remove(path)
            except OSError:
                pass
        warnings.warn(f"{request.node.nodeid} left DeepSpeed's shared-memory workspaces {left_shm} (removed)")
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
