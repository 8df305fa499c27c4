"""Main job: a byte-level GPT trained with pipeline + data parallelism through pdv_ext.

    deepspeed --num_gpus 4 launch/train_gpt.py --deepspeed_config launch/configs/demo.json --out runs/demo

4 ranks = 2 pipeline stages x 2 data-parallel replicas (`--stages`). The text is CPython's own
documentation (`pydoc_data.topics`, ships with Python); the last 10% is held out. Rank 0 prints
progress (step, loss, tokens/s), evaluates held-out loss, and writes `metrics.csv` and a loss plot.
"""
from __future__ import annotations

import argparse
import csv
import os
import time

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import pdv_ext
from pdv_ext.models import ByteWindows, gpt_layers, lm_loss, seed_layer, text_splits


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/demo", help="folder for metrics.csv and plots")
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model = PipelineModule(layers=gpt_layers(args.layers, args.hidden, args.heads, args.seq_len),
                           num_stages=args.stages, loss_fn=lm_loss, seed_layers=True, seed_fn=seed_layer,
                           base_seed=args.seed, partition_method="parameters")
    engine, _, _, _ = pdv_ext.initialize(args=args, model=model,
                                         model_parameters=[p for p in model.parameters() if p.requires_grad])
    rank = torch.distributed.get_rank()
    train_text, held_text = text_splits()
    micro = engine.train_micro_batch_size_per_gpu()
    dp_id = engine.grid.get_data_parallel_id()
    train = ByteWindows(train_text, args.seq_len, micro, seed=args.seed * 100 + dp_id)
    held = ByteWindows(held_text, args.seq_len, micro, seed=999)

    def evaluate() -> float:
        held.position = 0  # the same held-out windows every time
        losses = [float(engine.eval_batch(data_iter=held)) for _ in range(args.eval_batches)]
        return sum(losses) / len(losses)

    os.makedirs(args.out, exist_ok=True)
    rows = []
    tokens_per_step = engine.train_batch_size() * args.seq_len
    if rank == 0:
        print(f"[demo] {engine.__class__.__name__}: stages={engine.num_stages} dp={engine.dp_world_size} "
              f"aggregator={getattr(engine, 'aggregator', None)} tokens/step={tokens_per_step}", flush=True)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = float(engine.train_batch(data_iter=train))
        dt = time.perf_counter() - t0
        row = {"step": step, "loss": loss, "step_time_ms": dt * 1e3, "tokens_per_s": tokens_per_step / dt,
               "lr": engine.get_lr()[0], "eval_loss": ""}
        if step % args.eval_every == 0 or step == args.steps:
            row["eval_loss"] = evaluate()
        rows.append(row)
        if rank == 0 and (step % 10 == 0 or row["eval_loss"] != "" or step == 1):
            extra = f" held-out {row['eval_loss']:.3f}" if row["eval_loss"] != "" else ""
            print(f"[demo] step {step:4d}/{args.steps} loss {loss:.3f}{extra} "
                  f"{row['tokens_per_s']:8.0f} tok/s {row['step_time_ms']:6.0f} ms/step", flush=True)
    if rank == 0:
        path = os.path.join(args.out, "metrics.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        final = rows[-1]["eval_loss"]
        print(f"[demo] done in {time.perf_counter() - start:.0f}s: held-out loss {final:.3f} nats/byte "
              f"({final / 0.6931:.2f} bits/byte); metrics in {path}", flush=True)


if __name__ == "__main__":
    main()
