"""`pdv_ext.initialize` says that pdv_ext took over (issue #21 item 4): rank 0 logs one line per capability
in use, at INFO through pdv_ext's logger, the aggregator stage by stage where stages differ; other ranks log none
of it. The caller's `args.deepspeed_config` is left as it was."""
import logging

import pytest

from pdv_ext.spawn import run_ranks
from tests.integration.summary_workers import write_config

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_rank0_logs_what_pdv_set_up_and_other_ranks_do_not(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text('{"boundaries": [0, 1, 4], "rank_mapping": [[1], [0]], "predicted_step_time": 0.0123, '
                    '"solver": "dp", "micro_batches": 2}')
    path = write_config(str(tmp_path / "ds.json"), {
        "aggregation": {"type": "tests.integration.summary_workers:stage_aggregator"},
        "placement": {"plan": str(plan)},
        "policy": {"monitor": {"enabled": True}}})
    res = {r["rank"]: r for r in run_ranks("tests.integration.summary_workers:init_and_capture", 2,
                                            {"config_path": path}, timeout=200)}
    assert res[1]["lines"] == []  # only rank 0 speaks
    lines = ["pdv_ext: " + line for line in res[0]["lines"]]  # logged without the prefix (the format names it)
    assert res[0]["levels"] == [logging.INFO]
    assert lines[0] == "pdv_ext: engine PDVPipelineEngine: 2 stages x 1 data-parallel replica (2 ranks)"
    # the plan maps stage 0 to rank 1 and stage 1 to rank 0; the factory builds `mean` on rank 0, `median`
    # on rank 1: so stage 0 runs median and stage 1 mean, each gathered from its stage's rank
    assert res[0]["stage"] == 1 and res[1]["stage"] == 0
    agg = next(ln for ln in lines if ln.startswith("pdv_ext: aggregator"))
    assert agg.startswith("pdv_ext: aggregator per stage: stage 0: median(") and "; stage 1: mean(" in agg
    place = next(ln for ln in lines if ln.startswith("pdv_ext: placement"))
    assert place == (f"pdv_ext: placement boundaries [0, 1, 4], rank mapping [[1], [0]] (plan {plan}; solver dp; "
                     "predicted step 12.3 ms at 2 micro-batches)")
    assert any(ln.startswith("pdv_ext: policies none (agreed every 1 step; monitor -> in memory)") for ln in lines)
    assert len(lines) == 4  # no init search, no faults
    assert res[0]["summary"] == lines and res[1]["summary"] == []  # also on the engine, for programs
    assert all(r["args_config"] == path for r in res.values())  # the caller's --deepspeed_config, untouched
