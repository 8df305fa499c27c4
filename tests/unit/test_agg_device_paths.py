"""The aggregators as CUDA runs them (Triton kernels under Triton's interpreter, the sync-free device code
paths) on CPU tensors, against the CPU run: bit for bit for mean, median, trimmed_mean, zeno and gossip,
within 2 ulp for suspicion, same decisions (agg_device_check.py, in a subprocess: TRITON_INTERPRET=1 must
not leak into other tests). What it cannot show without a GPU: torch's own CUDA ops and the host syncs."""
import json
import os
import subprocess
import sys

import pytest

from tests.unit.agg_device_check import CASES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def results():
    probe = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"triton not importable: {probe.stderr.strip().splitlines()[-1:]}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("PDV_KERNELS", None)
    proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(HERE, "agg_device_check.py")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=540)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_device_run_matches_cpu(results, case):
    assert results.get(case) == "ok", results.get(case)
