"""The start-up summary's lines from fake engines (no process group): what each capability's line says,
the aggregator per stage only where stages differ, and DeepSpeed's log level deciding whether it shows.
The real thing on two ranks (rank 0 only): tests/integration/test_startup_summary.py."""
import json
import logging
from types import SimpleNamespace

import pytest

from pdv_ext.aggregation import build_aggregator
from pdv_ext.config import load_pdv
from pdv_ext.integrations.deepspeed import summary as S


class PDVPipelineEngine(SimpleNamespace):
    pass


def _engine(cfg, **kw):
    base = dict(num_stages=2, stage_id=0, aggregator=build_aggregator("mean"), _native_reduce=False,
                placement=None, pdv_policy=None, init_search_report=None, module=SimpleNamespace(), pdv_config=cfg)
    return PDVPipelineEngine(**{**base, **kw})


def test_plain_engine_says_engine_and_aggregator_only():
    cfg = load_pdv({})
    eng = _engine(cfg)
    facts = [dict(S.local_facts(eng), stage=s) for s in (0, 0, 1, 1)]
    lines = S.startup_lines(eng, facts, cfg)
    assert lines[0] == "pdv_ext: engine PDVPipelineEngine: 2 stages x 2 data-parallel replicas (4 ranks)"
    assert lines[1].startswith("pdv_ext: aggregator mean(prescale=False, predivide_factor=1.0")  # all its options
    assert lines[1].endswith(") on every stage's data-parallel group") and len(lines) == 2


def test_every_capability_in_use_gets_its_line(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"boundaries": [0, 2, 4], "rank_mapping": [[0], [1]], "predicted_step_time": 0.1616,
                                "solver": "dp", "micro_batches": 4}))
    cfg = load_pdv({"aggregation": {"type": "adasum"}, "placement": {"plan": str(plan)},
                    "faults": {"byzantine_ranks": [1], "attack": "sign_flip"}})
    policy = SimpleNamespace(cfg=SimpleNamespace(every=5, monitor=SimpleNamespace(output_dir="runs/x")),
                             runner=SimpleNamespace(policies=[SimpleNamespace(name="schedule", options={"at": 3})]))
    report = {"winner": {"scheme": "kaiming", "scale": 0.5, "seed": 7, "score": 2.1}, "default_score": 2.4,
              "candidates": 16, "ranks": 2, "probe_seconds": 1.25}
    eng = _engine(cfg, aggregator=build_aggregator("adasum"), placement={"boundaries": [0, 2, 4], "rank_mapping": [[0], [1]]},
                  pdv_policy=policy, init_search_report=report)
    facts = [dict(S.local_facts(eng), stage=s) for s in (0, 1)]
    lines = S.startup_lines(eng, facts, cfg)
    assert lines[0] == "pdv_ext: engine PDVPipelineEngine: 2 stages x 1 data-parallel replica (2 ranks)"
    assert lines[1].startswith("pdv_ext: aggregator adasum(") and "every stage" in lines[1]
    assert lines[2] == (f"pdv_ext: placement boundaries [0, 2, 4], rank mapping [[0], [1]] (plan {plan}; solver dp; "
                        "predicted step 161.6 ms at 4 micro-batches)")
    assert lines[3] == "pdv_ext: policies schedule(at=3) (agreed every 5 steps; monitor -> runs/x)"
    assert lines[4] == ("pdv_ext: init search: 16 candidates on 2 ranks in 1.2 s; winner scheme kaiming, scale 0.5, "
                        "seed 7 (score 2.1, default 2.4)")
    assert lines[5] == "pdv_ext: faults sign_flip from ranks [1]"


