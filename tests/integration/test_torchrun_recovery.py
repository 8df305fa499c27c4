"""Under torchrun, a worker that dies mid-run costs no step: the agent restarts the workers and pdv's start-up
resumes them from the in-memory snapshots (issue #37, items 1 and 2 on one machine). The losses after the
restart equal those of the same job run without the crash, bit for bit (fp32)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from pdv_ext.spawn import free_port, kill_matching, remove_deepspeed_shm

pytestmark = [pytest.mark.integration]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _torchrun(tmp, name, *extra, env_extra=None, restarts=1):
    out, shm = tmp / name, tmp / f"{name}-shm"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4", f"--max-restarts={restarts}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.5",
           os.path.join(HERE, "torchrun_job.py"), "--out", str(out), "--shm", str(shm), *extra]
    # a fresh rendezvous store for every restart (docs/recovery.md: torchrun's shared store keeps the last
    # attempt's process-group addresses, and the restarted workers connect to ports that are gone)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env_extra or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
                          start_new_session=True)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(ln for ln in lines if ln.startswith("[rank0]") or "rror" in ln)[-6000:]
    logs = {}
    for r in range(4):
        with open(out / f"h-rank{r}.jsonl", encoding="utf-8") as f:
            logs[r] = [json.loads(line) for line in f]
    for port in {e["master"][1] for lines in logs.values() for e in lines if "master" in e}:
        remove_deepspeed_shm(port)  # every attempt's workers are gone
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


@pytest.mark.timeout(600)
def test_lost_host_under_elastic_agents(tmp_path):
    """A host lost for good under torchrun's elastic agent (issue #37, items 1-3 on one machine): two agents,
    `hostA` and `hostB` (PDV_HOST), two workers each, `--nnodes 1:2`; at step 4 host B's agent and workers are
    killed and its snapshots wiped. Agent A restarts its workers in a world of two, they resume from A's
    memory at step 4 (pipe 2 x data 1: stage 1's files are the copy B had sent to A) and finish; every loss
    after the loss of B equals the calm 4-worker run's (to rounding: the plan changed)."""
    import time

    ref = _torchrun(tmp_path, "calm", "--steps", "12")
    out, shm = tmp_path / "lost", tmp_path / "lost-shm"
    out.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lost-host", "--monitor-interval=0.5",
            "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2",
            os.path.join(HERE, "torchrun_job.py"), "--out", str(out), "--shm", str(shm), "--steps", "12",
            "--sleep", "0.3"]
    agents = {}
    try:
        for host in ("hostA", "hostB"):  # A first: its agent hosts the rendezvous store
            agents[host] = subprocess.Popen(args + ["--host-tag", host], cwd=ROOT, env={**env, "PDV_HOST": host},
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                            start_new_session=True)
            time.sleep(2)
        deadline = time.time() + 240
        while time.time() < deadline:
            done = [json.loads(ln).get("step") for f in out.glob("hostB-*.jsonl") for ln in f.read_text().splitlines()]
            if 4 in done:
                break
            time.sleep(0.05)
        else:
            pytest.fail("host B never reached step 4")
        kill_matching("--host-tag hostB")  # the host is gone: its agent, its workers, its memory
        shutil.rmtree(shm / "torchrun-test" / "hostB", ignore_errors=True)
        _, err = agents["hostA"].communicate(timeout=300)
        assert agents["hostA"].returncode == 0, err[-4000:]
    finally:
        kill_matching(str(out))
        for p in agents.values():
            p.wait(timeout=30)
    logs = {}
    for f in out.glob("hostA-*.jsonl"):
        logs[f.name] = [json.loads(ln) for ln in f.read_text().splitlines()]
    calm = {e["step"]: e["loss"] for e in ref[0] if "step" in e}
    for name, lines in logs.items():
        starts = [(e["attempt"], e["start"], e["world"]) for e in lines if "start" in e]
        # resumed in a world of 2 at step 4, or 3 where host B died with step 4's snapshot still in flight
        assert starts[0] == (0, 0, 4) and starts[-1][2] == 2 and starts[-1][1] in (3, 4), (name, starts)
        after = {e["step"]: e["loss"] for e in lines if "step" in e and e["attempt"] == starts[-1][0]}
        assert sorted(after) == list(range(starts[-1][1] + 1, 13)), after
        # pipe 2 x data 1 sums the gradients in another order than 2 x 2: equal to rounding (bit for bit against
        # a run that switches plans at the same step: test_snapshots.py)
        assert all(after[s] == pytest.approx(calm[s], rel=1e-5) for s in after), (after, calm)
    for port_ in {e["master"][1] for lines in logs.values() for e in lines if "master" in e}:
        remove_deepspeed_shm(port_)


