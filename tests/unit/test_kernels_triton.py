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


@pytest.fixture(scope="module")
def results():
    probe = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"triton not importable: {probe.stderr.strip().splitlines()[-1:]}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PDV_KERNELS": "triton", "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "kernels_triton_check.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(results, case):
    assert results.get(case) == "ok", results.get(case)
