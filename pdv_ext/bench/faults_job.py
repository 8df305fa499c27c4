"""The training job `pdv bench faults` runs under torchrun (one worker per device): an 8-layer MLP as a 2-stage
pipeline, pipe 2 x data world/2, with in-memory snapshots (`--mode snapshots`) or disk checkpoints every
`--ckpt-every` steps (`--mode disk`, what a user has without pdv's snapshots). It goes on from wherever its state
was left: the snapshots (pdv's start-up, after a torchrun restart), or the newest disk checkpoint. Each worker
appends JSON lines to --out/<host>-rank<R>.jsonl: its start (attempt, world, the step it starts from, when the
process started, how long start-up and the resume took), every step (loss, time), and at the end the
held-out loss."""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, List

T_PROCESS = time.time()

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", required=True, help="snapshots' root (mode snapshots) or checkpoint folder (disk)")
    ap.add_argument("--mode", choices=["snapshots", "disk", "none"], default="snapshots")
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--save-at", type=int, default=0, help="also write a disk checkpoint at this step and stop")
    ap.add_argument("--load", default="", help="start from this disk checkpoint folder (its 'latest')")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--host-tag", default="", help="(marks a host's processes for the bench)")
    ap.add_argument("--pipe", type=int, default=2, help="pipeline stages (the rest of the world: replicas)")
    ap.add_argument("--layout", choices=LAYOUTS, default="stages",
                    help="where the replicas run: pipelines (each host runs whole pipelines, a stage's replicas on "
                         "different hosts) or stages (a stage's replicas side by side on one host, DeepSpeed's "
                         "rank order); by the devices' hosts, whatever order the ranks came in")
    ap.add_argument("--every", default="1", help="snapshots: steps between them, or auto")
    ap.add_argument("--in-place", action="store_true",
                    help="snapshots: recover in place (pdv.snapshots.in_place): the survivors go on in their "
                         "processes; a start record marks each recovery")
    ap.add_argument("--pg-timeout", type=float, default=0.0,
                    help="the process group's timeout in seconds (0: DeepSpeed's; a silent peer is noticed then)")
    args = ap.parse_args()

    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.emulate.events import mark_step
    from pdv_ext.models import mlp_layers, seed_layer
    from pdv_ext.policy.data import ElasticBatches

    if args.pg_timeout:
        from datetime import timedelta

        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=args.pg_timeout))
    else:
        deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // args.pipe
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(-1)
    held_x, held_y = x[-512:], y[-512:]
    model = PipelineModule(layers=mlp_layers(8, args.hidden, 64, 10), num_stages=args.pipe,
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer, base_seed=3)
    bounds = [round(8 * s / args.pipe) for s in range(args.pipe + 1)]
    pdv = {"placement": {"boundaries": bounds, "rank_mapping": layout_mapping(args.pipe, args.layout)}}
    if args.mode == "snapshots":
        pdv["snapshots"] = {"root": args.root, "job": "bench-faults",
                            "every": args.every if args.every == "auto" else int(args.every),
                            "in_place": args.in_place}
    # 96 samples a step: 12 micro-batches over the replicas, whether 4, 3, 2 or 1 are left
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 12 // dp, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "gradient_clipping": 1.0,
           "pdv": pdv}
    engine = pdv_ext.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))[0]
    t_ready = time.time()
    data = ElasticBatches.for_engine(engine, (x[:-512], y[:-512]), seed=11)
    t_resume = 0.0
    if args.mode == "disk" or args.load:
        t0 = time.time()
        folder = args.load or args.root
        engine.load_checkpoint(folder, missing_ok=True)
        t_resume = time.time() - t0
    elif engine.pdv_snapshots is not None:  # the resume ran inside initialize: the start-up ends before it
        t_resume = engine.pdv_snapshots.resumed.get("seconds", 0.0)
        t_ready -= t_resume
    host = os.environ.get("PDV_HOST", "h")
    # a log per device under `pdv emulate` (ranks follow torchrun's rendezvous there), else per host and rank
    name = os.environ.get("PDV_DEVICE_NAME") if os.environ.get("PDV_EMULATION") else None
    attempt = _attempt(args.out, name) if name else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    last = args.save_at or args.steps
    with open(os.path.join(args.out, f"{name or f'{host}-rank{rank}'}.jsonl"), "a", encoding="utf-8") as log:
        log.write(json.dumps({"attempt": attempt, "world": world, "start": int(engine.global_steps),
                              "t_process": T_PROCESS, "t_ready": t_ready, "resume_s": t_resume,
                              "master": [os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", 0))]})
                  + "\n")
        mark_step(int(engine.global_steps))  # under `pdv emulate`, events placed at_step count these steps
        recovered = 0
        while engine.global_steps < last:
            loss = float(engine.train_batch(data_iter=data))
            t_step = time.time()
            ip = engine.pdv_runtime.in_place
            for r in (ip.recoveries[recovered:] if ip is not None else []):  # recovered in place in that step
                attempt, recovered = attempt + 1, recovered + 1
                log.write(json.dumps({"attempt": attempt, "world": r["world"], "start": r["step"], "in_place": True,
                                      "t_process": r["t_start"], "t_ready": r["t_ready"], "resume_s": r["resume_s"],
                                      "parts": {k: round(r[k], 4) for k in ("agree_s", "group_s", "engine_s",
                                                                            "resume_s", "commit_s")}}) + "\n")
            rec = {"attempt": attempt, "step": int(engine.global_steps), "loss": loss, "t": t_step}
            if engine.pdv_snapshots is not None and engine.pdv_snapshots.last:  # the previous snapshot's parts
                rec["snapshot"] = {k: round(v, 4) for k, v in engine.pdv_snapshots.last.items()}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            step = int(engine.global_steps)
            mark_step(step)
            if args.mode == "disk" and step % args.ckpt_every == 0:
                engine.save_checkpoint(args.root)
            time.sleep(args.sleep)
        if args.save_at:
            engine.save_checkpoint(args.root, tag="switch")
        held = ElasticBatches.for_engine(engine, (held_x, held_y), seed=0)
        losses = [float(engine.eval_batch(data_iter=held)) for _ in range(4)]
        log.write(json.dumps({"attempt": attempt, "held_out": sum(losses) / len(losses)}) + "\n")
    engine.discard_snapshots()
    dist.barrier()
    dist.destroy_process_group()


#: `--layout`: where a stage's replicas run (see its help)
LAYOUTS = ("pipelines", "stages")


def layout_mapping(pipe: int, layout: str) -> List[List[int]]:
    """(collective) The rank mapping of `layout` over the ranks' hosts (PDV_HOST) and devices (PDV_DEVICE_NAME):
    under torchrun's elastic agents ranks come in rendezvous order, so a mapping by rank alone would put a
    stage's replicas on one host in one run and on two in the next (an in-memory snapshot of a stage all of
    whose replicas share a host crosses the link between hosts; otherwise it does not)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    at: List[Any] = [None] * world
    dist.all_gather_object(at, (os.environ.get("PDV_HOST", ""), os.environ.get("PDV_DEVICE_NAME", ""), dist.get_rank()))
    return arrange([r for *_, r in sorted(at)], pipe, layout)  # by host, then device; by rank without either


def arrange(order: List[Any], pipe: int, layout: str) -> List[List[Any]]:
    """`order` (ranks or device names, host by host) as `pipe` stages of replicas laid out as `layout` says."""
    dp = len(order) // pipe
    if layout == "pipelines":
        return [[order[r * pipe + s] for r in range(dp)] for s in range(pipe)]
    return [order[s * dp:(s + 1) * dp] for s in range(pipe)]


def _attempt(out: str, name: str) -> int:
    """This device's start count (its log's start lines): under `pdv emulate` an agent restarted for a new
    membership keeps its TORCHELASTIC_RESTART_COUNT, so that count does not number the attempts."""
    try:
        with open(os.path.join(out, f"{name}.jsonl"), encoding="utf-8") as f:
            return sum(1 for line in f if '"start"' in line)
    except OSError:
        return 0


if __name__ == "__main__":
    main()
