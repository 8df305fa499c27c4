"""PDVPipelineEngine under bf16 (DeepSpeed's BF16_Optimizer), ZeRO stage 1 and bf16 + ZeRO-1, on 4 real
ranks (pipe 2 x data 2, gloo): `mean` stays DeepSpeed's own reduction (bit-identical), every other
aggregator takes over the gradients DeepSpeed would all-reduce and trains."""
import math

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from pdv_ext.spawn import run_ranks

pytestmark = pytest.mark.integration

#: mode -> (DeepSpeed optimizer wrapper, PDVPipelineEngine.reduce_mode)
EXPECTED = {
    "bf16": ("BF16_Optimizer", "bf16"),  # bf16 gradient accumulation
    "zero1": ("DeepSpeedZeroOptimizer", "zero"),
    "bf16_zero1": ("DeepSpeedZeroOptimizer", "zero"),  # bf16 weights and gradients under ZeRO-1
    "bf16_zero1_fp32acc": ("BF16_Optimizer", "bf16"),  # bf16 + ZeRO-1 with fp32 gradient accumulation
}
PLAIN_MEAN = {"type": "tests.integration.engine_mode_workers:PlainMean", "label": "plain_mean"}
#: `mean` with the policy Monitor reading the gradients around the reduction
WATCHED_MEAN = {"type": "mean", "label": "watched_mean", "pdv_extra": {"policy": {"monitor": {"enabled": True}}}}


def _by_stage(res, mode, name):
    out = {}
    for r in res:
        run = r[mode][name]
        out.setdefault(run["stage"], []).append(run)
    return out


@pytest.mark.timeout(300)
def test_mean_is_bit_identical_and_a_takeover_averages_like_deepspeed():
    """SGD (not Adam, which would hide a wrong gradient scale): `mean` matches vanilla exactly; a plain
    average given as another aggregator goes through the takeover path and matches up to rounding."""
    modes = list(EXPECTED)
    res = run_ranks("tests.integration.engine_mode_workers:train_modes", 4,
                    dict(modes=modes, aggregators=["mean", PLAIN_MEAN, WATCHED_MEAN], optimizer="SGD", lr=1.0, steps=3),
                    timeout=280)
    for mode in modes:
        for r in res:
            runs = r[mode]
            van, mean, plain = runs["vanilla"], runs["mean"], runs["plain_mean"]
            assert (mean["optimizer"], mean["reduce_mode"]) == EXPECTED[mode], mode
            assert mean["missing_internals"] == [], (mode, mean["missing_internals"])  # what internals.py uses
            assert mean["native"] is True and plain["native"] is False
            assert mean["losses"] == van["losses"], mode
            for n, w in van["weights"].items():
                assert torch.equal(mean["weights"][n], w), (mode, n)
            assert plain["aggregator_steps"] == 3
            # the takeover applied the average: off from vanilla by rounding, not by a factor of the update
            moved = max(float((w - van["initial"][n]).abs().max()) for n, w in van["weights"].items())
            off = max(float((plain["weights"][n] - w).abs().max()) for n, w in van["weights"].items())
            assert moved > 5e-3 and off <= 0.25 * moved, (mode, off, moved)
            assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(plain["losses"], van["losses"])), mode
            # a Monitor reads the gradients: under BF16_Optimizer around DeepSpeed's reduction (still identical),
            # under ZeRO-1 (which leaves only a partition averaged) pdv's Mean takes over (equal up to rounding)
            watched = runs["watched_mean"]
            assert watched["metrics"], mode
            if EXPECTED[mode][1] == "bf16":
                assert watched["native"] is True and watched["losses"] == van["losses"], mode
                assert all(torch.equal(watched["weights"][n], w) for n, w in van["weights"].items()), mode
            else:
                assert watched["native"] is False, mode
                off = max(float((watched["weights"][n] - w).abs().max()) for n, w in van["weights"].items())
                assert off <= 0.25 * moved, (mode, off, moved)


@pytest.mark.timeout(300)
def test_non_mean_aggregators_train_under_bf16_and_zero1():
    plan = [
        ("bf16", ["adasum", "zeno", {"type": "gossip", "peers": 1}]),
        ("zero1", ["adasum", "suspicion"]),
        ("bf16_zero1", ["adasum", "zeno", {"type": "gossip", "peers": 1}]),
        ("bf16_zero1_fp32acc", ["adasum", "median"]),  # trimmed_mean shares median's code (robust.py)
    ]
    steps = 3
    res = run_ranks("tests.integration.engine_mode_workers:train_matrix", 4,
                    dict(plan=plan, steps=steps, lr=3e-3), timeout=280)
    for mode, aggs in plan:
        for agg in aggs:
            name = agg if isinstance(agg, str) else agg["type"]
            for stage, runs in _by_stage(res, mode, name).items():
                for run in runs:
                    assert (run["optimizer"], run["reduce_mode"]) == EXPECTED[mode], (mode, name)
                    assert run["native"] is False and run["aggregator_steps"] == steps, (mode, name)
                    assert all(math.isfinite(x) for x in run["losses"]), (mode, name, run["losses"])
                    assert run["losses"][-1] < run["losses"][0], (mode, name, run["losses"])
                    assert any(not torch.equal(w, run["initial"][n]) for n, w in run["weights"].items())
                    if "validation_norm" in run:  # zeno scored against a real validation gradient
                        assert run["validation_norm"] > 0, (mode, name)
                # the optimizer is partitioned (ZeRO-1 / BF16_Optimizer) and gathers the weights after each
                # step: the replicas of a stage hold the same weights, gossip included
                a, b = runs
                for n, w in a["weights"].items():
                    assert torch.equal(w, b["weights"][n]), (mode, name, stage, n)
    for r in res:
        assert r["zero2_error"] is not None and "zero_optimization.stage" in r["zero2_error"]
        # mean + a hook under ZeRO-1 with compact partition buffers: refused at start-up, naming both keys
        err = r["hooked_mean_error"]
        assert err is not None and "zero_optimization.offload_optimizer" in err and "FaultInjector" in err, err
        if hasattr(DeepSpeedZeroOptimizer, "_use_compact_grad_partition_buffer"):  # DeepSpeed >= 0.19.8 has them
            assert "data_types.grad_accum_dtype" in err, err
