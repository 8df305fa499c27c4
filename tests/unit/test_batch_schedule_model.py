"""scripts/batch_schedule_model.py (docs/policy.md): the exact model of what a batch schedule gains. Checks the
two facts the docs draw from it, on a small case that runs in about a second."""
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "batch_schedule_model.py")


def test_a_growing_batch_beats_one_lr_but_not_a_good_lr_decay():
    out = subprocess.run([sys.executable, SCRIPT, "--dim", "16", "--knee", "16", "--target", "1e-3", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    run = json.loads(out.strip().splitlines()[-1])["runs"][0]
    assert run["schedule"]["last_batch"] > run["schedule"]["first_batch"]  # the batch grows toward the floor
    assert run["schedule_vs_fixed_one_lr"] < 0.85  # against one constant LR: a large gain
    assert 0.9 < run["schedule_vs_fixed_lr_decay"] < 1.1  # against a good LR decay: next to nothing
    assert run["fixed_lr_decay"]["time"] < run["fixed_one_lr"]["time"]
