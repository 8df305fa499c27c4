"""launch/train_horovod.py end to end (one rank, no launcher: the multi-rank paths are covered by
test_horovod_collectives/elastic), and its config errors before any collective."""
import json
import os
import sys

import pytest

from tests.integration.horovod_workers import HorovodRunFailed, run_command

pytestmark = pytest.mark.integration


@pytest.mark.timeout(320)
def test_example_single_rank(tmp_path):
    out = run_command([sys.executable, "launch/train_horovod.py", "--config", "launch/configs/horovod.yaml",
                       "--steps", "4", "--eval-every", "2", "--out", str(tmp_path)], timeout=300)
    assert "held-out loss" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["aggregator"] == "mean" and summary["samples"] == 4 * 16
    assert 0.0 <= summary["held_out_accuracy"] <= 1.0


@pytest.mark.timeout(320)
def test_example_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("aggregation:\n  type: adasumm\n")
    with pytest.raises(HorovodRunFailed) as exc:
        run_command([sys.executable, "launch/train_horovod.py", "--config", str(bad)], timeout=300)
    assert "exit code 2" in str(exc.value) and "pdv.aggregation.type" in str(exc.value)
    assert "did you mean 'adasum'" in str(exc.value)
