"""Main job: a byte-level GPT trained with pipeline + data parallelism through pdv_ext.

    deepspeed --num_gpus 4 --module pdv_ext.examples.train_gpt --steps 20      # the shipped demo config
    deepspeed --num_gpus 4 train_gpt.py --deepspeed_config configs/demo.json   # after `pdv example train_gpt DIR`

Without `--deepspeed_config` it runs the shipped `configs/demo.json` (`pdv_ext/examples/configs/`).
On CPU set OMP_NUM_THREADS=1 and DS_ACCELERATOR=cpu; the first launch on a machine waits a minute or two
while DeepSpeed builds its ops, without printing anything.

4 ranks = 2 pipeline stages x 2 data-parallel replicas (`--stages`). The text is CPython's own
documentation (`pydoc_data.topics`, ships with Python); the last 10% is held out. Rank 0 prints
progress (step, loss, tokens/s), evaluates held-out loss, and writes `metrics.csv` and a loss plot.

`--import MODULE` (repeatable; a module name or a .py file) imports your plug-ins first, so that the names
they register (`@register_policy("halve_lr_on_plateau")`, ...) can be used in the config. A bad config
stops every rank before any process group starts, with its problems printed once (rank 0), exit status 2.
"""
from __future__ import annotations

import argparse
import os
import signal
import time

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

import pdv_ext
from pdv_ext.emulate.events import mark_step
from pdv_ext.models import ByteWindows, gpt_layers, lm_loss, seed_layer, text_splits
from pdv_ext.registry import RegistryError, import_user_modules


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
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                    help="import this module or .py file first (plug-ins registered by name; repeatable)")
    ap.add_argument("--crash-at", type=int, default=0, metavar="STEP",
                    help="simulate a lost device: in the job's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT "
                         "0) rank --crash-rank exits abruptly after step STEP (docs/recovery.md; default 0: never)")
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    ap = deepspeed.add_config_arguments(ap)
    args = ap.parse_args()
    if args.deepspeed_config is None:  # the shipped demo config (pdv_ext/examples/configs/demo.json)
        args.deepspeed_config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo.json")
    return args


@pdv_ext.exit_on_config_error
def main() -> None:
    args = parse_args()
    try:
        import_user_modules(args.imports)
    except RegistryError as exc:
        raise pdv_ext.ConfigError([f"--import: {exc}"]) from exc
    if args.deepspeed_config:  # every rank checks it before any process group starts: a typo fails in seconds
        pdv_ext.load_pdv(args.deepspeed_config)
    torch.manual_seed(args.seed)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    model = PipelineModule(layers=gpt_layers(args.layers, args.hidden, args.heads, args.seq_len),
                           num_stages=args.stages, loss_fn=lm_loss, seed_layers=True, seed_fn=seed_layer,
                           base_seed=args.seed, partition_method="parameters")
    probe_data = ByteWindows(text_splits()[0], args.seq_len, 8, seed=args.seed * 100 + 50 + int(os.environ.get("RANK", 0)))
    engine, _, _, _ = pdv_ext.initialize(args=args, model=model,
                                         model_parameters=[p for p in model.parameters() if p.requires_grad],
                                         init_search_iter=probe_data)  # used when pdv.init_search is enabled
    rank = torch.distributed.get_rank()
    train_text, held_text = text_splits()
    micro = engine.train_micro_batch_size_per_gpu()
    dp_id = engine.grid.get_data_parallel_id()
    train = ByteWindows(train_text, args.seq_len, micro, seed=args.seed * 100 + dp_id)
    held = ByteWindows(held_text, args.seq_len, micro, seed=999)

    def evaluate() -> float:
        held.position = 0  # the same held-out windows every time
        losses = [float(engine.eval_batch(data_iter=held, num_micro_batches=4)) for _ in range(args.eval_batches)]
        return sum(losses) / len(losses)

    os.makedirs(args.out, exist_ok=True)
    glue = engine.pdv_policy  # pdv.policy in the config: the Monitor (+ gns_batch_size) — see docs/policy.md
    if glue is not None:
        glue.monitor.open(args.out)  # rank 0 writes metrics.csv there
    if rank == 0:
        print(f"[demo] {engine.__class__.__name__}: stages={engine.num_stages} dp={engine.dp_world_size} "
              f"aggregator={getattr(engine, 'aggregator', None)} tokens/step={engine.train_batch_size() * args.seq_len}",
              flush=True)
    start = time.perf_counter()
    final = float("nan")
    first = int(engine.global_steps) + 1  # after a restart resumed from pdv.snapshots, where it left off
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0 and first > 1:
        print(f"[demo] attempt {attempt}: resumed at step {first - 1}", flush=True)
    mark_step(first - 1)  # under `pdv emulate`, events placed `at_step` count these steps (a no-op elsewhere)
    for step in range(first, args.steps + 1):
        t0 = time.perf_counter()
        loss = float(engine.train_batch(data_iter=train))
        if args.crash_at and step == args.crash_at and attempt == 0 and rank == args.crash_rank:
            if engine.pdv_snapshots is not None:  # lost right after the snapshot of this step is sealed here
                engine.pdv_snapshots.wait_sealed(step)
            print(f"[demo] rank {rank}: simulated loss of this device after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no goodbye: as a process on a lost device
        mark_step(step)
        m = glue.last_metrics if glue is not None else {"step_time": time.perf_counter() - t0}
        eval_loss = None
        if step % args.eval_every == 0 or step == args.steps:
            eval_loss = final = evaluate()
            if glue is not None:
                glue.monitor.update_last(val_loss=eval_loss)
        if rank == 0 and (step % 10 == 0 or eval_loss is not None or step == 1):
            extra = f" held-out {eval_loss:.3f}" if eval_loss is not None else ""
            gns = f" gns {m['gns']:.0f}" if m.get("gns") is not None else ""
            print(f"[demo] step {step:4d}/{args.steps} loss {loss:.3f}{extra} batch {engine.train_batch_size()}{gns} "
                  f"{engine.train_batch_size() * args.seq_len / m['step_time']:8.0f} tok/s "
                  f"{m['step_time'] * 1e3:6.0f} ms/step", flush=True)
    if glue is not None:
        glue.close()
    engine.discard_snapshots()  # pdv.snapshots: they served restarts; free the hosts' memory
    if rank == 0:
        path = os.path.join(args.out, "metrics.csv")
        print(f"[demo] done in {time.perf_counter() - start:.0f}s: held-out loss {final:.3f} nats/byte "
              f"({final / 0.6931:.2f} bits/byte); metrics in {path}", flush=True)
    torch.distributed.barrier()  # leave together, then tear gloo down while the interpreter is fully alive
    torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
