"""Aggregators over real ranks: plain torch.distributed (gloo) and DeepSpeed's pipeline engine."""
import pytest
import torch

from pdv_ext.spawn import run_ranks

from .agg_workers import rank_grads

pytestmark = pytest.mark.integration

SPECS = [{"type": "mean"}, {"type": "median"}, {"type": "trimmed_mean", "b": 1}, {"type": "suspicion", "k": 1},
         {"type": "zeno", "b": 1}, {"type": "gossip", "peers": 2, "ratio": 0.3}]


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


@pytest.mark.timeout(240)
def test_aggregators_and_bench_ranks_over_torch_distributed():
    m, bad = 4, 1
    res = run_ranks("tests.integration.agg_workers:gloo_suite", m, {"specs": SPECS}, timeout=230)
    for s in range(3):
        honest = torch.stack([flat(rank_grads(r, s)) for r in range(m) if r != bad])
        attack = -10 * torch.stack([flat(rank_grads(r, s)) for r in range(m)]).mean(0)
        stack = torch.cat([honest, attack[None]])
        # replicas of every robust aggregator agree; the attacker is filtered out
        for name in ("median", "trimmed_mean", "suspicion", "zeno"):
            outs = [r[name]["outs"][s] for r in res]
            assert all(torch.equal(o, outs[0]) for o in outs), name
            assert (outs[0] - honest.mean(0)).norm() < 0.25 * honest.mean(0).norm(), name
        mid = stack.sort(0).values
        assert torch.allclose(res[0]["median"]["outs"][s], (mid[1] + mid[2]) / 2, atol=1e-6)
        assert torch.allclose(res[0]["trimmed_mean"]["outs"][s], stack.sort(0).values[1:-1].mean(0), atol=1e-5)
        assert res[0]["zeno"]["reports"][s]["dropped"] == [bad]
        assert res[0]["suspicion"]["reports"][s]["dropped"] == [bad]
        # the plain mean is dragged the wrong way
        assert torch.dot(res[0]["mean"]["outs"][s], honest.mean(0)) < 0
    # gossip over real p2p: nothing lost (applied + not-yet-shared = everything sent in)
    sent = sum(flat(rank_grads(r, s)) for r in range(m) for s in range(3)) - sum(
        flat(rank_grads(r, s)) for r in [bad] for s in range(3))
    sent = sent + sum(-10 * torch.stack([flat(rank_grads(r, s)) for r in range(m)]).mean(0) for s in range(3))
    total = sum(sum(r["gossip"]["outs"]) + r["gossip"]["residual"] for r in res)
    assert torch.allclose(total, sent, atol=1e-3)
    assert res[0]["gossip"]["reports"][2]["consensus_distance"] > 0
    for r in res:
        assert "rank(s) 3" in r["nan_error"] and "step 11" in r["nan_error"]
    # Comm.all_gather_into (what the robust aggregators gather with): world and an odd sub-group
    assert [r["rows"] for r in res] == [{"world": True}] + [{"world": True, "sub": True}] * 3
    # a gloo twin of each group carries the CPU payloads (what the engine builds on NCCL)
    for r in res:
        h = r["host"]
        assert h["used"] == ["twin"] and h["payload_device"] == "cpu", h
        assert h["scalars"] == [2.0, float(2 * (h["rank"] % 2) + 2)], h
        assert h["zeno"] and h["gossip"] and h["adasum"], h
        assert "must be the group's" in h["refused"], h
    assert [o["rank"] for o in res[0]["host"]["objects"]] == [0, 2] and res[0]["host"]["broadcast"] == "hello"
    # the benchmarks' rank functions: rank 0 returns the rows
    clean = res[0]["byzantine"][0]
    assert res[1]["byzantine"] is None
    assert clean["attack"] == "none" and 0.3 < clean["accuracy"] <= 1.0  # the clean run comes first
    attacked = [row for row in res[0]["byzantine"][1:]]
    assert [r["aggregator"] for r in attacked] == ["mean", "zeno"]
    assert attacked[1]["accuracy"] > attacked[0]["accuracy"]  # zeno survives what breaks the mean
    conv = res[0]["convergence"]
    assert [r["aggregator"] for r in conv] == ["mean", "adasum"]
    assert conv[0]["steps_to_target"] is not None and conv[0]["final_loss"] <= 0.6


@pytest.mark.timeout(300)
def test_zeno_and_faults_in_the_pipeline_engine():
    # PDV_HOST_GROUPS=1: the engine builds the gloo twins it builds on NCCL, and the flags travel on them
    res = run_ranks("tests.integration.agg_workers:pipeline_zeno", 4, {"steps": 4, "refresh_every": 2}, timeout=290,
                    env={"PDV_HOST_GROUPS": "1"})
    for r in res:
        assert r["host_group"]
        assert r["dropped"] == [[1]] * 4, r  # data-parallel rank 1 of each stage is the Byzantine replica
        assert r["validation_calls"] == 2  # steps 0 and 2
        assert r["error"] is not None and "rank(s) 1" in r["error"] and "step 4" in r["error"]
    by_stage = {}
    for r in res:
        by_stage.setdefault(r["stage"], []).append(r["weights"])
    for ws in by_stage.values():  # replicas of a stage stay identical, the attacker's included
        assert torch.equal(ws[0], ws[1])
    assert all(torch.isfinite(r["weights"]).all() for r in res)
    last = [r for r in res if r["stage"] == 1][0]["losses"]
    assert last[-1] < last[0]


@pytest.mark.timeout(180)
def test_the_width_4_section_runs_on_a_group_of_2():
    """The sections above (made for 4 ranks) over 2 real gloo ranks: options the pair cannot support are clamped
    with one warning on group rank 0 (trimmed_mean b 1 -> 0, suspicion k 1 -> 0, gossip peers 2 -> 1), zeno
    keeps the better of two, and the robust replicas agree."""
    res = run_ranks("tests.integration.agg_workers:small_groups", 2, {"specs": SPECS}, timeout=170)
    assert sorted(w.split(" (")[0] for w in sum((v["warnings"] for v in res[0].values()), [])) == [
        "pdv.aggregation.b=1 clamped to 0 for a data-parallel group of 2",
        "pdv.aggregation.k=1 clamped to 0 for a data-parallel group of 2",
        "pdv.aggregation.peers=2 clamped to 1 for a data-parallel group of 2"]
    assert all(not v["warnings"] for v in res[1].values())
    for s in range(2):
        pair = (flat(rank_grads(0, s)) + flat(rank_grads(1, s))) / 2
        for name in ("mean", "median", "trimmed_mean", "suspicion"):
            assert torch.equal(res[0][name]["outs"][s], res[1][name]["outs"][s]), name
            assert torch.allclose(res[0][name]["outs"][s], pair, atol=1e-6), name
        z = res[0]["zeno"]["outs"][s]
        assert torch.equal(z, res[1]["zeno"]["outs"][s])
        assert any(torch.equal(z, flat(rank_grads(r, s))) for r in range(2))
