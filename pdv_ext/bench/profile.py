"""`pdv bench profile`: the cost model's step time from a layer profile against a measured DeepSpeed step.

Issue #20 item 6 asks that, on a GPU, `pdv profile --engine` + the cost model predict the measured step of a
one-stage plan within 5%. This measures exactly that on this machine's device: it profiles the GPT's layers
(`profile_layers` with the loss, as `pdv profile --model gpt` does, plus DeepSpeed's own per-micro-batch and
per-step work as `--engine` does), plans one device (`dp` solver, `--stages`, `--micro-batches`), then trains
the same model and config through `pdv_ext.initialize` on as many ranks as stages and takes the median step.

Baseline in the same run: the same layers timed the pre-#20 way (`timing="layer"`: a synchronisation around
each layer, no calibration to the whole pass) — `predicted_layer_timing_ms` and its error. On a CPU both
ways are the same method; on CUDA the default is events in the stream and the whole-pass calibration.
Defaults are the issue's model (8 blocks, hidden 1024, 16 heads, 256 tokens, micro-batches of 8, 4 of them);
`--quick` is a small model for a smoke run.

`--rounds R` (default 3): the profile and the measured step are taken R times (the measured steps in R
blocks of one run; DeepSpeed's own per-step work, which the profile adds, timed once) and each round's
prediction is set against its own measurement; `prediction_error` is the median over the rounds,
`worst_round_error` the largest, `rounds` each round's figures (a GPU's measured step moved 8% between
single runs: one round decides nothing).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

from .common import emit, log, parser

DEFAULTS = dict(layers=8, hidden=1024, heads=16, seq_len=256, micro_batch=8, micro_batches=4)
CLIPPING = 1.0  # the training config's gradient clipping (launch/configs/demo.json), which the engine's cost includes
QUICK = dict(layers=2, hidden=64, heads=4, seq_len=32, micro_batch=4, micro_batches=2)


def _cuda(device: str) -> bool:
    return device.startswith("cuda")


def gpt_profile(model: Dict[str, int], device: str, reps: int = 5, timing: str = "auto",
                calibrate: Optional[bool] = None, engine: bool = True):
    """The GPT's layer profile on `device` (with DeepSpeed's own work when `engine`)."""
    import torch

    from ..models import gpt_layers, lm_loss
    from ..placement.profile import engine_overhead, profile_layers

    torch.manual_seed(0)
    shape = (model["micro_batch"], model["seq_len"])
    ids, labels = torch.randint(0, 256, shape), torch.randint(0, 256, shape)
    layers = gpt_layers(model["layers"], model["hidden"], model["heads"], model["seq_len"])
    prof = profile_layers(layers, ids, reps=reps, device=device, loss_fn=lm_loss, labels=labels, timing=timing,
                          calibrate=calibrate)
    if engine:
        prof.engine = engine_overhead(len(prof))
    return prof


def measured_step(model: Dict[str, int], stages: int = 1, plan: Optional[Dict[str, Any]] = None,
                  steps: int = 12, warmup: int = 4, rounds: int = 1) -> List[float]:
    """One rank of a real DeepSpeed pipeline of the GPT (fp32, AdamW, clipping 1.0 as launch/configs/demo.json)
    on this rank's device: the median wall time of `train_batch` in each of `rounds` blocks of `steps` steps,
    after `warmup` steps. Run under `run_ranks`."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from ..models import gpt_layers, lm_loss, seed_layer

    acc = get_accelerator()
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    layers = gpt_layers(model["layers"], model["hidden"], model["heads"], model["seq_len"])
    module = PipelineModule(layers=layers, num_stages=stages, loss_fn=lm_loss, seed_layers=True, seed_fn=seed_layer,
                            partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": model["micro_batch"],
           "gradient_accumulation_steps": model["micro_batches"],
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "gradient_clipping": CLIPPING, "steps_per_print": 10 ** 9, "log_level": "error",
           "pdv": {"placement": plan} if plan else {}}
    engine, _, _, _ = pdv_ext.initialize(model=module, config=cfg, model_parameters=module.parameters())
    ids = torch.randint(0, 256, (model["micro_batch"], model["seq_len"]))

    def data():
        while True:
            yield ids, ids

    it, times = data(), []
    for s in range(warmup + steps * rounds):
        acc.synchronize()
        t0 = time.perf_counter()
        engine.train_batch(data_iter=it)
        acc.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return [statistics.median(times[r * steps:(r + 1) * steps]) for r in range(rounds)]


