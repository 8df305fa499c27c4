"""GPU tier for the layer profile (issue #20 items 4 and 6): `pdv profile` on CUDA, the caller's modules
left where they were, and the cost model's prediction of a real DeepSpeed step from a GPU profile.

Skipped without CUDA (tests/conftest.py). Not yet run on hardware when written: the last two tests are the
real check of the GPU timing (events in the stream, one synchronize per pass, calibration to the whole
pass) for whoever has a GPU. Needs DeepSpeed on the GPU machine for the step measurement
(`source .gpu/device-setup.sh`).
"""
import json
import statistics
import time

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

# the model of issue #20 item 6: 8 blocks, hidden 1024, 16 heads, 256 tokens, micro-batches of 8
GPT = dict(layers=8, hidden=1024, heads=16, seq_len=256)
MICRO_BATCH, MICRO_BATCHES = 8, 4


def test_pdv_profile_on_cuda(tmp_path, capsys):
    from pdv_ext.placement.cli import profile_main

    out = tmp_path / "prof.json"
    assert profile_main(["--model", "gpt", "--layers", "2", "--hidden", "128", "--heads", "4", "--seq-len", "64",
                         "--micro-batch", "4", "--reps", "3", "--out", str(out)]) == 0
    assert "on cuda" in capsys.readouterr().out
    prof = json.load(open(out))
    assert prof["device"].startswith("cuda")
    assert prof["meta"]["timing"].startswith("events")
    whole = prof["meta"]["whole_pass_seconds"]  # calibrated by default on a GPU
    assert whole > 0 and sum(l["fwd_bwd"] for l in prof["layers"]) == pytest.approx(whole)
    assert all(0 < l["fwd"] <= l["fwd_bwd"] for l in prof["layers"])
    assert all(l["update"] > 0 for l in prof["layers"] if l["param_bytes"] > 0)


def test_profile_leaves_modules_where_they_were():
    from pdv_ext.placement.profile import profile_layers

    torch.manual_seed(0)
    on_cpu = [nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 8)]
    on_gpu = [nn.Linear(64, 64).cuda()]
    before = [p.detach().clone() for m in on_cpu + on_gpu for p in m.parameters()]
    params = [p for m in on_cpu + on_gpu for p in m.parameters()]
    stats = on_cpu[1].running_mean.clone()
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    prof = profile_layers(on_cpu, x, reps=2, device="cuda", loss_fn=nn.functional.cross_entropy, labels=y)
    assert prof.device == "cuda" and all(l.fwd_bwd > 0 for l in prof.layers)
    profile_layers(on_gpu, x.cuda(), reps=2, device="cuda")
    assert all(p.device.type == "cpu" for m in on_cpu for p in m.parameters())
    assert on_cpu[1].running_mean.device.type == "cpu" and torch.equal(on_cpu[1].running_mean, stats)
    assert all(p.device.type == "cuda" for p in on_gpu[0].parameters())
    after = [p for m in on_cpu + on_gpu for p in m.parameters()]
    assert all(a is b for a, b in zip(params, after))
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, after))


def measured_step(steps: int = 12, warmup: int = 4, stages: int = 1, plan=None):
    """A rank of a real DeepSpeed pipeline on the GPU (fp32, AdamW, clipping 1.0 as launch/configs/demo.json):
    the median wall time of `train_batch` after `warmup` steps."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import gpt_layers, lm_loss, seed_layer

    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="nccl")
    model = PipelineModule(layers=gpt_layers(**GPT), num_stages=stages, loss_fn=lm_loss, seed_layers=True,
                           seed_fn=seed_layer, partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
           "pdv": {"placement": plan} if plan else {}}
    engine, _, _, _ = pdv_ext.initialize(model=model, config=cfg, model_parameters=model.parameters())
    ids = torch.randint(0, 256, (MICRO_BATCH, GPT["seq_len"]))

    def data():
        while True:
            yield ids, ids

    it, times = data(), []
    for s in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.train_batch(data_iter=it)
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gpu_profile(monkeypatch):
    from pdv_ext.models import gpt_layers, lm_loss
    from pdv_ext.placement.profile import engine_overhead, profile_layers

    torch.manual_seed(0)
    ids, labels = (torch.randint(0, 256, (MICRO_BATCH, GPT["seq_len"])) for _ in range(2))
    prof = profile_layers(gpt_layers(**GPT), ids, reps=5, loss_fn=lm_loss, labels=labels)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the engine's own work, timed as `pdv profile --engine` does
    prof.engine = engine_overhead(len(prof))
    return prof


@pytest.mark.timeout(900)
def test_one_stage_prediction_within_5_percent(monkeypatch):
    """Issue #20 item 6: the plan for one device, 4 micro-batches, 1 stage, against the measured step
    (before the GPU timing: 161.6 ms predicted, 139-141 measured)."""
    from pdv_ext.placement.cluster import Cluster
    from pdv_ext.placement.solvers import solve
    from pdv_ext.spawn import run_ranks

    prof = _gpu_profile(monkeypatch)
    plan = solve("dp", prof, Cluster.from_dict({"devices": [{"name": "gpu0", "host": "h"}]}), 1, MICRO_BATCHES)
    measured = run_ranks("tests.gpu.test_profile_gpu:measured_step", 1, {}, timeout=600,
                         env={"DS_ACCELERATOR": "cuda"})[0]
    err = abs(plan.predicted_step_time - measured) / measured
    print(f"one stage: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms, "
          f"error {err:.3f}; profile meta {prof.meta}")
    assert err <= 0.05


@pytest.mark.multigpu
@pytest.mark.timeout(900)
def test_two_stage_prediction_within_5_percent(monkeypatch, tmp_path):
    """Two stages on two GPUs of one host (NCCL needs a device per rank); the link between them is the
    cluster's default intra-host link."""
    from pdv_ext.placement.cluster import Cluster
    from pdv_ext.placement.solvers import solve
    from pdv_ext.spawn import run_ranks

    prof = _gpu_profile(monkeypatch)
    cluster = Cluster.from_dict({"devices": [{"name": "gpu0", "host": "h"}, {"name": "gpu1", "host": "h"}]})
    plan = solve("dp", prof, cluster, 2, MICRO_BATCHES)
    placement = {"boundaries": plan.boundaries, "rank_mapping": plan.rank_mapping}
    measured = max(run_ranks("tests.gpu.test_profile_gpu:measured_step", 2, {"stages": 2, "plan": placement},
                             timeout=600, env={"DS_ACCELERATOR": "cuda"}))
    err = abs(plan.predicted_step_time - measured) / measured
    print(f"two stages {plan.boundaries}: predicted {plan.predicted_step_time * 1e3:.1f} ms, "
          f"measured {measured * 1e3:.1f} ms, error {err:.3f}")
    assert err <= 0.05