def test_aggregators_that_differ_are_named_per_stage_and_native_reduction_said():
    cfg = load_pdv({})
    eng = _engine(cfg)
    facts = [{"stage": 1, "aggregator": "median()", "native_reduce": False},
             {"stage": 0, "aggregator": "mean()", "native_reduce": False},
             {"stage": 1, "aggregator": "other()", "native_reduce": False}]  # a stage's first rank speaks for it
    assert S.startup_lines(eng, facts, cfg)[1] == "pdv_ext: aggregator per stage: stage 0: mean(); stage 1: median()"
    facts = [{"stage": s, "aggregator": "mean()", "native_reduce": True, "reduce_mode": "zero"} for s in (0, 1)]
    assert S.startup_lines(eng, facts, cfg)[1].endswith("(ZeRO / BF16 optimizer: DeepSpeed's own reduction inside "
                                                       "its optimizer)")
    facts = [{"stage": s, "aggregator": "median()", "native_reduce": False, "reduce_mode": "bf16"} for s in (0, 1)]
    assert S.startup_lines(eng, facts, cfg)[1].endswith("(on the gradients of DeepSpeed's bf16 optimizer)")


def test_start_up_plan_and_explicit_placement_sources():
    cfg = load_pdv({"placement": {"boundaries": [0, 1, 2]}})
    eng = _engine(cfg, placement={"boundaries": [0, 1, 2], "rank_mapping": [[0], [1]]})
    line = S.startup_lines(eng, [S.local_facts(eng)] * 2, cfg)[2]
    assert line.endswith("(explicit boundaries)")
    eng.module._pdv_plan = {"predicted_step_time": float("nan"), "solver": "dp"}  # NaN: nothing predicted
    assert S.startup_lines(eng, [S.local_facts(eng)] * 2, cfg)[2].endswith("(explicit boundaries; solver dp)")


@pytest.mark.parametrize("log_level, shown", [(None, True), ("info", True), ("warning", False), ("error", False)])
def test_logged_at_info_by_pdv_exts_logger_and_quiet_with_the_configs_log_level(log_level, shown):
    """Visible by default without being a warning: pdv_ext's own logger at INFO with its own handler; the
    DeepSpeed config's "log_level" (applied by pdv_ext.initialize) quiets it, as it quiets DeepSpeed."""
    from pdv_ext.log import apply_log_level, logger

    seen = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append((record.levelno, record.getMessage()))

    handler, old = Capture(), logger.level
    logger.addHandler(handler)
    try:
        assert logger.getEffectiveLevel() == logging.INFO and not logger.propagate
        assert any(getattr(h, "_pdv_ext", False) for h in logger.handlers)  # shown with no set-up by the user
        apply_log_level({"log_level": log_level} if log_level else {})
        eng = _engine(load_pdv({}))
        lines = S.log_startup(eng)  # no process group: this process is rank 0 of one
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert eng.pdv_startup_summary == lines and len(lines) == 2
    assert seen == ([(logging.INFO, line[len(S.PREFIX):]) for line in lines] if shown else [])


def test_a_module_class_policy_is_named_as_the_config_names_it():
    from pdv_ext.policy import build_policy

    pol = build_policy({"name": "launch.my_policy:PlateauLR", "patience": 20})
    assert S.describe(pol).startswith("launch.my_policy:PlateauLR(patience=20, ")
    assert S.describe(build_policy({"name": "schedule"})) == "schedule(changes=[])"
    from pdv_ext.aggregation import Aggregator, build_aggregator

    class Unregistered(Aggregator):  # e.g. built from "module:Class": no registered name
        def aggregate(self, grads, comm):
            return grads

    assert S.describe(Unregistered()) == "Unregistered()"  # not the base class's placeholder "base()"
    assert S.describe(build_aggregator("median")) == "median()"


