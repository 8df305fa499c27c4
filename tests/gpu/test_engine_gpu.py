"""GPU tier: PDVPipelineEngine on one CUDA GPU with nccl in fp32, fp16, bf16, ZeRO-1, bf16 + ZeRO-1 and
fp16 + ZeRO-1 (issue #20 item 3). Skipped without CUDA (tests/conftest.py).

One GPU is one NCCL rank (NCCL refuses two ranks on a device), so the data-parallel width is 1: an
aggregator then returns its input (adasum of one gradient is that gradient), but the engine's whole
reduction path runs — the per-mode gradient views, the bf16 -> fp32 copies, ZeRO-1's partition bookkeeping
with its communication switched off, Zeno's validation pass — on CUDA tensors and an nccl group.
Multi-rank aggregation on CUDA tensors is the kernels' and aggregators' GPU tests' job (ThreadComm).

The matrix runs in one rank process (`run_ranks` gives it the environment torchrun would: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; hard timeout, process group reaped); a second test trains the
demo GPT through the real `torchrun --nproc_per_node 1` launcher in bf16 + ZeRO-1 with adasum.
"""
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ["fp32", "fp16", "bf16", "zero1", "bf16_zero1", "bf16_zero1_fp32acc", "fp16_zero1"]
#: mode -> (DeepSpeed optimizer wrapper(s), PDVPipelineEngine.reduce_mode)
EXPECTED = {
    "fp32": ("AdamW", "engine"),
    "fp16": ("FP16_Optimizer FP16_UnfusedOptimizer", "engine"),  # unfused with torch's AdamW
    "bf16": ("BF16_Optimizer", "bf16"),
    "zero1": ("DeepSpeedZeroOptimizer", "zero"),
    "bf16_zero1": ("DeepSpeedZeroOptimizer", "zero"),
    "bf16_zero1_fp32acc": ("BF16_Optimizer", "bf16"),
    "fp16_zero1": ("DeepSpeedZeroOptimizer", "zero"),
}
AGGREGATORS = ["mean", "adasum", "median", {"type": "zeno", "b": 0}, {"type": "suspicion", "k": 0}]
STEPS = 4


@pytest.fixture(scope="module")
def runs():
    from pdv_ext.spawn import run_ranks

    env = {"DS_ACCELERATOR": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return run_ranks("tests.integration.engine_mode_workers:train_modes", 1,
                     dict(modes=MODES, aggregators=AGGREGATORS, stages=1, steps=STEPS, hidden=64),
                     timeout=800, env=env)[0]


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("engine_modes")  # one worker runs the `runs` fixture (the whole matrix) once
@pytest.mark.parametrize("mode", MODES)
def test_engine_modes_on_one_gpu(runs, mode):
    assert runs["device"] == "cuda"
    res = runs[mode]
    van = res["vanilla"]
    assert van["param_device"].startswith("cuda")
    for name in ("mean", "adasum", "median", "zeno", "suspicion"):
        run = res[name]
        wrappers, reduce_mode = EXPECTED[mode]
        assert run["optimizer"] in wrappers.split() and run["reduce_mode"] == reduce_mode, (mode, name, run["optimizer"])
        assert all(math.isfinite(x) for x in run["losses"]), (mode, name, run["losses"])
        assert any(not torch.equal(w, run["initial"][n]) for n, w in run["weights"].items()), (mode, name)
        if name != "mean":
            assert run["native"] is False and run["aggregator_steps"] == STEPS, (mode, name)
    # `mean` is DeepSpeed's own reduction (bf16/ZeRO) or pdv's bit-identical copy of it (fp32/fp16)
    assert res["mean"]["losses"] == van["losses"], mode
    for n, w in van["weights"].items():
        assert torch.equal(res["mean"]["weights"][n], w), (mode, n)
    # width 1: adasum returns its input, so it trains exactly as the mean (up to fp32 copies of bf16)
    if mode in ("fp32", "zero1"):
        assert res["adasum"]["losses"] == van["losses"], mode


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.timeout(600)
def test_train_gpt_through_torchrun_bf16_zero1_adasum(tmp_path):
    """The demo job through the real launcher: one GPU, one stage, bf16 + ZeRO-1, adasum."""
    from pdv_ext.spawn import free_port

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
           "pdv": {"aggregation": {"type": "adasum"}, "policy": {"monitor": {"enabled": True, "tensorboard": False}}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           os.path.join(ROOT, "launch", "train_gpt.py"), "--deepspeed_config", str(path), "--stages", "1",
           "--steps", "20", "--eval-every", "10", "--layers", "2", "--hidden", "64", "--out", str(tmp_path / "out")]
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "aggregator=Adasum" in out or "adasum" in out.lower(), out[-2000:]
    done = [line for line in out.splitlines() if "[demo] done" in line]
    assert done, out[-2000:]
    held_out = float(done[-1].split("held-out loss")[1].split()[0])
    assert math.isfinite(held_out) and held_out < math.log(256), out[-2000:]
    # the Monitor on a GPU rank: metrics on a gloo twin of the world, compute timed by CUDA events (device
    # time: positive, and within the steps' wall time over the run: a step's events may finish in the next)
    import csv

    rows = list(csv.DictReader(open(tmp_path / "out" / "metrics.csv")))
    assert len(rows) >= 19, rows[-1:]
    late = rows[5:]
    compute, wall = [float(r["compute_r0"]) for r in late], [float(r["step_time"]) for r in late]
    assert all(c > 0 for c in compute) and sum(compute) <= 1.1 * sum(wall), (compute, wall)
