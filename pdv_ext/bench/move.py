"""`pdv bench move`: what moving a running pipeline costs, against the step time of the same run.

The demo model (`launch/train_gpt.py`'s byte-level GPT: embedding, 4 blocks, head; the demo config's
AdamW, WarmupLR and clipping) trains on 4 CPU ranks under DeepSpeed's default plan (pipe 2 x data 2,
`partition_method: parameters`), is moved in the same processes to `--boundaries` / `--rank-mapping`
(default: pipe 4 x data 1), trains on, and is moved back. Reports each move's wall time (slowest rank),
bytes sent rank to rank and bytes reassembled from partitions (bf16), beside the median step time under
each plan, and the move's cost in steps (`move_steps`: seconds / the median step before it). Steps after
a move are checked to continue the loss: both moves must keep training on the same global batch.
`checkpoint_bytes`: a checkpoint saved before the first move, by kind (DeepSpeed's own files, pdv's
per-rank state, the layer-keyed form that any plan can load).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional

from .common import check_ranges, emit, log, median, parser


def _sizes(folder: str) -> Dict[str, int]:
    """Bytes of a checkpoint tag folder: DeepSpeed's files, pdv's per-rank state, the layer-keyed form."""
    out = {"deepspeed": 0, "pdv_state": 0, "pdv_layers": 0}
    for root, _, files in os.walk(folder):
        for f in files:
            kind = ("pdv_layers" if os.path.basename(root) == "pdv_layers" else
                    "pdv_state" if f.startswith("pdv_state_rank") else "deepspeed")
            out[kind] += os.path.getsize(os.path.join(root, f))
    return out


def _rank(boundaries: List[int], rank_mapping: List[List[int]], steps: int, warmup: int, precision: str,
          micro_batch: int, grad_acc: int, layers: int, hidden: int, seq_len: int, seed: int,
          ckpt_dir: str) -> Dict[str, Any]:
    import time

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import TextWindows, gpt_layers, lm_loss, seed_layer, text_splits
    from pdv_ext.integrations.deepspeed.checkpoint import plan_of
    from pdv_ext.integrations.deepspeed.move import move_engine
    from pdv_ext.policy.data import ElasticBatches

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = PipelineModule(layers=gpt_layers(layers, hidden, 4, seq_len), num_stages=2, loss_fn=lm_loss,
                           seed_layers=True, seed_fn=seed_layer, base_seed=seed, partition_method="parameters")
    dp = dist.get_world_size() // 2
    cfg = {"train_batch_size": micro_batch * grad_acc * dp, "train_micro_batch_size_per_gpu": micro_batch,
           "gradient_accumulation_steps": grad_acc, "steps_per_print": 10 ** 9, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                      "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                                                        "warmup_num_steps": 30}},
           "pdv": {"aggregation": {"type": "mean"}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = pdv_ext.initialize(model=model, config=cfg, model_parameters=[p for p in model.parameters()])[0]
    data = ElasticBatches.for_engine(engine, TextWindows(text_splits()[0], seq_len), seed=seed)
    first = plan_of(engine)  # DeepSpeed's own partition ("parameters") on its default placement

    def run(n: int) -> Dict[str, List[float]]:
        times, losses = [], []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            losses.append(float(engine.train_batch(data_iter=data)))
            times.append(time.perf_counter() - t0)
        return {"times": times[warmup:], "losses": losses}

    out: Dict[str, Any] = {"plan_a": first, "a": run(warmup + steps)}
    engine.save_checkpoint(ckpt_dir, tag="a")  # what a checkpoint holds, by kind of file
    dist.barrier()
    out["checkpoint_bytes"] = _sizes(os.path.join(ckpt_dir, "a"))
    out["move_there"] = move_engine(engine, boundaries, rank_mapping).to_dict()
    out["b"] = run(warmup + steps)
    dist.barrier()
    out["move_back"] = move_engine(engine, first["boundaries"], first["rank_mapping"]).to_dict()
    out["a2"] = run(warmup + steps)
    out["params"] = {n: p.numel() for n, p in engine.module.named_parameters()}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("move", __doc__)
    ap.add_argument("--boundaries", default="[0, 2, 3, 4, 6]", help="JSON list: stage boundaries to move to")
    ap.add_argument("--rank-mapping", default="[[0], [1], [2], [3]]",
                    help="JSON list of lists: [stage][replica] -> rank to move to")
    ap.add_argument("--steps", type=int, default=8, help="timed steps under each plan")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after start-up and after each move")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--grad-acc", type=int, default=4, help="micro-batches per replica under pipe 2 x data 2")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.hidden, args.seq_len = 2, 1, 32, 16
    check_ranges(ap, args, {"--steps": 1, "--warmup": 0, "--micro-batch": 1, "--grad-acc": 1, "--layers": 1,
                            "--hidden": 4, "--seq-len": 2}, ["--timeout"])
    try:
        boundaries, mapping = json.loads(args.boundaries), json.loads(args.rank_mapping)
    except json.JSONDecodeError as exc:
        ap.error(f"--boundaries / --rank-mapping: not JSON ({exc})")
    ranks = sum(len(r) for r in mapping) if isinstance(mapping, list) and all(isinstance(r, list) for r in mapping) else 0
    if ranks != 4:
        ap.error(f"--rank-mapping: must place the bench's 4 ranks (got {args.rank_mapping})")
    if not (isinstance(boundaries, list) and len(boundaries) == len(mapping) + 1 and boundaries[0] == 0
            and boundaries[-1] == args.layers + 2):
        ap.error(f"--boundaries: {len(mapping) + 1} values from 0 to {args.layers + 2} (the model's layers: "
                 f"embedding, {args.layers} blocks, head) expected, got {args.boundaries}")
    from ..spawn import run_ranks

    log(f"[bench move] demo GPT ({args.layers} blocks x {args.hidden}) on 4 ranks, {args.precision}: pipe 2 x data 2 "
        f"-> {boundaries} on {mapping} -> back")
    with tempfile.TemporaryDirectory(prefix="pdv-bench-move-") as ckpt:
        res = run_ranks("pdv_ext.bench.move:_rank", 4,
                        dict(boundaries=boundaries, rank_mapping=mapping, steps=args.steps, warmup=args.warmup,
                             precision=args.precision, micro_batch=args.micro_batch, grad_acc=args.grad_acc,
                             layers=args.layers, hidden=args.hidden, seq_len=args.seq_len, seed=1234,
                             ckpt_dir=ckpt), timeout=args.timeout)
    step = {k: median([max(r[k]["times"][i] for r in res) for i in range(len(res[0][k]["times"]))])
            for k in ("a", "b", "a2")}  # a step's time is the slowest rank's
    there, back = res[0]["move_there"], res[0]["move_back"]
    losses = [res[0][k]["losses"] for k in ("a", "b", "a2")]
    continued = all(abs(nxt[0] - prev[-1]) < 0.5 for prev, nxt in zip(losses, losses[1:]))
    emit({"step_ms_before": round(step["a"] * 1e3, 1), "move_ms": round(there["seconds"] * 1e3, 1),
          "move_bytes": there["bytes_moved"], "bytes_gathered": there["bytes_gathered"],
          "move_steps": round(there["seconds"] / step["a"], 2), "step_ms_after": round(step["b"] * 1e3, 1),
          "move_back_ms": round(back["seconds"] * 1e3, 1), "move_back_bytes": back["bytes_moved"],
          "move_back_steps": round(back["seconds"] / step["b"], 2), "step_ms_back": round(step["a2"] * 1e3, 1),
          "phases_ms": {k: round(v * 1e3, 1) for k, v in there["phases"].items()},
          "from": there["old_plan"], "to": there["new_plan"], "params": sum({n: k for r in res for n, k in r["params"].items()}.values()),
          "precision": args.precision, "checkpoint_bytes": res[0]["checkpoint_bytes"], "loss_continued": continued,
          "loss": [round(losses[0][-1], 4), round(losses[1][0], 4), round(losses[2][-1], 4)]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
