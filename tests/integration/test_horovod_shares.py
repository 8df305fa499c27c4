"""Per-rank data shares under real `horovodrun --gloo` (3 ranks): the native Average, the aggregator path
and a user's SetDataShares policy all give the whole global batch's gradient (one process as reference),
and every rank reads its own slice of each step's samples."""
import pytest
import torch

from tests.integration.horovod_workers import run_horovod

pytestmark = [pytest.mark.integration, pytest.mark.horovod]


@pytest.mark.timeout(300)
def test_unequal_shares_give_the_whole_batch_gradient():
    pytest.importorskip("horovod.torch")
    steps, passes, mbs, np_ = 3, 2, 4, 3
    res = run_horovod("shares_checks", np=np_, mode="gloo", kwargs={"steps": steps, "passes": passes, "mbs": mbs},
                      timeout=280)
    ref = res[0]["reference"]
    for r in res:
        for label in ("native", "aggregator", "policy"):
            run = r[label]
            for w, e in zip(run["weights"], ref):
                torch.testing.assert_close(w, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
        assert r["native"]["shares"] == [3, 2, 1] and all(r["native"]["native"])
        assert r["aggregator"]["shares"] == [4, 1, 1] and not any(r["aggregator"]["native"])
        assert r["policy"]["shares"] == [1, 1, 4]
        assert r["policy"]["metrics"] == {"batch_size": passes * np_ * mbs, "data_shares": [1, 1, 4]}
    for label in ("native", "aggregator", "policy"):
        seen = sorted(p for r in res for p in r[label]["seen"])
        assert seen == list(range(steps * passes * np_ * mbs)), label
