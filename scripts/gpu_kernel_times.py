"""Where the kernel API's device time goes on CUDA (issue #39): torch.profiler's device time per kernel per call
for an Adasum level (adasum_pair: dots + combine), top-k with error feedback, median and trimmed mean, at the
sizes `pdv bench kernels` uses (64 MB of float32 by default; 61 GPT-shaped tensors for Adasum). Beside each op:
its host time per call (calls queued back to back, one synchronisation) and its device time per call (the
sum of its kernels), so a host-bound op shows as host > device. Prints one compact table; needs a GPU.

    python scripts/gpu_kernel_times.py [--mb 64] [--dtype float32]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pdv_ext import kernels as K
from pdv_ext.bench.kernels import gpt_like_sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests this script (CPU op times)")
    args = ap.parse_args()
    dev, dt = args.device, getattr(torch, args.dtype)
    cuda = dev == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("no CUDA device here")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = int(args.mb * 2 ** 20 / 4)
    g = torch.Generator(device=dev).manual_seed(0)
    sizes = gpt_like_sizes(n)
    a = list(torch.randn(n, device=dev, generator=g).to(dt).split(sizes))
    b = list(torch.randn(n, device=dev, generator=g).to(dt).split(sizes))
    half = torch.full((len(sizes),), 0.5, dtype=torch.float64, device=dev)
    upd, res = torch.randn(n, device=dev, generator=g).to(dt), torch.randn(n, device=dev, generator=g).to(dt)
    stack = torch.randn(4, n // 4, device=dev, generator=g).to(dt)

    def level():
        p = K.adasum_pair(a, b)
        p.dots()
        p.combine(half, half, out=a)

    ops = {"adasum_level": level, "topk_ef": lambda: K.topk_error_feedback(upd, res, n // 100),
           "median": lambda: K.coordinate_median(stack), "trimmed": lambda: K.trimmed_mean(stack, 1)}
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'} {args.dtype} {args.mb:g} MB, {len(sizes)} tensors, {args.calls} calls")
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        sync()
        queued = (time.perf_counter() - t0) / args.calls * 1e6
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                fn()
            sync()
        own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        rows = [(e.key, own(e) / args.calls) for e in prof.key_averages() if own(e) > 0]
        rows.sort(key=lambda r: -r[1])
        device = sum(t for _, t in rows)
        print(f"{name}: queued {queued:.1f} us/call, device {device:.1f} us/call: "
              + ", ".join(f"{k[:40]} {t:.1f}" for k, t in rows[:6]))


if __name__ == "__main__":
    main()