def run(model: Dict[str, int], device: str, stages: int = 1, reps: int = 5, engine: bool = True,
        timeout: float = 900.0, rounds: int = 3) -> Dict[str, Any]:
    """Profile, plan, measure, `rounds` times; the result of one `pdv bench profile` run (medians over rounds)."""
    from ..placement.cluster import Cluster
    from ..placement.profile import engine_overhead
    from ..placement.solvers import solve
    from ..spawn import run_ranks

    cluster = Cluster.from_dict({"devices": [{"name": f"dev{i}", "host": "h"} for i in range(stages)]})
    overhead, profiles = None, []
    for r in range(rounds):
        log(f"[bench profile] round {r + 1}/{rounds}: profiling {model['layers']} blocks on {device}")
        prof = gpt_profile(model, device, reps, engine=False)
        if engine and r == 0:  # DeepSpeed's own work, timed once for every round, on the profiled device
            overhead = engine_overhead(len(prof), device=device, clipping=CLIPPING,
                                       tensors_per_layer=prof.meta.get("param_tensors"))
        prof.engine = overhead
        layer_way = gpt_profile(model, device, reps, timing="layer", calibrate=False, engine=False)
        layer_way.engine = overhead
        profiles.append((prof, solve("dp", prof, cluster, stages, model["micro_batches"]),
                         solve("dp", layer_way, cluster, stages, model["micro_batches"])))
    plan = profiles[0][1]
    placement = {"boundaries": plan.boundaries, "rank_mapping": plan.rank_mapping}
    log(f"[bench profile] training {stages} stage(s) {plan.boundaries} with DeepSpeed, {rounds} block(s) of steps")
    accel = "cuda" if _cuda(device) else "cpu"
    per_rank = run_ranks("pdv_ext.bench.profile:measured_step", stages,
                         {"model": model, "stages": stages, "plan": placement if stages > 1 else None,
                          "rounds": rounds}, timeout=timeout, env={"DS_ACCELERATOR": accel})
    measured = [max(rank[r] for rank in per_rank) for r in range(rounds)]  # the slowest stage's step
    rows = []
    for (prof, p, base), m in zip(profiles, measured):
        rows.append({"predicted_ms": round(p.predicted_step_time * 1e3, 3), "measured_ms": round(m * 1e3, 3),
                     "prediction_error": round(abs(p.predicted_step_time - m) / m, 4),
                     "predicted_layer_timing_ms": round(base.predicted_step_time * 1e3, 3),
                     "layer_timing_error": round(abs(base.predicted_step_time - m) / m, 4)})
    med = {k: round(statistics.median(row[k] for row in rows), 4) for k in rows[0]}
    prof = profiles[0][0]
    return {"device": device, "stages": stages, "boundaries": plan.boundaries, **model,
            "timing": prof.meta.get("timing"), "calibrated": "whole_pass_seconds" in prof.meta,
            "engine_measured": overhead is not None, "rounds_taken": rounds, **med,
            "worst_round_error": max(row["prediction_error"] for row in rows), "rounds": rows}


def main(argv=None) -> int:
    ap = parser("profile", __doc__)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages, one device (rank) each (default 1)")
    for key, value in DEFAULTS.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {value}")
    ap.add_argument("--reps", type=int, default=5, help="profile rounds per layer (median)")
    ap.add_argument("--no-engine", action="store_true", help="leave DeepSpeed's own work out of the profile")
    ap.add_argument("--rounds", type=int, default=3, help="profile + measured step taken this many times; the "
                    "error reported is the median over rounds (default 3)")
    ap.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        ap.error(f"--device {device}: use cpu or cuda")
    if _cuda(device) and torch.cuda.device_count() < args.stages:
        ap.error(f"--device {device} --stages {args.stages}: needs {args.stages} CUDA devices (one rank each; NCCL "
                 f"refuses two ranks on one device), found {torch.cuda.device_count()}")
    if args.stages < 1 or args.reps < 1 or args.rounds < 1:
        ap.error("--stages, --reps and --rounds must be >= 1")
    model = dict(QUICK if args.quick else DEFAULTS)
    for key in DEFAULTS:
        given = getattr(args, key)
        if given is not None:
            if given < 1:
                ap.error(f"--{key.replace('_', '-')} must be >= 1 (got {given})")
            model[key] = given
    emit(run(model, device, args.stages, args.reps, engine=not args.no_engine, rounds=args.rounds), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