@pytest.mark.timeout(400)
def test_bench_faults_quick():
    """`pdv bench faults --quick`: the three ways run, the recovered one completes with at most one step lost
    and the held-out loss of the run that switched plans without a failure (to rounding); bad input is one
    line before anything runs."""
    p = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "bench", "faults", "--quick", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=380, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["completed"] and res["steps_lost"] <= 1 and res["recovered"]["world_after"] == 2, res
    assert 0 < res["recovery_s"] < 60 and res["held_out_vs_reference"] < 1e-4, res
    assert res["disk_restart"]["completed"] and res["disk_restart"]["resumed_at"] == 3, res  # checkpoint every 3
    bad = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "bench", "faults", "--steps", "10", "--lose-at", "10"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--lose-at 10: must fall inside the run" in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def calm_losses(tmp_path_factory):
    """The 6 steps of the 4-worker job without a failure: every rank's losses by step."""
    ref = _torchrun(tmp_path_factory.mktemp("calm"), "calm")
    return {r: {e["step"]: e["loss"] for e in ref[r] if "step" in e} for r in range(4)}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase, resumed", [("serialize", 2), ("write", 2), ("seal", 2), ("prune", 3)])
def test_a_rank_killed_during_a_snapshot(tmp_path, calm_losses, phase, resumed):
    """Rank 0 dies abruptly (injected: PDV_SNAPSHOT_FAULT) at each phase of its snapshot of step 3: before
    anything is written, with one file written, with every file written but not sealed, after every rank
    sealed. The restart resumes from the newest step that is whole - 2 before the seal, 3 after it - never
    from half a step, and every loss after it equals the run without a failure."""
    logs = _torchrun(tmp_path, phase, env_extra={"PDV_SNAPSHOT_FAULT": f"{phase}@3:0"})
    for r in range(4):
        starts = [(e["attempt"], e["start"]) for e in logs[r] if "start" in e]
        assert starts == [(0, 0), (1, resumed)], (r, starts)
        after = {e["step"]: e["loss"] for e in logs[r] if e.get("attempt") == 1 and "step" in e}
        assert sorted(after) == list(range(resumed + 1, 7)) and all(after[s] == calm_losses[r][s] for s in after)


@pytest.mark.timeout(400)
def test_a_second_failure_during_the_recovery(tmp_path, calm_losses):
    """A worker crashes after step 3 (its snapshot written), and in the restart rank 0 dies in the middle of
    the resume: the next restart resumes from step 3 again and finishes with the calm run's losses."""
    logs = _torchrun(tmp_path, "twice", "--crash-at", "3", env_extra={"PDV_SNAPSHOT_FAULT": "resume@3:0"},
                     restarts=2)
    for r in range(4):
        starts = [(e["attempt"], e["start"]) for e in logs[r] if "start" in e]
        assert starts[0] == (0, 0) and starts[-1] == (2, 3), (r, starts)
        after = {e["step"]: e["loss"] for e in logs[r] if e.get("attempt") == 2 and "step" in e}
        assert sorted(after) == [4, 5, 6] and all(after[s] == calm_losses[r][s] for s in after)
