"""A rank of the in-place recovery test (test_inplace_recovery.py), started directly (no launcher agent, so a
lost rank's peers are not restarted): an 8-layer MLP, pipe --pipe x data (world / pipe), in-memory snapshots
every step with `in_place`; the ranks --victims kill themselves (SIGKILL) before step --die-at. Each rank appends
JSON lines to --out/rank<R>.jsonl: every step's loss and the world it ran in, the recoveries, the held-out
loss at the end."""
import argparse
import json
import os
import signal

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--pipe", type=int, default=1)
    ap.add_argument("--victims", default="", help="ranks that kill themselves (comma-separated)")
    ap.add_argument("--die-at", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60, help="pdv.snapshots.timeout (the new world's too)")
    args = ap.parse_args()

    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    victims = {int(v) for v in args.victims.split(",") if v}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 32, generator=g)
    y = (x @ torch.randn(32, 10, generator=g)).argmax(-1)
    model = PipelineModule(layers=mlp_layers(8, 64, 32, 10), num_stages=args.pipe,
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer, base_seed=3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 12 // (world // args.pipe),
           "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "pdv": {"snapshots": {"root": args.root, "job": "inplace-test", "every": 1, "in_place": True,
                                 "timeout": args.timeout}}}
    if args.pipe > 1:  # each stage's replicas on one host (a host lost takes a stage's every replica)
        dp = world // args.pipe
        cfg["pdv"]["placement"] = {"boundaries": [round(8 * s / args.pipe) for s in range(args.pipe + 1)],
                                   "rank_mapping": [list(range(s * dp, (s + 1) * dp)) for s in range(args.pipe)]}
    engine = pdv_ext.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))[0]
    data = ElasticBatches.for_engine(engine, (x[:-256], y[:-256]), seed=11)
    with open(os.path.join(args.out, f"rank{rank}.jsonl"), "a", encoding="utf-8") as log:
        while engine.global_steps < args.steps:
            if rank in victims and engine.global_steps + 1 == args.die_at:
                engine.pdv_snapshots.wait()  # the snapshot of the step before is sealed: a clean loss
                os.kill(os.getpid(), signal.SIGKILL)
            loss = float(engine.train_batch(data_iter=data))
            log.write(json.dumps({"step": int(engine.global_steps), "loss": loss, "world": dist.get_world_size(),
                                  "rank": dist.get_rank()}) + "\n")
            log.flush()
        rec = engine.pdv_runtime.in_place.recoveries
        held = ElasticBatches.for_engine(engine, (x[-256:], y[-256:]), seed=0)
        losses = [float(engine.eval_batch(data_iter=held)) for _ in range(2)]
        log.write(json.dumps({"recoveries": rec, "held_out": sum(losses) / len(losses)}, default=str) + "\n")
    engine.discard_snapshots()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
