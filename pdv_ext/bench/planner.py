"""`pdv bench planner`: solver quality and speed on synthetic instances.

128 layers / 50 stages on 100 devices (10 hosts of 10, two generations at speeds 1.0 and 0.5, 25 Gbit/s
between hosts), 100 micro-batches: the exact `dp`, the `differentiable` relaxation and DeepSpeed's
`partition_balanced` over parameters (row-major placement), all scored by the same cost model.
Large: 1024 layers on 4096 devices (512 hosts of 8), the stage count chosen by `dp`, 256 micro-batches.
"""
from __future__ import annotations

import time
from typing import List, Optional

from .common import emit, log, parser


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("planner", __doc__)
    ap.add_argument("--quick", action="store_true", help="small instances (smoke test)")
    ap.add_argument("--skip-large", action="store_true")
    args = ap.parse_args(argv)

    from ..placement.cluster import synthetic_cluster
    from ..placement.profile import Profile
    from ..placement.solvers import solve

    log("planner: importing torch and deepspeed (not timed) ...")
    import torch  # noqa: F401
    from deepspeed.runtime import utils  # noqa: F401

    layers, stages, devices, per_host, mb = (128, 50, 100, 10, 100) if not args.quick else (24, 6, 12, 4, 12)
    prof = Profile.synthetic(layers, seed=1, heavy_every=16)
    cluster = synthetic_cluster(devices, per_host=per_host, generations=(1.0, 0.5))
    res = {"layers": layers, "stages": stages}
    for name in ("deepspeed_parameters", "dp", "differentiable"):
        log(f"planner: {name} on {layers} layers / {stages} stages / {devices} devices ...")
        t0, c0 = time.perf_counter(), time.process_time()
        plan = solve(name, prof, cluster, stages, mb)
        dt = time.perf_counter() - t0
        res[f"{name}_cost"] = plan.predicted_step_time
        res[f"{name}_seconds"] = dt
        res[f"{name}_cpu_seconds"] = time.process_time() - c0  # wall time suffers from a busy machine
        log(f"  cost {plan.predicted_step_time:.4f} s/step, {dt:.3f} s")
    res["differentiable_gap"] = res["differentiable_cost"] / res["dp_cost"] - 1.0
    res["dp_vs_deepspeed_speedup"] = res["deepspeed_parameters_cost"] / res["dp_cost"]
    if not args.skip_large:
        big_layers, big_devices = (1024, 4096) if not args.quick else (64, 64)
        log(f"planner: dp on {big_layers} layers / {big_devices} devices ...")
        bprof = Profile.synthetic(big_layers, seed=2, heavy_every=64)
        bcluster = synthetic_cluster(big_devices, per_host=8, generations=(1.0, 0.5))
        t0, c0 = time.perf_counter(), time.process_time()
        plan = solve("dp", bprof, bcluster, None, 256)
        dt = time.perf_counter() - t0
        res["large"] = {"layers": big_layers, "devices": big_devices, "dp_seconds": dt,
                        "dp_cpu_seconds": time.process_time() - c0,
                        "dp_cost": plan.predicted_step_time, "stages": plan.num_stages,
                        "exact": bool(plan.meta.get("exact", True))}
        log(f"  {plan.num_stages} stages, cost {plan.predicted_step_time:.4f}, {dt:.2f} s")
    emit(res, args.json)
    return 0
