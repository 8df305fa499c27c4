"""Per-replica data shares in DeepSpeed's pipeline engine (4 gloo ranks, pipe 2 x data 2): whatever the
split, a step's gradient is the mean over every sample of the global batch - checked against one process
on the whole batch - in fp32, bf16 and ZeRO-1; every stage of a replica runs its share; the data iterator
hands each replica its slice; equal shares stay DeepSpeed's own reduction, bit for bit."""
import pytest
import torch

from pdv_ext.integrations.deepspeed.internals import gradients_are_micro_batch_means
from pdv_ext.spawn import RankFailed, run_ranks

pytestmark = pytest.mark.integration

#: DeepSpeed < 0.19.3's pipeline engine sums micro-batch gradients (vanilla too): the whole-batch mean these
#: tests compare with is not what it computes, and pdv refuses unequal shares there (the last test)
needs_micro_batch_means = pytest.mark.skipif(not gradients_are_micro_batch_means(),
                                   reason="DeepSpeed < 0.19.3 sums micro-batch gradients; unequal shares refused")

RUNS = [
    {"label": "equal"},
    {"label": "config", "config_shares": [5, 1]},          # pdv.data_shares in the config
    {"label": "action", "set_shares": [(1, [1, 5])]},       # a SetDataShares at the step boundary before step 1
    {"label": "watched", "config_shares": [4, 2], "monitor": True},
]


def _close(a, b, rtol, atol):
    return all(torch.allclose(a[n], b[n], rtol=rtol, atol=atol) for n in a)


@needs_micro_batch_means
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,rtol,atol", [("fp32", 1e-5, 1e-6), ("bf16", 2e-2, 2e-2), ("zero1", 1e-5, 1e-6)])
def test_every_split_gives_the_whole_batch_gradient(mode, rtol, atol):
    res = run_ranks("tests.integration.shares_workers:train_shares", 4, dict(mode=mode, runs=RUNS, steps=2),
                    timeout=280)
    ref_losses = res[0]["reference_losses"]
    positions = {}
    for r in res:
        ref = {n: w for n, w in r["reference"].items() if n in r["runs"]["equal"]["weights"]}
        assert ref, "the reference names the engine's parameters"
        for label, run in r["runs"].items():
            # the loss DeepSpeed reports is the mean over every micro-batch of the step
            assert run["losses"] == pytest.approx(ref_losses, rel=rtol, abs=atol), (mode, label)
            assert _close(run["weights"], ref, rtol, atol), (mode, label)
            positions.setdefault(label, []).extend(run["seen"] if run["stage"] == 0 else [])
        equal, config = r["runs"]["equal"], r["runs"]["config"]
        assert equal["native"] is (mode != "fp32") and config["native"] is False, mode
        assert config["micro_batches"] == [5, 1][config["dp_id"]]
        assert r["runs"]["action"]["shares"] == [None, [1, 5]]
        if r["runs"]["watched"]["metrics"] is not None:
            m = r["runs"]["watched"]["metrics"]
            assert m["batch_size"] == 24 and m["data_shares"] == [4, 2] and m["micro_batches"] == 3
    # the first stage of each replica read its slice: together every position of the 2 global batches, once
    for label, seen in positions.items():
        assert sorted(seen) == list(range(2 * 6 * 4)), label


@needs_micro_batch_means
@pytest.mark.timeout(300)
def test_checkpoint_with_unequal_shares_resumes_exactly(tmp_path):
    res = run_ranks("tests.integration.shares_workers:resume_with_shares", 4, dict(ckpt_dir=str(tmp_path / "ck")),
                    timeout=280)
    for r in res:
        full, resumed = r["full"], r["resumed"]
        assert full["shares"] == {1: [5, 1], 2: [5, 1], 3: [2, 4], 4: [2, 4], 5: [2, 4]}
        assert sorted(resumed["losses"]) == [4, 5]
        assert resumed["shares"] == {4: [2, 4], 5: [2, 4]}  # restored over the config's equal split
        for step, loss in resumed["losses"].items():
            assert loss == full["losses"][step]  # bit for bit
        assert resumed["position"] == full["position"]
        assert all(torch.equal(resumed["weights"][n], w) for n, w in full["weights"].items())
        if r["full"]["stage"] == 0:  # the resumed replica reads what the full run read after the checkpoint
            cut = len(full["seen"]) - len(resumed["seen"])
            assert resumed["seen"] == full["seen"][cut:]


