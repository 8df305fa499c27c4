"""Policy layer inside PDVPipelineEngine on 4 ranks (pipe 2 x data 2): agreement, data position, resume."""
import os

import pytest

from pdv_ext.spawn import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy")
    # PDV_HOST_GROUPS=1: the metrics, actions and flags travel on gloo twins of the world and of the
    # data-parallel groups, as they do under NCCL (the other engine tests cover the plain gloo groups)
    out = run_ranks("tests.integration.policy_workers:train_and_resume", 4,
                    {"ckpt_dir": str(tmp / "ckpt"), "out_dir": str(tmp / "run")}, timeout=380,
                    env={"PDV_HOST_GROUPS": "1"})
    return {"ranks": out, "dir": tmp}


def test_action_log_identical_on_all_ranks(runs):
    assert all(r["full"]["host_groups"] == [True, True] for r in runs["ranks"])
    logs = [r["full"]["action_log"] for r in runs["ranks"]]
    assert len(logs[0]) == 3 and all(log == logs[0] for log in logs)
    assert [step for step, _ in logs[0]] == [2, 4, 6]
    geoms = [r["full"]["geometry"] for r in runs["ranks"]]
    assert all(g == geoms[0] for g in geoms)
    assert geoms[0][3] == (4, 3, 24) and geoms[0][5] == (2, 3, 12) and geoms[0][7] == (3, 2, 12)


def test_lr_follows_the_rules(runs):
    lrs = runs["ranks"][0]["full"]["lrs"]
    assert lrs[1] == pytest.approx(1e-2)
    assert lrs[3] == pytest.approx(1e-2 * 24 / 16)  # linear
    assert lrs[5] == pytest.approx(1e-2 * 24 / 16 * (12 / 24) ** 0.5)  # sqrt
    assert lrs[8] == lrs[5]  # none


def test_broken_plugin_reported_and_disabled_everywhere(runs):
    for r in runs["ranks"]:
        errs = r["full"]["errors"]
        assert len(errs) == 1 and errs[0]["step"] == 3 and "Boom" in errs[0]["policy"] and "boom" in errs[0]["error"]
        assert 1 in r["full"]["disabled"]


def test_no_sample_lost_or_repeated(runs):
    ranks = [r["full"] for r in runs["ranks"]]
    # both stages of a replica read the same positions (inputs on stage 0, labels on stage 1)
    by_replica = {}
    for r in ranks:
        by_replica.setdefault(r["dp_rank"], []).append(r["seen"])
    for seen in by_replica.values():
        assert seen[0] == seen[1]
    positions = sorted(p for seen in by_replica.values() for p in seen[0])
    total = ranks[0]["position"]
    assert total == 16 * 2 + 24 * 2 + 12 * 4  # the sum of the global batches actually trained
    assert positions == list(range(total))  # every stream position once
    ids = ranks[0]["ids"]
    assert sorted(ids[:100]) == list(range(100))  # epoch 0: every sample exactly once
    assert len(set(ids[100:])) == len(ids[100:])  # epoch 1 started without repeats


def test_resume_after_batch_change_is_bit_identical(runs):
    for r in runs["ranks"]:
        full, resumed = r["full"], r["resumed"]
        assert sorted(resumed["losses"]) == [6, 7, 8]
        for step, loss in resumed["losses"].items():
            assert loss == full["losses"][step]  # exact, not approx
        assert resumed["geometry"] == {s: full["geometry"][s] for s in (6, 7, 8)}
        assert resumed["lrs"][6] == full["lrs"][6]
        assert [a for a in resumed["action_log"]] == [tuple(a) for a in full["action_log"]]
    ckpt = runs["dir"] / "ckpt"
    tag = open(ckpt / "latest").read().strip()
    assert len([f for f in os.listdir(ckpt / tag) if f.startswith("pdv_state_rank")]) == 4


def test_monitor_writes_metrics(runs):
    rows = runs["ranks"][0]["full"]["rows"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["loss"] is not None and r["step_time"] > 0 for r in rows)
    assert all(r["local_sq"] > 0 and r["agg_sq"] > 0 for r in rows)
    assert runs["ranks"][1]["full"]["rows"] == []  # only rank 0 records
    m = runs["ranks"][2]["full"]["metrics"]
    assert len(m["compute_times"]) == 4 and m["batch_size"] == 12
    text = (runs["dir"] / "run" / "metrics.csv").read_text().splitlines()
    assert text[0].startswith("step,time,samples,batch_size") and len(text) == 9
