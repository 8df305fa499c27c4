"""The placement benchmark's rank-side script under `pdv emulate` (root): the profile it writes (sustained
workload speeds, message CPU over the emulated link, forward times) and the training timeline it traces,
which the schedule replay reads."""
import json
import secrets
import subprocess
import sys

import pytest

from .test_emulate_cluster import EMULATE_MARKS, _leftovers

pytestmark = EMULATE_MARKS

CLUSTER = """
devices:
  - {name: fast0, host: a, throughput: 1.0}
  - {name: fast1, host: a, throughput: 1.0}
links:
  intra_host: {bandwidth: 800 Mbit/s, latency: 50us}
  inter_host: {bandwidth: 100 Mbit/s, latency: 1ms}
"""
MODEL = ["--layers", "1", "--hidden", "16", "--heads", "4", "--seq-len", "8", "--micro-batch", "2"]


def _emulate(cluster, run, *cmd, timeout=150):
    return subprocess.run([sys.executable, "-m", "pdv_ext.cli", "emulate", "--cluster", str(cluster), "--run-name", run,
                           "--timeout", str(timeout - 20), "--", sys.executable, "-m", "pdv_ext.emulate.train_step_timer",
                           *cmd], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(200)
def test_profile_measures_workload_messages_and_forward(tmp_path):
    from pdv_ext.placement.profile import Profile

    cluster, out = tmp_path / "c.yaml", tmp_path / "p.json"
    cluster.write_text(CLUSTER)
    run = f"pdv-{secrets.token_hex(3)}"
    p = _emulate(cluster, run, "profile", "--cluster", str(cluster), "--out", str(out), "--workload-speeds",
                 "--message-cpu", "--message-round-trips", "10", "--workload-reps", "2", "--reps", "2", *MODEL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not _leftovers(run)
    prof = Profile.load(str(out))
    meta = prof.meta
    assert len(meta["workload_seconds"]) == 2 and len(meta["workload_cpu_seconds"]) == 2
    assert all(c > 0 for c in meta["workload_cpu_seconds"])
    # the message the layers' boundaries send (the embedding's output: 2 x 8 x 16 floats), CPU per round trip
    assert list(meta["message_cpu_seconds"]) == [str(2 * 8 * 16 * 4)]
    assert meta["p2p_source"] == "message_cpu"
    sending = [l for l in prof.layers if l.act_bytes == 2 * 8 * 16 * 4]
    assert sending and all(l.p2p > 0 for l in sending)
    assert all(0 < l.fwd < l.fwd_bwd for l in prof.layers)


@pytest.mark.timeout(200)
def test_train_traces_every_ranks_instructions(tmp_path):
    cluster, out = tmp_path / "c.yaml", tmp_path / "t.json"
    cluster.write_text(CLUSTER)
    run = f"pdv-{secrets.token_hex(3)}"
    p = _emulate(cluster, run, "train", "--out", str(out), "--stages", "2", "--steps", "2", "--warmup", "1",
                 "--micro-batches", "2", "--trace", *MODEL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not _leftovers(run)
    res = json.loads(out.read_text())
    assert "breakdown_ms" not in res  # --trace alone
    trace = res["trace"]
    assert len(trace) == 2
    for rank, t in enumerate(trace):
        assert len(t["step_starts"]) == 2
        names = [e[0] for e in t["events"]]
        # two timed steps of two micro-batches each
        assert names.count("ForwardPass") == 4 and names.count("BackwardPass") == 4
        assert names.count("SendActivation" if rank == 0 else "RecvActivation") == 4
        assert all(e[1] <= e[2] for e in t["events"])
