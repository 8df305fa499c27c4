"""GPU tier for the layer profile (issue #20 items 4 and 6): `pdv profile` on CUDA, the caller's modules
left where they were, and the cost model's prediction of a real DeepSpeed step from a GPU profile.

Skipped without CUDA (tests/conftest.py). Not yet run on hardware when written. The 5% target itself is
measured by `pdv bench profile --device cuda --json` (and `--stages 2` on two GPUs); the last test here
only checks that the benchmark runs. Needs DeepSpeed on the GPU machine (`source .gpu/device-setup.sh`).
"""
import json

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu



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


def test_bench_profile_runs_on_cuda(capsys):
    """`pdv bench profile --device cuda` (the command that measures issue #20 item 6's 5% target: a number
    measured by the benchmark, not asserted by a timed test) runs end to end and reports its keys.

    Without DeepSpeed's own per-micro-batch work (`--no-engine`): timing it is a CPU child of ~30 s that the
    CPU tier covers (tests/integration/test_profile_bench.py) and scripts/gpu_check.sh's profile part runs in
    full; with it this test alone took 63 s of the tier on an H200 (2026-11-26)."""
    from pdv_ext.bench.profile import main

    assert main(["--device", "cuda", "--quick", "--reps", "2", "--no-engine", "--rounds", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["device"] == "cuda" and res["calibrated"] and res["timing"].startswith("events")
    assert res["measured_ms"] > 0 and res["predicted_ms"] > 0 and res["prediction_error"] >= 0
    assert res["predicted_layer_timing_ms"] > 0 and res["engine_measured"] is False
