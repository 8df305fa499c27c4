"""`pdv bench kernels`: throughput of the kernel API (C++ on CPU, Triton on CUDA) vs the torch reference, with a
plain memory copy of the same device measured in the same run as the roofline.

Bandwidth counts the bytes an op must move, nothing else: copy reads and writes n elements; Adasum (the
per-level pair `adasum_dots` + in-place `adasum_combine` over a GPT-like list of tensors) reads a and b
twice and writes a once (5 n elements; the fused op as the aggregator calls it at each level of its tree:
one `adasum_pair`, its dots, its combination into a); top-k with error feedback reads update and residual and writes
residual (3 n); median and trimmed mean read the m x n/m stack and write n/m ((m + 1) n / m). Temporaries an
implementation allocates are not counted (that is its cost). Elements are counted at the input dtype's
size. On CPU all variants use torch.get_num_threads() threads. On CUDA every op (and the copy) is timed three
ways per repetition: device time, `inner` calls between two CUDA events (`*_gbps`, `*_vs_copy`: the
historical keys); queued wall time, `inner` calls back to back and one synchronisation
(`*_queued_gbps`, `*_queued_vs_copy`, `*_queued_us` per call: what a step pays when the host issues the
work, so a host-bound op shows here); synced wall time, a synchronisation after each call (`*_synced_*`).
Variants are timed alternately, so machine noise hits every case alike; each figure is the median of the
repetitions.

On CUDA (wherever Triton answers), top-k is also timed with each threshold finder named: `topk_fused` with
the default (the Triton radix select unless PDV_TOPK_SELECT says otherwise; the result's `topk_select`
names it), `topk_radix` with the radix select and `topk_torchselect` with torch.topk (`*_gbps`,
`*_vs_copy`, and their `_bf16` keys), so that one run on a GPU shows which should be the default.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import kernels as K
from .common import check_ranges, emit, log, median, parser

#: key suffix per input dtype (float32 keeps the historical key names)
SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16", "float64": "_fp64"}


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


def _time_cuda(fn: Callable[[], None], inner: int) -> float:
    """Device time per call: `inner` calls between two CUDA events (no synchronisation inside)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / inner


