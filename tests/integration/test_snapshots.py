"""In-memory snapshots (issue #37): a pipe 2 x data 2 job over two hosts loses one host; the survivors resume
under pipe 2 x data 1 from what is left in host memory, and train exactly as a restart from a disk checkpoint
of the same step under the same new plan does (bit for bit, in fp32, bf16 and ZeRO-1)."""
import os
import shutil

import pytest

from pdv_ext.spawn import run_ranks

pytestmark = [pytest.mark.integration]

PIPE2x2 = {"boundaries": [0, 4, 8], "rank_mapping": [[0, 1], [2, 3]]}
PIPE2 = {"boundaries": [0, 4, 8], "rank_mapping": [[0], [1]]}


def _run(fn, ranks, **kw):
    return run_ranks(f"tests.integration.snapshot_workers:{fn}", ranks, kw, timeout=240)


def _same(a, b):
    import torch

    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode,layout", [("fp32", "stage_per_host"), ("fp32", "replica_per_host"),
                                         ("bf16", "stage_per_host"), ("zero1", "replica_per_host")])
def test_lost_host_resumes_on_survivors(tmp_path, mode, layout):
    """stage_per_host: each stage's two replicas on one host (hostA: stage 0, hostB: stage 1), so stage 1's
    layers survive only through the copy sent to hostA; replica_per_host: each host runs one replica of each
    stage. Host B's memory is then wiped (its copies gone with it) and the two survivors on host A resume.
    bf16 (BF16_Optimizer's partitioned fp32 masters) and ZeRO-1 (partitioned optimizer state) come back whole
    and re-cut for the new width."""
    root, ckpt = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    hosts = ["hostA", "hostA", "hostB", "hostB"] if layout == "stage_per_host" else ["hostA", "hostB", "hostA", "hostB"]
    before = _run("before_loss", 4, mode=mode, plan=PIPE2x2, hosts=hosts, root=root, job="j", ckpt=ckpt, k=3)
    assert all(r["step"] == 3 for r in before)
    kept = sorted(os.listdir(os.path.join(root, "j", "hostA")))
    assert kept == ["step00000002", "step00000003"], kept  # keep: 2
    shutil.rmtree(os.path.join(root, "j", "hostB"))  # host B is lost, and its memory with it
    after = _run("after_loss", 2, mode=mode, plan=PIPE2, hosts=["hostA", "hostA"], root=root, job="j", ckpt=ckpt,
                 n=3)
    for r in after:
        assert r.get("error") is None, r.get("error")
        assert r["resumed_step"] == 3
        _same(r["resumed_state"], r["reference_state"])
        assert r["resumed"] == r["reference"], (r["resumed"], r["reference"])  # bit for bit


@pytest.mark.timeout(420)
def test_both_copies_lost_names_the_layers(tmp_path):
    """Stage 1's layers lived on host B and, as a copy, on host A: with both gone, one error names the lost
    files and points to the disk checkpoint; nothing is loaded."""
    root, ckpt = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    hosts = ["hostA", "hostA", "hostB", "hostB"]
    _run("before_loss", 4, mode="fp32", plan=PIPE2x2, hosts=hosts, root=root, job="j", ckpt=ckpt, k=2)
    shutil.rmtree(os.path.join(root, "j", "hostB"))
    for step in os.listdir(os.path.join(root, "j", "hostA")):  # host A's copy of layer 5 gone too
        os.remove(os.path.join(root, "j", "hostA", step, "pdv_layers", "layer_05.pt"))
    after = _run("after_loss", 2, mode="fp32", plan=PIPE2, hosts=["hostA", "hostA"], root=root, job="j", ckpt=ckpt,
                 n=1)
    for r in after:
        assert "layer_05.pt" in r["error"] and "disk checkpoint" in r["error"], r