@needs_micro_batch_means
@pytest.mark.timeout(300)
def test_a_policys_replan_moves_the_running_pipeline():
    """The Replan action end to end: decided by a plugin, agreed by the runner, applied inside train_batch by
    pdv_ext.integrations.deepspeed.move, twice (the second move to other boundaries on another rank order); the user's
    engine object trains on - its step counter, the policies' metrics and DeepSpeed's p2p grid follow it -
    within rounding of the run that did not move."""
    res = run_ranks("tests.integration.shares_workers:replan_by_action", 4, {}, timeout=280)
    for rank, r in enumerate(res):
        moved, still = r["moved"], r["still"]
        assert moved["same_object"] and moved["stages"] == 4 and moved["parts"] == [0, 1, 3, 6, 8]
        assert moved["stage_id"] == [1, 0, 3, 2].index(rank) == moved["p2p_stage"]
        assert moved["glue_on_engine"] and moved["applier_on_engine"]
        assert moved["global_steps"] == still["global_steps"] == 7
        assert moved["metric_steps"] == still["metric_steps"] == list(range(1, 8))
        assert still["stages"] == 2 and still["last_move"] is None
        assert moved["last_move"]["seconds"] > 0 and moved["last_move"]["bytes_moved"] > 0
        assert moved["last_move"]["old_plan"]["boundaries"] == [0, 2, 4, 6, 8]
        assert [(s, a["action"]) for s, a in moved["log"]] == [(2, "Replan"), (4, "Replan")]
        assert moved["losses"][:2] == still["losses"][:2]
        assert moved["losses"] == pytest.approx(still["losses"], rel=1e-5)


