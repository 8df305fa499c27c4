"""Tensors of any layout and fp16 / bf16 gradients under real `horovodrun` (issue #21): HorovodComm,
adasum_tensors on strided views at 4 ranks, Adasum's zero-norm guard, and DistributedOptimizer."""
import pytest
import torch

from tests.integration.adasum_workers import rank_tensors  # noqa: F401  (keeps the worker modules importable)
from tests.integration.horovod_workers import _strided, run_horovod
from tests.unit.test_adasum import tree

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("horovod.torch")
    return run_horovod("layout_precision_checks", np=4, mode="gloo", timeout=450)


@pytest.mark.timeout(480)
def test_comm_half_precision_and_strided(results):
    for res in results:
        failed = [k for k, v in res.items() if v is False and not k.endswith("_native")]
        assert not failed, f"rank {res['rank']}: {failed}"
        assert "not supported" in res["hvd_bf16"] and "contiguous" in res["hvd_noncontig"]  # Horovod's own


@pytest.mark.timeout(480)
def test_adasum_strided_at_four_ranks(results):
    n = len(results)
    assert n == 4
    inputs = [_strided(r, seed=1)[1] for r in range(n)]
    for res in results:
        assert res["adasum_strided_equal"]
        for r in range(1, n):
            assert all(torch.equal(a, b) for a, b in zip(results[0]["adasum_strided_result"], res["adasum_strided_result"]))
    for t, out in enumerate(results[0]["adasum_strided_result"]):
        if out.numel():
            ref = tree([inputs[r][t].reshape(-1) for r in range(n)])
            torch.testing.assert_close(out.reshape(-1).double(), ref, rtol=2e-5, atol=1e-6)
    keys = [k for k in results[0] if k.startswith("adasum_identical_")]
    assert len(keys) == 5 and all(res[k] for res in results for k in keys)


@pytest.mark.timeout(480)
def test_optimizer_strided_and_half_precision(results):
    for res in results:
        for agg in ("mean", "adasum", "median"):
            assert res[f"opt_strided_{agg}_maxdiff"] < 1e-5, agg
            assert all(torch.equal(a, b) for a, b in zip(res[f"opt_strided_{agg}_weights"],
                                                         results[0][f"opt_strided_{agg}_weights"]))
        for dt in ("float16", "bfloat16"):
            errors = {k: v for k, v in res.items() if k.startswith(f"opt_{dt}_") and k.endswith("_error")}
            assert not errors, errors
            for label in ("mean", "mean_agg", "adasum", "median"):
                assert res[f"opt_{dt}_{label}_dtype"] and res[f"opt_{dt}_{label}_finite"]
            assert res[f"opt_{dt}_mean_native"] and not res[f"opt_{dt}_mean_agg_native"]
            assert res[f"opt_{dt}_mean_paths_maxdiff"] < {"float16": 5e-3, "bfloat16": 5e-2}[dt]
    for dt in ("float16", "bfloat16"):  # every replica applies the same update
        for label, w0 in results[0][f"opt_{dt}_weights"].items():
            for res in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(w0, res[f"opt_{dt}_weights"][label])), (dt, label)
