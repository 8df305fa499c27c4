"""The main job through the real `deepspeed` launcher (4 CPU ranks, pipe 2 x data 2), tiny settings."""
import csv
import os
import signal
import subprocess
import sys

import pytest

from pdv_ext.spawn import default_env, free_port

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(420)
def test_train_gpt_under_deepspeed_launcher(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    out = tmp_path / "run"
    cmd = [launcher, "--num_gpus", "4", "--master_port", str(free_port()), "launch/train_gpt.py",
           "--deepspeed_config", "launch/configs/demo.json", "--out", str(out), "--steps", "3",
           "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--eval-every", "3",
           "--eval-batches", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **default_env()}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    assert "PDVPipelineEngine: stages=2 dp=2" in output
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["val_loss"]) > 0  # the held-out loss, added to the last row by the demo
    assert "held-out" in output
