"""Smoke checks of `pdv bench kernels` / `pdv bench aggregate` plumbing (no timing assertions)."""
import json

from pdv_ext.bench import aggregate, kernels

KEYS = ["copy_gbps", "adasum_fused_gbps", "adasum_torch_gbps", "topk_fused_gbps", "topk_torch_gbps",
        "median_fused_gbps", "median_torch_gbps", "trimmed_fused_gbps", "trimmed_torch_gbps",
        "adasum_fused_vs_copy", "topk_fused_vs_copy", "median_fused_vs_copy", "trimmed_fused_vs_copy"]


def test_kernels_bench_tiny(capsys):
    assert kernels.main(["--json", "--mb", "0.25", "--reps", "1"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(k in res and res[k] > 0 for k in KEYS)
    assert res["device"] == "cpu" and res["dtypes"] == ["float32"]


def test_kernels_bench_both_dtypes_on_cpu(capsys):
    """bf16 inputs are reported beside float32 ones (keys ending in _bf16; on CPU they take the reference)."""
    assert kernels.main(["--json", "--mb", "0.0625", "--reps", "1", "--dtype", "both"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(res[k] > 0 and res[k.replace("_gbps", "_bf16_gbps").replace("_vs_copy", "_bf16_vs_copy")] > 0
               for k in KEYS)


def test_kernels_bench_cuda_absent_is_a_clear_error(capsys, monkeypatch):
    import pytest
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kernels, "run", lambda *a, **k: pytest.fail("timed without CUDA"))
    with pytest.raises(SystemExit) as e:
        kernels.main(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: no CUDA device" in capsys.readouterr().err


def test_gpt_shapes_fill_exactly():
    for elements in (1000, 2 ** 20, 16 * 2 ** 20 + 7):
        shapes = aggregate.gpt_shapes(elements)
        total = sum(aggregate._numel(s) for s in shapes)
        assert elements - 512 < total <= elements
    assert len(aggregate.gpt_shapes(16 * 2 ** 20)) > 12  # many layers, not one blob


def test_kernels_bench_reports_every_timer_beside_the_historical_keys():
    """On CUDA each op and the copy are timed as device time (events: the historical keys), queued wall time
    and synced wall time; here the three timers run on the CPU clock with a no-op sync (the key contract:
    keys added, none removed)."""
    calls = []

    def sync():
        calls.append(1)

    timers = {"": kernels._time, "_queued": lambda fn: kernels._time_queued(fn, 3, sync),
              "_synced": lambda fn: kernels._time_synced(fn, 3, sync)}
    res = kernels.run(4096, 1, timers=timers)
    assert all(res[k] > 0 for k in KEYS)
    for infix in ("_queued", "_synced"):
        assert all(res[k.replace("_gbps", f"{infix}_gbps").replace("_vs_copy", f"{infix}_vs_copy")] > 0 for k in KEYS)
        assert res[f"adasum_fused{infix}_us"] > 0 and res[f"copy{infix}_us"] > 0
    assert "adasum_fused_us" not in res  # the first timer keeps exactly the historical keys
    assert len(calls) == 9 * (2 + 4)  # per case: queued syncs twice, synced once before and after each call


def test_kernels_bench_cuda_timers_are_events_queued_and_synced():
    assert list(kernels.cuda_timers(5)) == ["", "_queued", "_synced"]
