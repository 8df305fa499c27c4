"""Under torchrun, a worker that dies mid-run costs no step: the agent restarts the workers and pdv's start-up
resumes them from the in-memory snapshots (issue #37, items 1 and 2 on one machine). The losses after the
restart equal those of the same job run without the crash, bit for bit (fp32)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from pdv_ext.spawn import remove_deepspeed_shm

pytestmark = [pytest.mark.integration]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp, name, *extra):
    out, shm = tmp / name, tmp / f"{name}-shm"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--monitor-interval=0.5",
           os.path.join(HERE, "torchrun_job.py"), "--out", str(out), "--shm", str(shm), *extra]
    # a fresh rendezvous store for every restart (docs/recovery.md: torchrun's shared store keeps the last
    # attempt's process-group addresses, and the restarted workers connect to ports that are gone)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                          start_new_session=True)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(ln for ln in lines if ln.startswith("[rank0]") or "rror" in ln)[-6000:]
    logs = {}
    for r in range(4):
        with open(out / f"rank{r}.jsonl", encoding="utf-8") as f:
            logs[r] = [json.loads(line) for line in f]
    for addr, port in {tuple(e["master"]) for lines in logs.values() for e in lines if "master" in e}:
        remove_deepspeed_shm(port, addr)  # every attempt's workers are gone
    return logs


@pytest.mark.timeout(600)
def test_crashed_worker_resumes_from_snapshots(tmp_path):
    ref = _torchrun(tmp_path, "calm")
    crashed = _torchrun(tmp_path, "crash", "--crash-at", "3")
    for r in range(4):
        starts = [e for e in crashed[r] if "start" in e]
        assert [(e["attempt"], e["start"]) for e in starts] == [(0, 0), (1, 3)], starts  # resumed at step 3
        after = {e["step"]: e["loss"] for e in crashed[r] if e.get("attempt") == 1 and "step" in e}
        calm = {e["step"]: e["loss"] for e in ref[r] if "step" in e}
        assert sorted(after) == [4, 5, 6]
        assert all(after[s] == calm[s] for s in after), (after, calm)  # no step lost, the same losses
    assert not os.listdir(tmp_path / "crash-shm"), "the finished job left its snapshots in host memory"
