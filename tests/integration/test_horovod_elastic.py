"""Elastic Horovod: kill one worker of a running localhost job; the job finishes on the survivor with
the expected number of samples, and the aggregator and policy state follow the committed state."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.integration.horovod_workers import ROOT, gloo_timeout_args, horovodrun_bin, kill_tree

pytestmark = pytest.mark.integration


@pytest.mark.timeout(480)
@pytest.mark.parametrize("aggregation,commit_every", [("adasum", 1), ("gossip", 2)])
def test_kill_one_worker(aggregation, commit_every):
    """adasum, a commit every step; gossip, a stateful aggregator (its top-k error feedback), a commit every
    other step, so the survivor has trained a step past its last commit when the loss comes: its aggregator
    state after the reset is the commit's, not lost and not the uncommitted step's."""
    import pickle

    with tempfile.TemporaryDirectory(prefix="pdv-elastic-") as tmp:
        # two "hosts" that are both this machine: the failing one is blacklisted, the other keeps going
        discover = os.path.join(tmp, "discover.sh")
        with open(discover, "w") as f:
            f.write("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
        os.chmod(discover, 0o755)
        target = 96
        cmd = [horovodrun_bin(), "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", discover,
               "--network-interface", "lo", *gloo_timeout_args(300),
               sys.executable, "-m", "tests.integration.horovod_workers", "elastic_train", tmp,
               f'{{"target": {target}, "aggregation": "{aggregation}", "commit_every": {commit_every}}}']
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HOROVOD_ELASTIC_TIMEOUT": "60",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(os.path.join(tmp, "log.txt"), "w+b")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 450
            pid_file = os.path.join(tmp, "kill.pid")
            while not os.path.exists(pid_file) or not open(pid_file).read().strip():
                assert proc.poll() is None, "job ended before the kill:\n" + _tail(log)
                assert time.monotonic() < deadline, "no worker reached the kill step:\n" + _tail(log)
                time.sleep(0.2)
            os.kill(int(open(pid_file).read()), signal.SIGKILL)
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(proc)
        assert rc == 0, f"elastic job failed (rc={rc}):\n" + _tail(log)
        results = [pickle.load(open(os.path.join(tmp, n), "rb")) for n in sorted(os.listdir(tmp))
                   if n.startswith("result")]
        log.close()
    assert len(results) == 1, "exactly one survivor reports"
    res = results[0]
    assert res["size"] == 1 and res["samples"] == target
    # 3 (or, a commit every other step, 2) committed steps on 2 ranks (8 samples each), then 1 rank
    kept = 3 // commit_every * commit_every
    assert res["sizes"][:kept] == [2] * kept and set(res["sizes"][kept:]) == {1}
    assert res["position"] == target, "the data stream lost or repeated samples"
    steps = len(res["sizes"])
    assert res["hook_step"] == steps and res["agg_step"] == steps, "state not rolled back to the commit"
    assert res["monitor_samples"] == target
    assert res["log"] == [(1, {"action": "SetLearningRate", "lr": None, "scale": 0.5, "source": "schedule"})]
    assert res["lr"] == pytest.approx(0.025)
    assert res["agg"] == aggregation
    # the survivor's state went back to its last commit before the loss
    last = kept // commit_every - 1
    assert len(res["restored"]) == 1 and res["restored"][0] == res["committed"][last], (res["restored"],
                                                                                         res["committed"][:4])
    assert res["stepped"][kept - 1] != res["stepped"][kept]  # (the state does change from step to step)
    if aggregation == "gossip":
        assert res["stepped"][kept] != res["committed"][last]  # it had trained past the commit: restored
        assert res["restored_residual_norm"][0] > 0  # error feedback kept across the loss, not reset to zero


def _tail(log, n=60):
    log.flush()
    log.seek(0)
    return "\n".join(log.read().decode(errors="replace").splitlines()[-n:])
