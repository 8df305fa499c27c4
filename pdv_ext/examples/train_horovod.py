"""Horovod example: a digits classifier trained with pdv_ext's aggregators and policies under horovodrun.

    horovodrun -np 4 -H localhost:4 --gloo python -m pdv_ext.examples.train_horovod --config configs/horovod.yaml
    (`pdv example train_horovod DIR` copies this script and configs/horovod.yaml into DIR)

The only change to a plain Horovod script is the optimizer line (`pdv_ext.horovod.DistributedOptimizer`
with `aggregation=`) plus, optionally, a `PolicyHook` that runs the `pdv.policy` plugins after each step.
Data: scikit-learn's 8x8 digits (ships with the package), 25% held out. Each rank reads its share of
one shuffled stream (`ElasticBatches`), so batch-size changes lose or repeat no sample. Rank 0 prints
progress and held-out accuracy; the Monitor writes metrics.csv to `pdv.policy.monitor.output_dir`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from pdv_ext.config import split_config
from pdv_ext.user_errors import exit_on_config_error


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML/JSON holding the pdv section (top level or under 'pdv')")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="summary.json folder (default: the monitor's output_dir)")
    return ap.parse_args(argv)


def evaluate(model, x, y):
    with torch.no_grad():
        logits = model(x)
        return float(F.cross_entropy(logits, y)), float((logits.argmax(-1) == y).float().mean())


@exit_on_config_error  # a bad config: its lines once (rank 0), exit status 2 on every rank, no traceback
def main(argv=None) -> int:
    args = parse_args(argv)
    _, pdv = split_config(args.config)  # before any collective
    import horovod.torch as hvd

    import pdv_ext.horovod as pdv_hvd
    from pdv_ext.models import digits_data
    from pdv_ext.policy.data import ElasticBatches

    hvd.init()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = digits_data(seed=args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 10))
    x_val, y_val = x_tr[:64], y_tr[:64]  # trusted validation batch (zeno scores candidates against it)
    optimizer = pdv_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), named_parameters=model.named_parameters(),
        aggregation=pdv.aggregation, validation_loss=lambda: F.cross_entropy(model(x_val), y_val),
        faults=pdv.faults)
    data = ElasticBatches((x_tr, y_tr), args.micro_batch_size, hvd.rank(), hvd.size(), seed=args.seed)
    hook = pdv_hvd.PolicyHook(optimizer, pdv, micro_batch_size=args.micro_batch_size, data=data)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    rank0 = hvd.rank() == 0
    if rank0:
        print(f"[horovod] {hvd.size()} ranks, aggregation={optimizer.aggregator!r}, "
              f"policies={[p.get('name') for p in pdv.policy.plugins]}", flush=True)
    t0 = time.time()
    for step in range(args.steps):
        optimizer.zero_grad()
        for _ in range(hook.micro_batches):
            x, y = next(data)
            if optimizer.pdv_faults is not None:  # pdv.faults label_flip: Byzantine ranks train on flipped labels
                y = optimizer.pdv_faults.flip_labels(y, optimizer.global_steps)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()
        m = hook.after_step(loss.item())
        if rank0 and (step % 10 == 0 or m.get("actions")):
            print(f"step {step:4d} loss {m['loss']:.4f} batch {m['batch_size']:4d} "
                  f"samples/s {m['samples_per_s']:8.0f} gns {m.get('gns') or float('nan'):8.2f} "
                  f"agg {optimizer.aggregator.name}" + (f" actions {m['actions']}" if m.get("actions") else ""),
                  flush=True)
        if rank0 and args.eval_every and (step + 1) % args.eval_every == 0:
            val_loss, acc = evaluate(model, x_te, y_te)
            hook.monitor.update_last(val_loss=val_loss, val_accuracy=acc)
            print(f"step {step:4d} held-out loss {val_loss:.4f} accuracy {acc:.3f}", flush=True)
    val_loss, acc = evaluate(model, x_te, y_te)
    hook.close()
    summary = {"ranks": hvd.size(), "steps": args.steps, "samples": hook.monitor.samples,
               "final_loss": hook.last_metrics.get("loss"), "held_out_loss": val_loss, "held_out_accuracy": acc,
               "aggregator": optimizer.aggregator.name, "batch_size": hook.last_metrics.get("batch_size"),
               "actions": hook.runner.action_log if hook.runner else [], "seconds": time.time() - t0}
    out = args.out or pdv.policy.monitor.output_dir
    if rank0:
        print(f"[horovod] done: held-out accuracy {acc:.3f}, loss {val_loss:.4f}, {summary['samples']} samples "
              f"in {summary['seconds']:.1f}s", flush=True)
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1, default=str)
    hvd.barrier()  # Horovod stops the job when one rank leaves early
    return 0


if __name__ == "__main__":
    sys.exit(main())