def _time_queued(fn: Callable[[], None], inner: int, sync: Callable[[], None]) -> float:
    """Wall time per call with `inner` calls queued back to back and one synchronisation after them: what a
    training step pays when the host issues the work (host overhead shows when it exceeds the device's)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - t0) / inner


def _time_synced(fn: Callable[[], None], inner: int, sync: Callable[[], None]) -> float:
    """Wall time per call with a synchronisation after each call (the median of `inner`): host issue and
    device work in series, plus a sync's round trip."""
    sync()
    ts = []
    for _ in range(inner):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def _spin_up(fn: Callable[[], None], seconds: float = 0.5) -> None:
    """Keep the GPU busy with `fn` for `seconds` before timing: an idle GPU waits at a low clock (an H200 at
    345 MHz of 1980): in the first `gpu_check.sh` of 2026-11-27 the first repetitions timed up to 1.7x
    slower than the later ones."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()


def cuda_timers(inner: int) -> Dict[str, Callable[[Callable[[], None]], float]]:
    """The three ways a CUDA op is timed, by key infix: "" device time (CUDA events, the historical keys),
    "_queued" and "_synced" wall time (see _time_queued / _time_synced). The copy is timed the same three
    ways, so each `*_vs_copy` compares like with like."""
    sync = torch.cuda.synchronize
    return {"": lambda fn: _time_cuda(fn, inner), "_queued": lambda fn: _time_queued(fn, inner, sync),
            "_synced": lambda fn: _time_synced(fn, inner, sync)}


def _cases(n: int, m: int, device: str, dtype: torch.dtype):
    """{name: (fn, bytes moved)} for one input dtype on one device."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    size = torch.empty(0, dtype=dtype).element_size()
    src, dst = randn(n), torch.empty(n, dtype=dtype, device=device)
    sizes = gpt_like_sizes(n)
    a = list(randn(n).split(sizes))
    b = list(randn(n).split(sizes))
    half = torch.full((len(sizes),), 0.5, dtype=torch.float64, device=device)
    upd, res = randn(n), randn(n) * 0.1
    k = max(1, n // 100)
    stack = randn(m, n // m)
    trim = min((m - 1) // 2, max(1, m // 4))  # about a quarter of the rows dropped at each end

    def ada_fused():  # as the Adasum aggregator runs a level: one pair, its dots, its combination into a
        level = K.adasum_pair(a, b)
        level.dots()
        level.combine(half, half, out=a)

    def ada_torch():
        K.adasum_dots_torch(a, b)
        K.adasum_combine_torch(a, b, half, half, out=a)

    rows = (m + 1) * (n // m) * size
    topk = {"topk_fused": (lambda: K.topk_error_feedback(upd, res, k), 3 * n * size)}
    if K.backend(device) == "triton" and dtype != torch.float64 and 0 < k < n:
        T = K._triton()  # each threshold finder named, beside the default (see module doc)
        topk["topk_radix"] = (lambda: T.topk_error_feedback(upd, res, k, select="radix"), 3 * n * size)
        topk["topk_torchselect"] = (lambda: T.topk_error_feedback(upd, res, k, select="torch"), 3 * n * size)
    return {
        "copy": (lambda: dst.copy_(src), 2 * n * size),
        "adasum_fused": (ada_fused, 5 * n * size),
        "adasum_torch": (ada_torch, 5 * n * size),
        **topk,
        "topk_torch": (lambda: K.topk_error_feedback_torch(upd, res, k), 3 * n * size),
        "median_fused": (lambda: K.coordinate_median(stack), rows),
        "median_torch": (lambda: K.coordinate_median_torch(stack), rows),
        "trimmed_fused": (lambda: K.trimmed_mean(stack, trim), rows),
        "trimmed_torch": (lambda: K.trimmed_mean_torch(stack, trim), rows),
    }


def run(elements: int, reps: int, m: int = 4, device: str = "cpu", dtypes: Sequence[str] = ("float32",),
        inner: int = 10, timers: Optional[Dict[str, Callable[[Callable[[], None]], float]]] = None) -> Dict[str, float]:
    """Figures per dtype; `timers` (key infix -> timer of one call; default: the CPU's wall clock, on CUDA
    `cuda_timers`) says how each case is timed: every timer gives `{case}{infix}{sfx}_gbps` and, for the
    fused ops, `{case}{infix}{sfx}_vs_copy` against the copy timed the same way, plus `{case}{infix}{sfx}_us`
    per call for the timers beyond the first."""
    if device == "cpu" and K.backend() != "cpp":
        log(f"fused kernels unavailable ({K._state['reason']}): fused figures measure the fallback")
    if device == "cuda" and K.backend("cuda") != "triton":
        log(f"Triton unavailable ({K._triton_state['reason']}): fused figures measure the reference")
    out: Dict[str, float] = {}
    for dt in dtypes:
        cases = _cases(elements, m, device, getattr(torch, dt))
        modes = timers or (cuda_timers(inner) if device == "cuda" else {"": _time})
        times: Dict[str, Dict[str, List[float]]] = {mode: {name: [] for name in cases} for mode in modes}
        for name, (fn, _) in cases.items():  # warm-up (and the kernel build / Triton compile)
            fn()
        if device == "cuda":
            _spin_up(cases["copy"][0])
        for rep in range(reps):
            for mode, timer in modes.items():
                for name, (fn, _) in cases.items():  # alternate, so machine noise hits every case alike
                    times[mode][name].append(timer(fn))
            log(f"{dt} rep {rep + 1}/{reps}: " + ", ".join(f"{nm} {t[-1] * 1e3:.2f} ms"
                                                           for nm, t in times[next(iter(modes))].items()))
        sfx = SUFFIX[dt]
        for i, mode in enumerate(modes):
            gbps = {name: nbytes / median(times[mode][name]) / 1e9 for name, (_, nbytes) in cases.items()}
            for name, v in gbps.items():
                out[f"{name}{mode}{sfx}_gbps"] = round(v, 3)
                if i:
                    out[f"{name}{mode}{sfx}_us"] = round(median(times[mode][name]) * 1e6, 1)
            for name in cases:
                if name.endswith(("_fused", "_radix", "_torchselect")):
                    out[f"{name}{mode}{sfx}_vs_copy"] = round(gbps[name] / gbps["copy"], 3)
    return out


def main(argv=None) -> int:
    ap = parser("kernels", __doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="MB of float32 per input vector (default 64); the "
                    "element count is the same for every dtype")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--m", type=int, default=4, help="vectors in the median / trimmed-mean stack")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: the C++ kernels; cuda: the Triton kernels (default cpu)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default=None,
                    help="input dtype(s); default float32 on cpu, both on cuda (bf16 keys end in _bf16)")
    ap.add_argument("--quick", action="store_true", help="4 MB, 3 repetitions (smoke test)")
    args = ap.parse_args(argv)
    check_ranges(ap, args, {"--reps": 1, "--m": 1}, ["--mb"])  # nan MB fails in int(); 0 reps has no median
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False; torch "
                 f"{torch.__version__})")
    mb, reps = (4.0, 3) if args.quick else (args.mb, args.reps)
    elements = int(mb * 2 ** 20 / 4)
    if elements < args.m:
        ap.error(f"--mb {mb:g} is too small for a median over --m {args.m} vectors")
    dtype = args.dtype or ("both" if args.device == "cuda" else "float32")
    dtypes = ["float32", "bfloat16"] if dtype == "both" else [dtype]
    res = run(elements, reps, args.m, args.device, dtypes)
    result = {**res, "device": args.device, "backend": K.backend(args.device), "dtypes": dtypes,
              "threads": torch.get_num_threads(), "mb": mb}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
        if K.backend("cuda") == "triton":  # the threshold finder behind topk_fused (topk_radix: always radix)
            result["topk_select"] = K._triton().topk_select()
    emit(result, args.json)
    return 0
