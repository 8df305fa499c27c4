"""`pdv bench engine`: vanilla DeepSpeed PipelineEngine vs PDVPipelineEngine + `mean`, in one run.

Both engines are built in the same 4 ranks from identically seeded models and fed identical data; their
train_batch calls alternate (vanilla, pdv, vanilla, ...) so machine noise hits both alike. Reports the
median step of each, their ratio and whether every step's loss (and the final weights) matched exactly.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

from .common import check_ranges, emit, log, median, parser


def _rank(steps: int, warmup: int, layers: int, hidden: int, stages: int, micro_batch: int, grad_acc: int,
          seed: int) -> Dict[str, Any]:
    import time

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer, synthetic_batches

    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size() // stages

    def build(init):
        torch.manual_seed(seed)
        model = PipelineModule(layers=mlp_layers(layers, hidden, 64, 10), num_stages=stages,
                               loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                               base_seed=seed)
        cfg = {"train_batch_size": micro_batch * grad_acc * dp, "train_micro_batch_size_per_gpu": micro_batch,
               "gradient_accumulation_steps": grad_acc, "steps_per_print": 10 ** 9,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        if init is pdv_ext.initialize:
            cfg["pdv"] = {"aggregation": {"type": "mean"}}
        engine = init(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
        return engine, synthetic_batches(64, 10, micro_batch, seed=seed + engine.grid.get_data_parallel_id())

    vanilla, vdata = build(deepspeed.initialize)
    pdv, pdata = build(pdv_ext.initialize)
    times: Dict[str, List[float]] = {"vanilla": [], "pdv": []}
    losses: Dict[str, List[float]] = {"vanilla": [], "pdv": []}
    for i in range(warmup + steps):
        order = [("vanilla", vanilla, vdata), ("pdv", pdv, pdata)]
        if i % 2:
            order.reverse()  # neither engine always goes first
        for name, eng, data in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = eng.train_batch(data_iter=data)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
            losses[name].append(float(loss))
    same_weights = all(torch.equal(a, b) for a, b in zip(vanilla.module.parameters(), pdv.module.parameters()))
    return {"times": times, "losses": losses, "same_weights": same_weights, "engine": type(pdv).__name__}


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("engine", __doc__)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per engine")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--grad-acc", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.layers, args.hidden = 4, 1, 6, 32
    check_ranges(ap, args, {"--steps": 1, "--warmup": 0, "--ranks": 1, "--stages": 1, "--layers": 2, "--hidden": 1,
                            "--micro-batch": 1, "--grad-acc": 1}, ["--timeout"])
    if args.ranks % args.stages:  # DeepSpeed's pipeline grid: stages x data-parallel replicas
        ap.error(f"--stages ({args.stages}) must divide --ranks ({args.ranks})")
    from ..spawn import run_ranks

    log(f"[bench engine] {args.ranks} ranks, {args.stages} stages, {args.layers} layers x {args.hidden}, "
        f"{args.steps} timed steps per engine (alternating)")
    res = run_ranks("pdv_ext.bench.engine:_rank", args.ranks,
                    dict(steps=args.steps, warmup=args.warmup, layers=args.layers, hidden=args.hidden,
                         stages=args.stages, micro_batch=args.micro_batch, grad_acc=args.grad_acc, seed=1234),
                    timeout=args.timeout)
    # a step's time is the slowest rank's
    step = {k: [max(r["times"][k][i] for r in res) for i in range(len(res[0]["times"][k]))] for k in ("vanilla", "pdv")}
    vanilla_ms, pdv_ms = median(step["vanilla"]) * 1e3, median(step["pdv"]) * 1e3
    loss_equal = all(r["losses"]["vanilla"] == r["losses"]["pdv"] and r["same_weights"] for r in res)
    emit({"vanilla_ms": round(vanilla_ms, 3), "pdv_ms": round(pdv_ms, 3), "ratio": round(pdv_ms / vanilla_ms, 4),
          "loss_equal": loss_equal, "ranks": args.ranks}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
