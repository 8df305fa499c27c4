"""`pdv bench kernels`: throughput of the fused C++ kernels vs their pure-torch fallbacks, with a plain
memory copy measured in the same run as the roofline.

Bandwidth counts the bytes an op must move, nothing else: copy reads and writes n elements; Adasum (the
per-level pair `adasum_dots` + in-place `adasum_combine` over a GPT-like list of tensors) reads a and b
twice and writes a once (5 n elements); top-k with error feedback reads update and residual and writes
residual (3 n); median reads the m x n stack and writes n. Temporaries a fallback allocates are not
counted (that is its cost). All variants use the same thread count (torch.get_num_threads()) and are
timed alternately; each figure is the median of the repetitions.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List

import torch

from .. import kernels as K
from .common import check_ranges, emit, log, median, parser


def gpt_like_sizes(total: int) -> List[int]:
    """Tensor sizes shaped like a GPT block stack (hidden h: qkv 3h², proj h², mlp 4h² x2, biases, norms)."""
    h = 512
    block = [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h]
    sizes: List[int] = []
    while sum(sizes) + sum(block) <= total:
        sizes += block
    if total - sum(sizes) > 0:
        sizes.append(total - sum(sizes))
    return sizes


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(elements: int, reps: int, m: int = 4) -> Dict[str, float]:
    if K.backend() != "cpp":
        log(f"fused kernels unavailable ({K._state['reason']}): fused figures measure the fallback")
    n = elements
    g = torch.Generator().manual_seed(0)
    src, dst = torch.randn(n, generator=g), torch.empty(n)
    sizes = gpt_like_sizes(n)
    a_flat, b_flat = torch.randn(n, generator=g), torch.randn(n, generator=g)
    a = list(a_flat.split(sizes))
    b = list(b_flat.split(sizes))
    half = torch.full((len(sizes),), 0.5, dtype=torch.float64)
    upd, res = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    k = max(1, n // 100)
    stack = torch.randn(m, n // m, generator=g)

    def ada_fused():
        K.adasum_dots(a, b)
        K.adasum_combine(a, b, half, half, out=a)

    def ada_torch():
        K.adasum_dots_torch(a, b)
        K.adasum_combine_torch(a, b, half, half, out=a)

    cases = {
        "copy": (lambda: dst.copy_(src), 2 * n * 4),
        "adasum_fused": (ada_fused, 5 * n * 4),
        "adasum_torch": (ada_torch, 5 * n * 4),
        "topk_fused": (lambda: K.topk_error_feedback(upd, res, k), 3 * n * 4),
        "topk_torch": (lambda: K.topk_error_feedback_torch(upd, res, k), 3 * n * 4),
        "median_fused": (lambda: K.coordinate_median(stack), (m + 1) * (n // m) * 4),
        "median_torch": (lambda: K.coordinate_median_torch(stack), (m + 1) * (n // m) * 4),
    }
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for name, (fn, _) in cases.items():  # warm-up (and the kernel build, if not cached)
        fn()
    for rep in range(reps):
        for name, (fn, _) in cases.items():  # alternate, so machine noise hits every case alike
            times[name].append(_time(fn))
        log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{nm} {t[-1] * 1e3:.1f} ms" for nm, t in times.items()))
    out: Dict[str, float] = {}
    for name, (_, nbytes) in cases.items():
        out[f"{name}_gbps"] = round(nbytes / median(times[name]) / 1e9, 3)
    return out


def main(argv=None) -> int:
    ap = parser("kernels", __doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="MB of float32 per input vector (default 64)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--m", type=int, default=4, help="vectors in the median stack")
    ap.add_argument("--quick", action="store_true", help="4 MB, 3 repetitions (smoke test)")
    args = ap.parse_args(argv)
    check_ranges(ap, args, {"--reps": 1, "--m": 1}, ["--mb"])  # nan MB fails in int(); 0 reps has no median
    mb, reps = (4.0, 3) if args.quick else (args.mb, args.reps)
    elements = int(mb * 2 ** 20 / 4)
    if elements < args.m:
        ap.error(f"--mb {mb:g} is too small for a median over --m {args.m} vectors")
    res = run(elements, reps, args.m)
    result = {**res, "backend": K.backend(), "threads": torch.get_num_threads(), "mb": mb,
              "adasum_fused_vs_copy": round(res["adasum_fused_gbps"] / res["copy_gbps"], 3)}
    emit(result, args.json)
    return 0