def _cluster_and_profile(tmp_path):
    """4 equal devices; 8 layers of one nn.Linear each, whose forward the worker makes sleep 3 ms."""
    import yaml

    from pdv_ext.placement.profile import LayerProfile, Profile

    Profile([LayerProfile(f"l{i}", 0.003, 1e3, 256.0) for i in range(8)]).save(str(tmp_path / "p.json"))
    cl = {"devices": [{"name": f"d{i}", "host": "a", "throughput": 1.0} for i in range(4)],
          "links": {"intra_host": {"bandwidth": "10 Gbit/s", "latency": "50us"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cl))
    return str(tmp_path / "c.yaml"), str(tmp_path / "p.json")


@pytest.mark.timeout(300)
@needs_micro_batch_means
def test_policies_as_one_system_on_a_real_engine(tmp_path):
    """Shares + moves (depth 2 -> 4 -> 2, then a move at the same width with shares in force), every change
    announced identically on every rank with what is in force; a layer-keyed checkpoint loaded under another
    plan with the shares kept, announced as a `checkpoint` change; the built-in `replan` on a real engine with
    a slowed rank: it moves the pipeline once the slowdown is seen, its plan follows on every rank, no churn."""
    from tests.integration.shares_workers import PLAN_4, PLAN_A, PLAN_B

    cluster, profile = _cluster_and_profile(tmp_path)
    res = run_ranks("tests.integration.shares_workers:adaptive_system", 4,
                    dict(ckpt_dir=str(tmp_path / "ck"), cluster=cluster, profile=profile), timeout=280)
    # 1. scripted shares and moves: the same announcements on every rank, each with what was in force after it
    scripted = [r["scripted"] for r in res]
    assert all(s["seen"] == scripted[0]["seen"] for s in scripted)
    by = "tests.integration.shares_workers:Script"
    assert scripted[0]["seen"] == [("shares", 2, by, (3, 1), PLAN_A), ("replan", 3, by, None, PLAN_4),
                                   ("replan", 5, by, None, PLAN_B), ("shares", 6, by, (1, 3), PLAN_B),
                                   ("replan", 7, by, (1, 3), PLAN_A)]
    for s in scripted:
        assert s["shares"] == [None, [3, 1], None, None, None, [1, 3], [1, 3], [1, 3]]  # in force after each step
        assert s["where"] == PLAN_A and all(x == x for x in s["losses"])  # noqa: PLR0124 (no NaN)
        assert s["log"] == [(2, "SetDataShares"), (3, "Replan"), (5, "Replan"), (6, "SetDataShares"), (7, "Replan")]
    # 2. the checkpoint under PLAN_A with shares [1, 3], loaded under PLAN_B: shares kept, the resume announced
    for r in res:
        resumed = r["resumed"]
        assert resumed["where"] == PLAN_B and resumed["shares"] == [1, 3] and resumed["steps"] == 10
        assert resumed["seen"] == [("checkpoint", 8, "", (1, 3), PLAN_B)]
    # 3. the built-in replan on a real engine: nothing while calm, then it acts on the slowdown, once or twice
    runs = [r["replan"] for r in res]
    assert all(r["errors"] == [] and r["changes"] == runs[0]["changes"] for r in runs)
    changes = runs[0]["changes"]
    assert changes and changes[0][0] == "replan", changes
    assert all(source == "replan" and 7 < step <= 12 for _, step, source in changes), changes
    assert len(changes) <= 2  # no churn: at most a correction after the first move, then nothing
    assert runs[0]["where"] != PLAN_A and all(r["where"] == runs[0]["where"] for r in runs)
    # its plan is the one in force on every rank (ranks other than 0 learn it only from the announcement)
    assert all(r["plan"] == r["where"] for r in runs)
    assert [d["kind"] for d in runs[0]["decisions"]][0] == "replan"


@pytest.mark.skipif(gradients_are_micro_batch_means(), reason="DeepSpeed >= 0.19.3 carries unequal shares")
@pytest.mark.timeout(300)
def test_unequal_shares_are_refused_where_deepspeed_sums_micro_batch_gradients():
    with pytest.raises(RankFailed, match=r"unequal shares \[5, 1\] need DeepSpeed >= 0.19.3"):
        run_ranks("tests.integration.shares_workers:train_shares", 4,
                  dict(mode="fp32", runs=[{"label": "config", "config_shares": [5, 1]}], steps=1), timeout=280)


@needs_micro_batch_means
@pytest.mark.timeout(300)
def test_goodput_changes_the_batch_and_the_shares_follow_in_proportion():
    """#36: the `goodput` policy on a real engine with unequal shares in force: its batch changes are agreed on
    every rank, each logged with the measured samples/s and the efficiency, the split keeps its proportions
    through them (3:1 of 4 micro-batches is 6:2 of 8), and no sample is lost or read twice."""
    res = run_ranks("tests.integration.shares_workers:goodput_with_shares", 4, {}, timeout=280)
    log = res[0]["log"]
    assert all(r["log"] == log and r["batches"] == res[0]["batches"] and r["shares"] == res[0]["shares"] for r in res)
    changes = [(step, a) for step, a in log if a["action"] == "SetBatchSize"]
    assert changes, f"goodput took no decision in 12 steps: {log}"
    assert all(a["source"] == "goodput" and "samples/s" in a["reason"] and "efficiency" in a["reason"]
               for _, a in changes)
    batches, shares = res[0]["batches"], res[0]["shares"]
    for step, _ in changes:
        if step + 1 in batches:
            mb = batches[step + 1] // 8  # micro-batches per replica (4 samples each, 2 replicas)
            assert shares[step + 1] == [3 * mb // 2, mb // 2], (step, batches, shares)
    seen = sorted(p for r in res if r["stage"] == 0 for p in r["seen"])
    assert seen == list(range(sum(batches.values()))) == list(range(res[0]["position"]))
