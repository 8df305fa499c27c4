"""The Triton kernels (pdv_ext.kernels.triton_gpu) on CPU tensors under Triton's interpreter, against the torch
reference: fp32/bf16/fp16/fp64, odd sizes, empty tensors, NaN/Inf, strided views (kernels_triton_check.py).

TRITON_INTERPRET=1 has to be set before triton is imported and would change every later import of it in
this process, so the cases run in one subprocess with the variable set; each case is reported here as a test.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.unit.kernels_triton_check import CASES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _check(*args, **env) -> dict:
    """Run kernels_triton_check.py in a fresh interpreter with `env` added (skip where triton is missing)."""
    probe = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"triton not importable: {probe.stderr.strip().splitlines()[-1:]}")
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kernels_triton_check.py"), *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def results():
    return _check(TRITON_INTERPRET="1", PDV_KERNELS="triton")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(results, case):
    assert results.get(case) == "ok", results.get(case)


@pytest.mark.timeout(600)
def test_triton_kernels_compile_for_h100():
    """Every kernel compiled for sm_90 (Triton's compiler and bundled ptxas; no GPU needed): what the
    interpreter does not check - types and ops of the compiled code."""
    probe = subprocess.run([sys.executable, "-c", "from triton.backends.compiler import GPUTarget"],
                           capture_output=True, text=True)  # (not imported here: this process stays triton-free)
    if probe.returncode:
        pytest.skip(f"triton's compiler unavailable: {probe.stderr.strip().splitlines()[-1:]}")
    res = _check("--compile")
    bad = {k: v for k, v in res.items() if v != "ok"}
    assert len(res) > 30 and not bad, bad
