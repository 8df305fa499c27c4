"""`pdv bench adaptive --scenario` end to end on the emulated cluster (root): a 2-stage pipeline on 2 devices,
a fixed batch and a schedule. The schedule's change must reach every rank at the step it names (the trace's
micro-batches), the runs must stop at the target, and a target no run reaches must give the error, never a
ratio. Timing figures are the benchmark's (docs/benchmarks.md), not here."""
import json
import subprocess
import sys

import pytest

from .test_emulate_cluster import EMULATE_MARKS, ROOT

pytestmark = EMULATE_MARKS

SCENARIO = """
cluster:
  devices:
    - {{name: d0, host: a, throughput: 1.0}}
    - {{name: d1, host: a, throughput: 1.0}}
  links:
    intra_host: {{bandwidth: 10 Gbit/s, latency: 50us}}
run:
  pipe: 2
  data: 1
  micro_batch: 4
  held_out: 8
  model: {{layers: 2, hidden: 32, heads: 2, seq_len: 16}}
  timeout: 200
batch:
  fixed: [1]
  schedules: ["1,3:2"]
  target_loss: {target}
  max_samples: 64
  eval_every: 8
"""


def _bench(tmp_path, target):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(SCENARIO.format(target=target))
    out = tmp_path / "tiny.json"
    p = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "bench", "adaptive", "--scenario", str(scenario),
                        "--json", "--out", str(out)], capture_output=True, text=True, timeout=280, cwd=ROOT)
    return p, json.loads(p.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_schedule_changes_the_batch_and_an_unreached_target_gives_no_ratio(tmp_path):
    p, summary, full = _bench(tmp_path, 0.01)  # never reached in 64 samples
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no fixed batch reached the target loss 0.01" in summary["error"]
    assert "headroom" not in summary and "ratio" not in summary
    fixed, sched = full["fixed"][0], full["schedules"][0]
    assert not fixed["reached"] and not sched["reached"] and "did not reach" in sched["note"]
    # trace rows: [step, samples, seconds, held-out loss, micro-batches of the step]
    tf, ts = full["traces"]["fixed-1"][0], full["traces"]["schedule-1,3:2"][0]
    assert [r[4] for r in tf] == [1] * len(tf) and tf[-1][1] == 64 and tf[-1][0] == 16
    assert ts[0][:2] == [2, 8] and ts[0][4] == 1  # steps 1-3 at one micro-batch (4 samples)
    assert ts[-1][:2] == [10, 68] and ts[-1][4] == 2  # then 8 samples a step, until 64 or more
    losses = [r[3] for r in tf]
    assert losses[-1] < losses[0]  # it trained


@pytest.mark.timeout(300)
def test_runs_stop_at_the_target(tmp_path):
    p, summary, full = _bench(tmp_path, 50.0)  # reached at the first evaluation
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert summary["best_fixed"]["micro_batches"] == 1
    assert summary["fixed"][0]["samples_to_target"] == 8 and summary["fixed"][0]["steps_to_target"] == 2
    assert summary["schedule_vs_best_fixed"] > 0 and summary["headroom"] == round(1 - summary["schedule_vs_best_fixed"], 4)
    assert len(full["traces"]["fixed-1"][0]) == 1
