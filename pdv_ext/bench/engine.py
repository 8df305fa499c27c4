"""`pdv bench engine`: vanilla DeepSpeed PipelineEngine vs PDVPipelineEngine + `mean`, in one run.

Both engines are built in the same 4 ranks from identically seeded models and fed identical data; their
train_batch calls alternate (vanilla, pdv, vanilla, ...) so machine noise hits both alike. Reports the
median step of each, their ratio and whether every step's loss (and the final weights) matched exactly.
`--precision fp32|bf16` and `--zero 0|1` pick DeepSpeed's mode for both engines (bf16 alone runs
DeepSpeed's BF16_Optimizer, ZeRO-1 its DeepSpeedZeroOptimizer); the ranks run on CPU with gloo, where
DeepSpeed has no fp16.

The timed steps are split over two rounds with fresh engines, built vanilla-then-pdv in the first and
pdv-then-vanilla in the second: under ZeRO-1 the engine built second ran 2-5% slower whichever it was
(measured with bf16 + ZeRO-1: 1.05 / 1.00 vanilla first, 0.94 / 0.98 pdv first), which one fixed order
would charge to one side. Each round restarts from the same seed; every step's loss is compared.

`--snapshots EVERY`: pdv's engine also writes an in-memory snapshot every EVERY steps (`pdv.snapshots`,
docs/recovery.md), so what they cost over vanilla DeepSpeed shows in `mean_ratio` (the mean step's ratio: a
snapshot every EVERY steps spread over them; with `mean` alone it is within 1-2% of 1) and, for EVERY 1, in
`ratio` (the median step's); `snapshot_ms` is the median time of a snapshot on the slowest rank, with its
parts in `snapshot_parts_ms`.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

#: DeepSpeed config fragments per --precision (model inputs follow the weights' dtype)
PRECISION = {"fp32": {}, "fp16": {"fp16": {"enabled": True}}, "bf16": {"bf16": {"enabled": True}}}


def mode_config(precision: str = "fp32", zero: int = 0, grad_accum_dtype: Optional[str] = None) -> Dict[str, Any]:
    """The DeepSpeed config keys of a precision / ZeRO stage (both engines get the same)."""
    cfg: Dict[str, Any] = {k: dict(v) for k, v in PRECISION[precision].items()}
    if zero:
        cfg["zero_optimization"] = {"stage": int(zero)}
    if grad_accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return cfg

from .common import check_ranges, emit, log, median, parser


def _rank(steps: int, warmup: int, layers: int, hidden: int, stages: int, micro_batch: int, grad_acc: int,
          seed: int, precision: str = "fp32", zero: int = 0, grad_accum_dtype: Optional[str] = None,
          rounds: int = 1, snapshots: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    import gc
    import time

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer, synthetic_batches

    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size() // stages
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]

    def batches(data):
        for x, y in data:
            yield x.to(dtype), y

    def build(init):
        torch.manual_seed(seed)
        model = PipelineModule(layers=mlp_layers(layers, hidden, 64, 10), num_stages=stages,
                               loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                               base_seed=seed)
        cfg = {"train_batch_size": micro_batch * grad_acc * dp, "train_micro_batch_size_per_gpu": micro_batch,
               "gradient_accumulation_steps": grad_acc, "steps_per_print": 10 ** 9,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               **mode_config(precision, zero, grad_accum_dtype)}
        if init is pdv_ext.initialize:
            cfg["pdv"] = {"aggregation": {"type": "mean"}, **({"snapshots": snapshots} if snapshots else {})}
        engine = init(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
        return engine, batches(synthetic_batches(64, 10, micro_batch, seed=seed + engine.grid.get_data_parallel_id()))

    times: Dict[str, List[float]] = {"vanilla": [], "pdv": []}
    snapshot_s: List[Dict[str, float]] = []
    losses: Dict[str, List[float]] = {"vanilla": [], "pdv": []}
    same_weights, info = True, {}
    per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    for rnd, n in enumerate(per_round):
        if n == 0:
            continue
        names = ("vanilla", "pdv") if rnd % 2 == 0 else ("pdv", "vanilla")  # neither is always built second
        built = {name: build(pdv_ext.initialize if name == "pdv" else deepspeed.initialize) for name in names}
        for i in range(warmup + n):
            order = [("vanilla", *built["vanilla"]), ("pdv", *built["pdv"])]
            if i % 2:
                order.reverse()  # neither engine always goes first
            for name, eng, data in order:
                dist.barrier()
                t0 = time.perf_counter()
                loss = eng.train_batch(data_iter=data)
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times[name].append(dt)
                    if name == "pdv" and getattr(eng, "pdv_snapshots", None) is not None and eng.pdv_snapshots.last:
                        snapshot_s.append(dict(eng.pdv_snapshots.last))
                        eng.pdv_snapshots.last = {}
                losses[name].append(float(loss))
        vanilla, pdv = built["vanilla"][0], built["pdv"][0]
        same_weights = same_weights and all(torch.equal(a, b) for a, b in zip(vanilla.module.parameters(),
                                                                              pdv.module.parameters()))
        info = {"engine": type(pdv).__name__, "optimizer": type(pdv.optimizer).__name__,
                "reduce_mode": getattr(pdv, "reduce_mode", None)}
        del built, vanilla, pdv, eng
        gc.collect()
    return {"times": times, "losses": losses, "same_weights": same_weights, "snapshot_s": snapshot_s, **info}


def snapshot_figures(res: List[Dict[str, Any]], every: int) -> Dict[str, Any]:
    """The snapshots' cost: the median over snapshots of the slowest rank's time (`snapshot_ms`) and of each
    rank-median part, slowest rank's (`snapshot_parts_ms`: collect, serialize, write, send, seal_wait), over
    the ranks that take part in them."""
    res = [r for r in res if r["snapshot_s"]]  # the ranks that write or copy (the other replicas take no part)
    n = min((len(r["snapshot_s"]) for r in res), default=0)
    if not n:
        return {"snapshots_every": every, "snapshot_ms": None}
    slowest = [max(res, key=lambda r: r["snapshot_s"][i]["seconds"])["snapshot_s"][i] for i in range(n)]
    parts = ("collect_s", "serialize_s", "write_s", "send_s", "seal_wait_s")
    return {"snapshots_every": every, "snapshot_ms": round(median([s["seconds"] for s in slowest]) * 1e3, 3),
            "snapshot_parts_ms": {p[:-2]: round(median([s[p] for s in slowest]) * 1e3, 3) for p in parts}}


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("engine", __doc__)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per engine (split over the rounds)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per engine in each round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds with fresh engines, the build order swapped each round (steps split over them)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--grad-acc", type=int, default=4)
    ap.add_argument("--precision", choices=sorted(PRECISION), default="fp32",
                    help="DeepSpeed's fp16/bf16 section for both engines (fp16 needs a GPU: not on CPU ranks)")
    ap.add_argument("--zero", type=int, choices=(0, 1), default=0,
                    help="zero_optimization.stage for both engines (pipelines allow 0 and 1)")
    ap.add_argument("--grad-accum-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="data_types.grad_accum_dtype (default: DeepSpeed's, the weights' dtype); bf16 + --zero 1 + "
                         "fp32 runs DeepSpeed's BF16_Optimizer instead of its ZeRO optimizer")
    ap.add_argument("--snapshots", type=int, default=0, metavar="EVERY",
                    help="pdv's engine also takes an in-memory snapshot every EVERY steps (pdv.snapshots, into a "
                         "temporary folder in host memory): `ratio` then includes their cost (default 0: none)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.layers, args.hidden = 4, 1, 6, 32
    check_ranges(ap, args, {"--steps": 1, "--warmup": 0, "--rounds": 1, "--ranks": 1, "--stages": 1, "--layers": 2,
                            "--hidden": 1,
                            "--micro-batch": 1, "--grad-acc": 1, "--snapshots": 0}, ["--timeout"])
    if args.ranks % args.stages:  # DeepSpeed's pipeline grid: stages x data-parallel replicas
        ap.error(f"--stages ({args.stages}) must divide --ranks ({args.ranks})")
    if args.precision == "fp16":  # the ranks run on CPU (gloo): DeepSpeed refuses fp16 there
        ap.error("--precision fp16: DeepSpeed has no fp16 on CPU (the bench runs its ranks on CPU with gloo); use "
                 "fp32 or bf16 here, and python -m pdv_ext.examples.train_gpt with an fp16 config on a GPU")
    from ..spawn import run_ranks

    log(f"[bench engine] {args.ranks} ranks, {args.stages} stages, {args.layers} layers x {args.hidden}, "
        f"{args.precision}, ZeRO stage {args.zero}, {args.steps} timed steps per engine (alternating)")
    snapshots, tmp = None, None
    if args.snapshots:
        import shutil
        import tempfile

        from ..recovery.config import default_root

        os.makedirs(default_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="bench-engine-", dir=default_root())
        snapshots = {"every": args.snapshots, "root": tmp, "job": "bench", "resume": False}
    try:
        res = run_ranks("pdv_ext.bench.engine:_rank", args.ranks,
                        dict(steps=args.steps, warmup=args.warmup, layers=args.layers, hidden=args.hidden,
                             stages=args.stages, micro_batch=args.micro_batch, grad_acc=args.grad_acc, seed=1234,
                             precision=args.precision, zero=args.zero, grad_accum_dtype=args.grad_accum_dtype,
                             rounds=args.rounds, snapshots=snapshots),
                        timeout=args.timeout)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    # a step's time is the slowest rank's
    step = {k: [max(r["times"][k][i] for r in res) for i in range(len(res[0]["times"][k]))] for k in ("vanilla", "pdv")}
    vanilla_ms, pdv_ms = median(step["vanilla"]) * 1e3, median(step["pdv"]) * 1e3
    loss_equal = all(r["losses"]["vanilla"] == r["losses"]["pdv"] and r["same_weights"] for r in res)
    mean_ratio = (sum(step["pdv"]) / len(step["pdv"])) / (sum(step["vanilla"]) / len(step["vanilla"]))
    emit({"vanilla_ms": round(vanilla_ms, 3), "pdv_ms": round(pdv_ms, 3), "ratio": round(pdv_ms / vanilla_ms, 4),
          "mean_ratio": round(mean_ratio, 4),
          "loss_equal": loss_equal, "ranks": args.ranks, "precision": args.precision, "zero": args.zero,
          "optimizer": res[0]["optimizer"],
          **(snapshot_figures(res, args.snapshots) if args.snapshots else {})}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