@pytest.mark.timeout(420)
def test_survivors_plan_for_the_devices_left(tmp_path):
    """With `pdv.placement.cluster`, the two survivors plan at start-up for the devices they run on (the
    cluster lists four on two hosts; the job has two ranks, both on host A) and resume under that plan."""
    import yaml

    from pdv_ext.placement.profile import Profile

    root, ckpt = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    cluster = {"devices": [{"name": f"{h}{i}", "host": f"host{h.upper()}", "throughput": 1.0}
                           for h in "ab" for i in range(2)],
               "links": {"intra_host": {"bandwidth": "10GB/s", "latency": "5us"},
                         "inter_host": {"bandwidth": "1GB/s", "latency": "50us"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    Profile.synthetic(8, heavy_every=3).save(str(tmp_path / "p.json"))
    placement = {"cluster": str(tmp_path / "c.yaml"), "profile": str(tmp_path / "p.json"), "num_stages": 2}
    _run("before_loss", 4, mode="fp32", plan=PIPE2x2, hosts=["hostA", "hostA", "hostB", "hostB"], root=root,
         job="j", ckpt=ckpt, k=2)
    shutil.rmtree(os.path.join(root, "j", "hostB"))
    after = _run("after_loss", 2, mode="fp32", plan=PIPE2, hosts=["hostA", "hostA"], root=root, job="j", ckpt=ckpt,
                 n=2, placement=placement)
    for r in after:
        assert r.get("error") is None, r.get("error")
        assert sorted(x for st in r["plan"]["rank_mapping"] for x in st) == [0, 1] and r["resumed_step"] == 2
        _same(r["resumed_state"], r["reference_state"])
        assert r["resumed"] == r["reference"]


@pytest.mark.timeout(420)
def test_a_host_that_comes_back_is_used_again(tmp_path):
    """Scale-up: two ranks on host A trained with snapshots (pipe 2 x data 1); host B joins again and the
    job restarts on four ranks (pipe 2 x data 2). B's ranks have no snapshot of their own and fetch their
    stage's files from A; the new replicas start from replica 0's state, as a disk checkpoint loaded under the
    wider plan gives them (bit for bit)."""
    root, ckpt = str(tmp_path / "shm"), str(tmp_path / "ckpt")
    _run("before_loss", 2, mode="fp32", plan=PIPE2, hosts=["hostA", "hostA"], root=root, job="j", ckpt=ckpt, k=2)
    assert not os.path.exists(os.path.join(root, "j", "hostB"))
    after = _run("after_loss", 4, mode="fp32", plan=PIPE2x2, hosts=["hostA", "hostA", "hostB", "hostB"], root=root,
                 job="j", ckpt=ckpt, n=2)
    for r in after:
        assert r.get("error") is None, r.get("error")
        assert r["resumed_step"] == 2
        _same(r["resumed_state"], r["reference_state"])
        assert r["resumed"] == r["reference"]
    # B is used again: the two steps after the resume have their copies there too
    assert sorted(os.listdir(os.path.join(root, "j", "hostB"))) == ["step00000003", "step00000004"]


@pytest.mark.timeout(420)
def test_auto_interval_is_agreed(tmp_path):
    """`every: auto`: the ranks agree on when the next snapshot is due (the slowest snapshot over the slowest
    step), so they all take the same snapshots; the first at step 1, each next one where the last agreed."""
    root = str(tmp_path / "shm")
    out = _run("auto_every", 4, plan=PIPE2x2, hosts=["hostA", "hostA", "hostB", "hostB"], root=root, job="j", k=8)
    dues = [r["due"] for r in out]
    assert all(d == dues[0] for d in dues), dues
    due = dues[0]
    assert due[0] == 2  # step 1's snapshot, then the next one step later (nothing timed yet)
    taken = [1] + [s + 1 for s in range(1, 8) if due[s] != due[s - 1]]  # the steps a snapshot was taken at
    assert all(b > a for a, b in zip(taken, taken[1:])) and taken[-1] <= 8
    newest = [max(r["complete"]) for r in out]
    assert newest == [taken[-1]] * 4, (newest, taken)  # each host holds the newest snapshot taken