def test_args_deepspeed_config_is_hidden_only_while_deepspeed_initialize_runs(tmp_path, monkeypatch):
    """A model that is not a PipelineModule goes to deepspeed.initialize, which refuses
    args.deepspeed_config beside the dict pdv hands it: hidden during that call, the caller's value after."""
    import torch
    from argparse import Namespace

    import pdv_ext.integrations.deepspeed.engine as D

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "pdv": {}}))
    args = Namespace(deepspeed_config=str(path), local_rank=0)
    seen = {}

    def fake_initialize(args=None, config=None, **kw):
        seen["during"], seen["config"] = args.deepspeed_config, config
        raise RuntimeError("stop here")  # restored even when DeepSpeed fails

    monkeypatch.setattr(D.deepspeed, "initialize", fake_initialize)
    with pytest.raises(RuntimeError, match="stop here"):
        D.initialize(args=args, model=torch.nn.Linear(2, 2))
    assert seen["during"] is None and seen["config"]["train_micro_batch_size_per_gpu"] == 1
    assert args.deepspeed_config == str(path)
    monkeypatch.setattr(D.deepspeed, "initialize", lambda args=None, **kw: args.deepspeed_config)
    both = Namespace(deepspeed_config=str(path), local_rank=0)  # config= as well: DeepSpeed decides, as before
    assert D.initialize(args=both, model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1}) == str(path)


def test_aggregator_line_shows_the_options_its_group_clamped():
    from pdv_ext.aggregation import build_aggregator

    agg = build_aggregator({"type": "trimmed_mean", "b": 1})
    assert S.describe_in_force(agg) == "trimmed_mean(b=1)"  # not fitted to a group yet
    with pytest.warns(UserWarning):
        agg.bind(2, 0)
    assert S.describe_in_force(agg) == "trimmed_mean(b=1) [clamped for a group of 2: b=0]"
    agg.bind(4, 0)
    assert S.describe_in_force(agg) == "trimmed_mean(b=1)"


def _shares_lines(cfg, **kw):
    eng = _engine(cfg, total_micro_batches=8, **kw)
    return [ln for ln in S.startup_lines(eng, [S.local_facts(eng)] * 4, cfg) if "data shares" in ln]


def test_the_data_shares_in_force_get_a_line(tmp_path):
    """issue #35 item 5: the split of the global batch between the replicas was invisible at start-up."""
    assert _shares_lines(load_pdv({})) == []  # "equal": DeepSpeed's own split, nothing to say
    cfg = load_pdv({"data_shares": [5, 3]})
    assert _shares_lines(cfg, data_shares=[5, 3]) == [
        "pdv_ext: data shares [5, 3] micro-batches per data-parallel replica (8 a step)"]
    cluster = tmp_path / "c.yaml"
    cluster.write_text("devices: []\n")
    cfg = load_pdv({"placement": {"cluster": str(cluster)}, "data_shares": "by_throughput"})
    assert _shares_lines(cfg, data_shares=[6, 2]) == [
        f"pdv_ext: data shares by_throughput on {cluster}: [6, 2] micro-batches per data-parallel replica (8 a step)"]
    # by_throughput that comes out equal: the engine keeps None (DeepSpeed's split); the line says so
    assert _shares_lines(cfg, data_shares=None) == [
        f"pdv_ext: data shares by_throughput on {cluster}: [4, 4] micro-batches per data-parallel replica "
        "(8 a step; an equal split)"]


def test_the_shares_line_comes_after_placement_and_before_policies():
    cfg = load_pdv({"placement": {"boundaries": [0, 1, 2]}, "data_shares": [3, 5]})
    policy = SimpleNamespace(cfg=SimpleNamespace(every=1, monitor=SimpleNamespace(output_dir=None)),
                             runner=SimpleNamespace(policies=[]))
    eng = _engine(cfg, placement={"boundaries": [0, 1, 2], "rank_mapping": [[0, 1], [2, 3]]}, pdv_policy=policy,
                  data_shares=[3, 5], total_micro_batches=8)
    lines = S.startup_lines(eng, [S.local_facts(eng)] * 4, cfg)
    assert [ln.split()[1] for ln in lines] == ["engine", "aggregator", "placement", "data", "policies"]
