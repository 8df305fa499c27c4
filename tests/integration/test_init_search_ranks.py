"""Init search on 2 ranks: every rank ends with the winner's weights, standalone and inside the pipeline."""
from __future__ import annotations

import math

import pytest
import torch

from pdv_ext.spawn import run_ranks

pytestmark = pytest.mark.integration

CFG = {"candidates": 3, "rounds": 2, "probe_steps": 3, "keep_fraction": 0.34, "seed": 4}


@pytest.fixture(scope="module")
def results():
    """One 2-rank run for both tests: standalone search_init, then pdv_ext.initialize with a 2-stage pipeline."""
    return run_ranks("tests.integration.init_search_workers:search_both", 2, {"cfg": CFG}, timeout=250)


@pytest.mark.timeout(300)
def test_two_ranks_agree_on_the_winner_standalone(results):
    out = [r["standalone"] for r in results]
    a, b = sorted(out, key=lambda r: r["rank"])
    assert a["report"]["winner"] == b["report"]["winner"]
    assert a["report"]["candidates"] == 12  # 3 per rank per round, 2 ranks, 2 rounds
    owners = {e.split(".")[1] for r in a["report"]["rounds"] for e in r["survivors"]}
    assert owners <= {"k0", "k1"}
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    assert a["report"]["winner"]["score"] <= a["report"]["default_score"]


@pytest.mark.timeout(300)
def test_pipeline_stages_load_their_slice_of_the_winner(results):
    out = [r["pipeline"] for r in results]
    a, b = sorted(out, key=lambda r: r["stage_id"])
    assert a["report"]["winner"] == b["report"]["winner"]
    for k in a["full"]:
        assert torch.equal(a["full"][k], b["full"][k]), k  # the same whole model on both ranks
    for r in (a, b):
        assert r["stage"], "stage has parameters"
        for k, v in r["stage"].items():
            assert torch.equal(v, r["full"][k]), k  # the stage holds its slice of the winner
        if r["report"]["winner"]["seed"] is not None:  # unless the model as built won, the weights changed
            assert any(not torch.equal(r["before"][k], v) for k, v in r["stage"].items())
        assert all(math.isfinite(x) for x in r["losses"])
    assert set(a["stage"]).isdisjoint(b["stage"])
