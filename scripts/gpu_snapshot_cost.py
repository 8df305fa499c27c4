"""What a snapshot costs the step on a GPU (issue #37, "what it costs on GPUs"): the time of `Keeper.stage` (the
only snapshot work on the step's path: queued copies of a stage's state from the device into the keeper's
shared, page-locked buffer, one synchronisation) for states of several sizes, beside a plain device-to-host copy
of the same bytes into a torch pinned tensor, measured in the same run (the baseline: what the link gives).
The keeper's own write (hashing, the peer copy) runs in its process, off the step, and is timed apart.
Prints one JSON line; medians of --rounds.

    python scripts/gpu_snapshot_cost.py [--mb 64 512 2048] [--rounds 5] [--device cuda]
"""
import argparse
import json
import statistics
import tempfile
import time

import torch

from pdv_ext.bench.kernels import gpt_like_sizes
from pdv_ext.recovery.keeper import Keeper


def state_of(mb: float, dev: str) -> dict:
    """A stage's state as the move carries it: bf16 weights, fp32 masters and two fp32 Adam moments, in GPT-shaped
    tensors (bf16 = 2 bytes and 3 x fp32 = 12 bytes per parameter: 14 bytes, so mb / 14 M parameters)."""
    n = int(mb * 2 ** 20 / 14)
    sizes = gpt_like_sizes(n)
    g = torch.Generator(device=dev).manual_seed(0)
    flat = torch.randn(n, device=dev, generator=g)
    return {f"layer_{i:02d}.pt": {"w": t.bfloat16(), "master": t.clone(), "exp_avg": t * 0.1, "exp_avg_sq": t * t}
            for i, t in enumerate(flat.split(sizes))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[64.0, 512.0, 2048.0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            ap.error("no CUDA device here")
        torch.cuda.init()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    k = Keeper()
    try:
        for mb in args.mb:
            state = state_of(mb, args.device)
            tensors = [t for d in state.values() for t in d.values()]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
            stage_s, copy_s, write_s = [], [], []
            for _ in range(args.rounds):
                sync()
                t0 = time.perf_counter()
                for p, t in zip(pinned, tensors):
                    p.copy_(t, non_blocking=cuda)
                sync()
                copy_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                flat, layout = k.stage(state)
                stage_s.append(time.perf_counter() - t0)
                with tempfile.TemporaryDirectory() as root:
                    t0 = time.perf_counter()
                    k.write(flat, layout, root=root, job="j", host="h", step=1, write=True, only_first=False)
                    write_s.append(time.perf_counter() - t0)
            st, cp = statistics.median(stage_s), statistics.median(copy_s)
            rows.append({"mb": round(nbytes / 2 ** 20, 1), "tensors": len(tensors), "registered": k._registered,
                         "stage_ms": round(st * 1e3, 2), "stage_GBps": round(nbytes / st / 1e9, 2),
                         "pinned_copy_ms": round(cp * 1e3, 2), "pinned_copy_GBps": round(nbytes / cp / 1e9, 2),
                         "stage_vs_copy": round(st / cp, 3), "keeper_write_ms": round(statistics.median(write_s) * 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
            del state, tensors, pinned
            if cuda:
                torch.cuda.empty_cache()
    finally:
        k.close()
    dev = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(json.dumps({"device": dev, "torch": torch.__version__, "rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
