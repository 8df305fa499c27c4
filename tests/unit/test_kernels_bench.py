"""Smoke checks of `pdv bench kernels` / `pdv bench aggregate` plumbing (no timing assertions)."""
import json

from pdv_ext.bench import aggregate, kernels

KEYS = ["copy_gbps", "adasum_fused_gbps", "adasum_torch_gbps", "topk_fused_gbps", "topk_torch_gbps",
        "median_fused_gbps", "median_torch_gbps"]


def test_kernels_bench_tiny(capsys):
    assert kernels.main(["--json", "--mb", "0.25", "--reps", "1"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert all(k in res and res[k] > 0 for k in KEYS)


def test_gpt_shapes_fill_exactly():
    for elements in (1000, 2 ** 20, 16 * 2 ** 20 + 7):
        shapes = aggregate.gpt_shapes(elements)
        total = sum(aggregate._numel(s) for s in shapes)
        assert elements - 512 < total <= elements
    assert len(aggregate.gpt_shapes(16 * 2 ** 20)) > 12  # many layers, not one blob
