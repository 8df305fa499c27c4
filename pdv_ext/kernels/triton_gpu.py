"""Triton kernels of the kernel API, for CUDA tensors (and, under TRITON_INTERPRET=1, CPU tensors: the tests).

One launch (or a few) per call over the whole tensor list, and no host synchronisation at all:
- a list op sees its tensors as segments: a base address and a device table of each tensor's byte offset
  from it (cast to a pointer in the kernel, `.to(REF.dtype)`, as Triton's grouped-GEMM tutorial casts its
  pointer table) and, per program, the segment it works on and where in it it starts. The block tables
  depend only on the sizes, the offset tables only on where the tensors lie relative to each other: both
  are cached, and a miss is a few bytes copied host-to-device without waiting (pinned, non_blocking).
- reductions (`adasum_dots`) write one partial per program and a second launch sums each segment's partials
  in a fixed order: deterministic, no atomics.
- top-k: a fused pass builds acc = update + residual and its |acc| key; a Triton radix select gives the
  threshold (`_radix_threshold`; PDV_TOPK_SELECT=torch: torch.topk on the device); per-block counts
  and their running sums (torch, on the device) place every taken entry, and a
  last pass writes indices/values and zeroes them in the residual.
- median / trimmed mean: each program loads a tile of columns x all m rows, maps values to order-preserving
  integer keys (NaN above +inf) and sorts the m keys of each column in registers (`tl.sort`).

Arithmetic mirrors the torch reference so that results agree bit for bit (tested): dots and the combination
in float64 (fp_fusion off: no FMA changes a rounding), the top-k sum and the even-m median mid-point in the
input dtype (float32 math rounded to it for 16-bit inputs), trimmed-mean sums in float64 in ascending order.
Every function takes contiguous inputs, non-empty (`pdv_ext.kernels` sees to both).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

#: elements per program of the list ops and top-k (tests lower them to cover many blocks on tiny inputs)
BLOCK = 4096
#: elements per program of top-k's count and write passes, at most BLOCK: the write's two block-wide scans
#: hold ~190 registers a thread at 4096 (two programs of 4 warps per multiprocessor: the write took 201 us
#: of device time at 64 MB on an H200, 2026-11-26, a third of the whole top-k), ~70 at 1024 (kernels_triton_check.py --compile checks it)
TOPK_BLOCK = 1024
#: elements (columns x padded rows) per program of median / trimmed mean
SORT_TILE = 4096
_tables: "OrderedDict[tuple, object]" = OrderedDict()  # LRU of device tables; ranks may be threads: locked
_tables_lock = threading.Lock()


# ---- tables --------------------------------------------------------------------------------------------
def _upload(values: List[int], device: torch.device) -> torch.Tensor:
    """int64 values on the device without a host wait: pinned host memory, asynchronous copy on the current
    stream, where the table is first used. (A cached table reused at once from another stream could be read
    before it lands; the aggregators launch on one stream per device.)"""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _cached(key: tuple, make):
    """_tables[key], made by make() on a miss; least recently used entries beyond 256 dropped."""
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None:
            _tables.move_to_end(key)
            return hit
    hit = make()
    with _tables_lock:
        _tables[key] = hit
        if len(_tables) > 256:
            _tables.popitem(last=False)
    return hit


def _block_tables(sizes: Tuple[int, ...], device: torch.device, block: int):
    """(segment of each program, its first element, segment sizes, first program of each segment + end,
    number of programs): depend only on the sizes, so cached (an aggregator passes the same sizes every step)."""
    def make():
        seg, start, first = [], [], [0]
        for i, n in enumerate(sizes):
            nb = -(-n // block)
            seg += [i] * nb
            start += range(0, nb * block, block)
            first.append(first[-1] + nb)
        return (_upload(seg, device), _upload(start, device), _upload(list(sizes), device),
                _upload(first, device), len(seg))

    return _cached((sizes, str(device), block), make)


def _segments(tensors: Sequence[torch.Tensor]) -> Tuple[int, torch.Tensor]:
    """(base address, device table of each tensor's byte offset from it). Cached by the offsets: a list whose
    tensors keep their places relative to each other (pieces of one buffer, gradients that stay allocated)
    costs no transfer after the first call. Zero-size tensors (never read) get offset 0."""
    ptrs = [t.data_ptr() if t.numel() else None for t in tensors]
    base = min((p for p in ptrs if p is not None), default=0)
    offsets = tuple(0 if p is None else p - base for p in ptrs)
    return base, _cached((offsets, str(tensors[0].device)), lambda: _upload(list(offsets), tensors[0].device))


def _aligned(*lists: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor of the lists starts on a 16-byte boundary (the kernels then load and store 16
    bytes at a time). Host arithmetic on addresses the caller already has: no device access."""
    return all(t.data_ptr() % 16 == 0 for ts in lists for t in ts if t.numel())


# ---- launches ------------------------------------------------------------------------------------------------
#: PDV_TRITON_LAUNCH=jit sends every launch through Triton's JITFunction (for comparison: `pdv bench kernels`
#: run both ways shows what the direct launch saves); anything else: the direct launch below
_launches: "OrderedDict[tuple, object]" = OrderedDict()  # (kernel, grid, device, options, specialisation) -> runner
_launches_lock = threading.Lock()


def _spec(args: tuple) -> tuple:
    """The key of a compiled kernel among calls of one kernel: for a tensor its dtype and whether its address
    is a multiple of 16 (what Triton specialises a pointer on), any other argument its type and value (ints by value:
    constexprs among them must be, and Triton's own int specialisations - width, multiple of 16, equal to
    1 - follow from the value). Telling more apart than Triton does only costs a trip through its JIT path."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)


def _launch(kernel, grid: tuple, *args, **options) -> None:
    """kernel[grid](*args, **options), every argument positional (constexprs too, in the kernel's order).

    Triton's JITFunction spends host time on every launch binding the arguments, specialising and looking
    its cache up (issue #39: the host, not the GPU, set the pace of Adasum, median and trimmed mean). After the first launch of a specialisation the compiled kernel Triton returned is
    launched directly (`CompiledKernel[grid](*args)`, Triton's C launcher on the current stream), keyed by
    the grid, the current device and `_spec(args)`; Triton's launch hooks (a profiler's) are called on that
    path too. Not under the interpreter (nothing compiled is returned) nor with PDV_TRITON_LAUNCH=jit."""
    key = None
    if os.environ.get("PDV_TRITON_LAUNCH", "") != "jit":
        key = (kernel, grid, torch.cuda.current_device() if torch.cuda.is_initialized() else -1,
               tuple(sorted(options.items())), _spec(args))
        runner = _launches.get(key)
        if runner is not None:
            runner(*args)
            return
    compiled = kernel[grid](*args, **options)
    if key is not None and compiled is not None and hasattr(compiled, "__getitem__") and \
            not isinstance(compiled, (list, tuple, dict)):
        try:
            runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]  # (its runner reads three grid sizes)
        except Exception:  # a Triton without CompiledKernel.__getitem__: the JIT path every time
            return
        with _launches_lock:
            _launches[key] = runner
            if len(_launches) > 512:
                _launches.popitem(last=False)


@triton.jit
def _to(x, P):
    """x rounded to the element type of pointer P as torch rounds: 16-bit types through float32, bfloat16
    to nearest-even by hand (Triton's interpreter truncates; compiled, this is what cvt.rn does)."""
    ty = P.dtype.element_ty
    if ty.is_bf16():
        f = x.to(tl.float32)
        b = f.to(tl.int32, bitcast=True)  # int32 wraps like uint32; only the low 16 bits of >> 16 are kept
        r = tl.where(f != f, b | 0x400000, b + 0x7FFF + ((b >> 16) & 1))
        y = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif ty.is_fp16():
        y = x.to(tl.float32).to(ty)
    else:
        y = x.to(ty)
    return y


# ---- adasum -----------------------------------------------------------------------------------------------
@triton.jit
def _seg_ptr(base, offsets, seg, REF, ALIGN: tl.constexpr):
    """Pointer to segment `seg` (base address + its byte offset, as REF's element type). With ALIGN (every
    segment starts on 16 bytes, checked on the host) the compiler is told so: an address made from an
    integer carries no alignment, and without it every load and store is one element wide."""
    p = (base + tl.load(offsets + seg)).to(REF.dtype)
    if ALIGN:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _pair_block(A, AO, B, BO, REF, seg_of, start_of, sizes, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """This program's block of the segment lists a and b: (segment, offsets, mask, whether the block is
    full, a in float64, b in float64). A full block loads unmasked (vectorised: a mask that may change
    within a vector forbids it); the last block of a segment loads masked."""
    pid = tl.program_id(0)
    seg = tl.load(seg_of + pid)
    start = tl.multiple_of(tl.load(start_of + pid), BLOCK)
    size = tl.load(sizes + seg)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < size
    full = start + BLOCK <= size
    pa = _seg_ptr(A, AO, seg, REF, ALIGN) + offs
    pb = _seg_ptr(B, BO, seg, REF, ALIGN) + offs
    if full:
        x = tl.load(pa).to(tl.float64)
        y = tl.load(pb).to(tl.float64)
    else:
        x = tl.load(pa, mask=mask, other=0.0).to(tl.float64)
        y = tl.load(pb, mask=mask, other=0.0).to(tl.float64)
    return seg, offs, mask, full, x, y


@triton.jit
def _dots_partial(A, AO, B, BO, REF, seg_of, start_of, sizes, part, nblocks, BLOCK: tl.constexpr,
                  ALIGN: tl.constexpr):
    pid = tl.program_id(0)
    seg, offs, mask, full, x, y = _pair_block(A, AO, B, BO, REF, seg_of, start_of, sizes, BLOCK, ALIGN)
    tl.store(part + pid, tl.sum(x * y, axis=0))
    tl.store(part + nblocks + pid, tl.sum(x * x, axis=0))
    tl.store(part + 2 * nblocks + pid, tl.sum(y * y, axis=0))


@triton.jit
def _dots_reduce(part, first, out, nblocks, nseg, RB: tl.constexpr):
    seg = tl.program_id(0)
    lo = tl.load(first + seg)
    hi = tl.load(first + seg + 1)
    for row in tl.static_range(3):
        acc = tl.zeros([RB], dtype=tl.float64)
        for s in range(lo, hi, RB):
            offs = s + tl.arange(0, RB)
            acc += tl.load(part + row * nblocks + offs, mask=offs < hi, other=0.0)
        tl.store(out + row * nseg + seg, tl.sum(acc, axis=0))


def adasum_dots(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return PairLaunch(a, b).dots()


class PairLaunch:
    """Launch state of `adasum_dots` / `adasum_combine` for one layout of the tensor lists (a, b): block
    tables, each list's base address and device offset table, alignment, a dtype carrier for REF and the
    partials buffer. `pdv_ext.kernels` keeps one per layout (keyed by every tensor's address, size, dtype
    and contiguity), so a call with a known layout is the launches and one or two allocations: no Python
    pass over the tensors beyond computing the key. Holds no reference to the caller's tensors."""

    __slots__ = ("dev", "n", "block", "seg", "start", "sizes", "first", "nblocks", "a", "b", "align_ab",
                 "align_a", "align_b", "ref", "part", "outs")

    def __init__(self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]):
        self.dev, self.n, self.block = a[0].device, len(a), BLOCK
        self.seg, self.start, self.sizes, self.first, self.nblocks = _block_tables(
            tuple(t.numel() for t in a), self.dev, BLOCK)
        self.a, self.b = _segments(a), _segments(b)
        self.align_a, self.align_b = _aligned(a), _aligned(b)
        self.align_ab = self.align_a and self.align_b
        self.ref = torch.empty(1, dtype=a[0].dtype, device=self.dev)  # only its element type is read
        self.part = torch.empty(3, max(self.nblocks, 1), dtype=torch.float64, device=self.dev)
        self.outs: "OrderedDict[tuple, tuple]" = OrderedDict()  # other `out` lists: key -> (segments, aligned)

    def dots(self) -> Tuple[torch.Tensor, ...]:
        """(a·b, |a|², |b|²): two launches, one allocation. The partials buffer is reused call after call
        (work on one stream runs in order; ranks on threads have layouts of their own)."""
        out = torch.empty(3, self.n, dtype=torch.float64, device=self.dev)
        if self.nblocks:
            _launch(_dots_partial, (self.nblocks,), *self.a, *self.b, self.ref, self.seg, self.start, self.sizes,
                    self.part, self.nblocks, self.block, self.align_ab)
        _launch(_dots_reduce, (self.n,), self.part, self.first, out, max(self.nblocks, 1), self.n, 256)
        return out.unbind(0)

    def out_segments(self, key: tuple, outs: Sequence[torch.Tensor]):
        """(segments, aligned) of an `out` list that is neither a nor b, cached by its key (8 at most)."""
        hit = self.outs.get(key)
        if hit is None:
            hit = self.outs[key] = (_segments(outs), _aligned(outs))
            if len(self.outs) > 8:
                self.outs.popitem(last=False)
        return hit

    def combine(self, ca: torch.Tensor, cb: torch.Tensor, out_seg, out_aligned: bool) -> None:
        """out = ca a + cb b: one launch (plus a copy of a coefficient not yet float64 on the device)."""
        if not self.nblocks:
            return
        nb = self.dev.type != "cpu"
        if ca.device != self.dev or ca.dtype != torch.float64 or not ca.is_contiguous():
            ca = ca.to(device=self.dev, dtype=torch.float64, non_blocking=nb).contiguous()
        if cb.device != self.dev or cb.dtype != torch.float64 or not cb.is_contiguous():
            cb = cb.to(device=self.dev, dtype=torch.float64, non_blocking=nb).contiguous()
        _launch(_combine, (self.nblocks,), *self.a, *self.b, *out_seg, self.ref, self.seg, self.start, self.sizes, ca,
                cb, self.block, self.align_ab and out_aligned, enable_fp_fusion=False)


@triton.jit
def _combine(A, AO, B, BO, O, OO, REF, seg_of, start_of, sizes, CA, CB, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    seg, offs, mask, full, x, y = _pair_block(A, AO, B, BO, REF, seg_of, start_of, sizes, BLOCK, ALIGN)
    r = x * tl.load(CA + seg) + y * tl.load(CB + seg)
    po = _seg_ptr(O, OO, seg, REF, ALIGN)
    if full:
        tl.store(po + offs, _to(r, po))
    else:
        tl.store(po + offs, _to(r, po), mask=mask)


def adasum_combine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], ca: torch.Tensor, cb: torch.Tensor,
                   outs: Sequence[torch.Tensor]) -> None:
    st = PairLaunch(a, b)
    st.combine(ca, cb, _segments(outs), _aligned(outs))


# ---- top-k with error feedback ------------------------------------------------------------------------------
@triton.jit
def _abs_key(acc):
    """|acc| as an integer ordered like |acc|; every NaN the canonical NaN, above +inf."""
    if acc.dtype == tl.float64:
        key = tl.abs(acc).to(tl.int64, bitcast=True)
        key = tl.where(acc != acc, 0x7FF8000000000000, key)
    else:
        key = tl.abs(acc.to(tl.float32)).to(tl.int32, bitcast=True)
        key = tl.where(acc != acc, 0x7FC00000, key)
    return key


@triton.jit
def _topk_prep(U, R, KEY, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    u = tl.load(U + offs, mask=mask, other=0.0)
    r = tl.load(R + offs, mask=mask, other=0.0)
    if u.dtype == tl.float64:
        acc = u + r
    else:  # as torch adds 16-bit floats: in float32, rounded once
        acc = _to(u.to(tl.float32) + r.to(tl.float32), U)
    tl.store(R + offs, acc, mask=mask)
    tl.store(KEY + offs, _abs_key(acc), mask=mask)


@triton.jit
def _topk_count(KEY, THR, counts, n, nblocks, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = tl.load(KEY + offs, mask=mask, other=0)
    thr = tl.load(THR)
    tl.store(counts + pid, tl.sum((mask & (key > thr)).to(tl.int64), axis=0))
    tl.store(counts + nblocks + pid, tl.sum((mask & (key == thr)).to(tl.int64), axis=0))


@triton.jit
def _topk_write(KEY, R, THR, base, ties_before, NEED, IDX, VALS, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = tl.load(KEY + offs, mask=mask, other=0)
    thr = tl.load(THR)
    tie = mask & (key == thr)
    tie_rank = tl.load(ties_before + pid) + tl.cumsum(tie.to(tl.int64), axis=0)  # inclusive, global
    take = (mask & (key > thr)) | (tie & (tie_rank <= tl.load(NEED)))
    pos = tl.load(base + pid) + tl.cumsum(take.to(tl.int64), axis=0) - 1
    tl.store(IDX + pos, offs, mask=take)
    tl.store(VALS + pos, tl.load(R + offs, mask=take, other=0.0), mask=take)
    tl.store(R + offs, tl.zeros([BLOCK], dtype=R.dtype.element_ty), mask=take)


# The threshold (the k-th largest key) by an MSD radix select, all on the device: RADIX_PASSES digits of
# RADIX_BITS bits from the top of the 32-bit key (int32 keys are >= 0: |x| bit patterns, NaN 0x7FC00000).
# Pass p histograms digit p of the keys whose higher digits equal the prefix chosen so far: one histogram
# per program over a grid-stride share of the blocks (tl.histogram), added into the pass's global bins with
# integer atomics (exact, so deterministic). Every program of pass p, and the one-program last kernel,
# re-derives the prefix and the rank still to find from the bins of the passes before it (a cumulative sum
# over 2^RADIX_BITS counts per pass: cheaper than a launch of its own), so nothing goes to the host.
RADIX_BITS = 8
RADIX_PASSES = 4
#: programs of a histogram pass at most (each loops over its share of the blocks, then flushes its bins)
RADIX_PROGRAMS = 512
#: how top-k finds its threshold for 32-bit keys: "torch" (torch.topk) or "radix" (_radix_threshold);
#: PDV_TOPK_SELECT, read at every call, overrides it. 64-bit keys (float64 inputs) always take torch.topk.
#: radix: 8-14% faster than torch.topk for the whole top-k in every one of three runs on an H200 (2026-11-27)
TOPK_SELECT = "radix"
SELECTS = ("torch", "radix")


@triton.jit
def _radix_prefix(BINS, K, PASSES: tl.constexpr, NPASS: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr):
    """(the digits of the k-th largest key found by the first PASSES passes, in place; its rank among the
    keys that share them) from those passes' bins."""
    prefix = K * 0
    rem = K
    b = tl.arange(0, NB)
    for p in tl.static_range(PASSES):
        h = tl.load(BINS + p * NB + b)
        incl = tl.cumsum(h, axis=0)
        total = tl.sum(h, axis=0)
        top = tl.max(tl.where(total - incl + h >= rem, b, 0), axis=0)  # bucket of the rem-th largest
        rem = rem - tl.sum(tl.where(b == top, total - incl, 0), axis=0)  # less the keys in buckets above it
        prefix = prefix | (top << (BITS * (NPASS - 1 - p)))
    return prefix, rem


@triton.jit(do_not_specialize=["K"])
def _radix_hist(KEY, BINS, K, n, PASS: tl.constexpr, NPASS: tl.constexpr, BITS: tl.constexpr,
                NB: tl.constexpr, BLOCK: tl.constexpr):
    SHIFT: tl.constexpr = BITS * (NPASS - 1 - PASS)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    h = tl.zeros([NB], dtype=tl.int32)
    if PASS == 0:
        for s in range(start, n, step):
            offs = s + tl.arange(0, BLOCK)
            inside = offs < n
            key = tl.load(KEY + offs, mask=inside, other=0)
            h += tl.histogram((key >> SHIFT) & (NB - 1), NB, mask=inside)
    else:
        prefix, _ = _radix_prefix(BINS, K, PASS, NPASS, BITS, NB)
        hi = prefix >> (SHIFT + BITS)
        for s in range(start, n, step):
            offs = s + tl.arange(0, BLOCK)
            inside = offs < n
            key = tl.load(KEY + offs, mask=inside, other=0)
            inside = inside & ((key >> (SHIFT + BITS)) == hi)
            h += tl.histogram((key >> SHIFT) & (NB - 1), NB, mask=inside)
    tl.atomic_add(BINS + PASS * NB + tl.arange(0, NB), h, mask=h > 0)


@triton.jit(do_not_specialize=["K"])
def _radix_final(BINS, K, OUT, NPASS: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr):
    prefix, _ = _radix_prefix(BINS, K, NPASS, NPASS, BITS, NB)
    tl.store(OUT, prefix)


def _radix_threshold(key: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of the int32 key tensor `key` (contiguous, values >= 0, 1 <= k <= n), as a
    0-dim int32 tensor on its device, equal to torch.topk(key, k).values.min(): RADIX_PASSES histogram
    launches and a one-program select, no host synchronisation."""
    n = key.numel()
    nb = 1 << RADIX_BITS
    bins = torch.zeros(RADIX_PASSES, nb, dtype=torch.int32, device=key.device)
    grid = (min(triton.cdiv(n, BLOCK), RADIX_PROGRAMS),)
    for p in range(RADIX_PASSES):
        _radix_hist[grid](key, bins, k, n, PASS=p, NPASS=RADIX_PASSES, BITS=RADIX_BITS, NB=nb, BLOCK=BLOCK)
    out = torch.empty((), dtype=torch.int32, device=key.device)
    _radix_final[(1,)](bins, k, out, NPASS=RADIX_PASSES, BITS=RADIX_BITS, NB=nb)
    return out


def topk_select(select: Optional[str] = None) -> str:
    """The threshold finder a top-k call uses: `select`, else PDV_TOPK_SELECT, else TOPK_SELECT."""
    choice = (select or os.environ.get("PDV_TOPK_SELECT", "") or TOPK_SELECT).lower()
    if choice not in SELECTS:
        raise ValueError(f"PDV_TOPK_SELECT / select: {choice!r}, expected one of {', '.join(SELECTS)}")
    return choice


def topk_error_feedback(update: torch.Tensor, residual: torch.Tensor, k: int,
                        select: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """`update`, `residual` contiguous and flat, 0 < k < n (the caller handles k = 0 and k = n). `select`:
    "torch" or "radix" (default: PDV_TOPK_SELECT, else TOPK_SELECT; see topk_select); radix counts in int32,
    so 2^31 entries or more take torch.topk."""
    n = update.numel()
    nblocks = triton.cdiv(n, BLOCK)
    key = torch.empty(n, dtype=torch.int64 if update.dtype == torch.float64 else torch.int32, device=update.device)
    _launch(_topk_prep, (nblocks,), update, residual, key, n, BLOCK)
    if topk_select(select) == "radix" and key.dtype == torch.int32 and n < 2 ** 31:  # int32 bin counts
        thr = _radix_threshold(key, k)
    else:
        thr = torch.topk(key, k, sorted=False).values.min()
    block = min(BLOCK, TOPK_BLOCK)
    nblocks = triton.cdiv(n, block)
    counts = torch.empty(2, nblocks, dtype=torch.int64, device=update.device)
    _launch(_topk_count, (nblocks,), key, thr, counts, n, nblocks, block)
    above_before = counts[0].cumsum(0) - counts[0]
    ties_before = counts[1].cumsum(0) - counts[1]
    need = k - counts[0].sum()
    base = above_before + torch.minimum(ties_before, need)  # entries taken by the blocks before
    idx = torch.empty(k, dtype=torch.int64, device=update.device)
    vals = torch.empty(k, dtype=update.dtype, device=update.device)
    _launch(_topk_write, (nblocks,), key, residual, thr, base, ties_before, need, idx, vals, n, block)
    return idx, vals


# ---- median / trimmed mean ----------------------------------------------------------------------------------
@triton.jit
def _sort_key(x):
    """Float -> integer of the same order (-0.0 just below +0.0; every NaN canonical, above +inf)."""
    if x.dtype == tl.float64:
        b = x.to(tl.int64, bitcast=True)
        key = b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF)
        key = tl.where(x != x, 0x7FF8000000000000, key)
    else:
        b = x.to(tl.int32, bitcast=True)
        key = b ^ ((b >> 31) & 0x7FFFFFFF)
        key = tl.where(x != x, 0x7FC00000, key)
    return key


@triton.jit
def _key_value(key, F: tl.constexpr):
    """The inverse of _sort_key (to float64 for int64 keys, float32 for int32)."""
    if F == 64:
        b = key ^ ((key >> 63) & 0x7FFFFFFFFFFFFFFF)
        v = b.to(tl.float64, bitcast=True)
    else:
        b = key ^ ((key >> 31) & 0x7FFFFFFF)
        v = b.to(tl.float32, bitcast=True)
    return v


@triton.jit
def _sorted_rows(S, OUT, n, stride, M: tl.constexpr, MP2: tl.constexpr, TRIM: tl.constexpr,
                 MEDIAN: tl.constexpr, F: tl.constexpr, BLOCK: tl.constexpr):
    """F: 64 for float64 stacks (int64 keys), 32 for the rest (float32 math, int32 keys)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.arange(0, MP2)
    inside = rows[None, :] < M
    x = tl.load(S + rows[None, :].to(tl.int64) * stride + cols[:, None], mask=(cols[:, None] < n) & inside,
                other=0.0)
    if F == 64:
        key = tl.where(inside, _sort_key(x), 0x7FFFFFFFFFFFFFFF)  # padding sorts last
    else:
        key = tl.where(inside, _sort_key(x.to(tl.float32)), 0x7FFFFFFF)
    key = tl.sort(key, dim=1)
    if MEDIAN:
        hi = _key_value(tl.sum(tl.where(rows[None, :] == M // 2, key, 0), axis=1), F)
        if M % 2 == 1:
            res = _to(hi, OUT)
        else:  # (lo + hi) / 2, each step rounded to the dtype as torch computes it
            lo = _key_value(tl.sum(tl.where(rows[None, :] == M // 2 - 1, key, 0), axis=1), F)
            res = _to(_to(lo + hi, OUT).to(hi.dtype) * 0.5, OUT)
        tl.store(OUT + cols, res, mask=cols < n)
    else:  # the kept values summed in ascending order in float64
        acc = _key_value(tl.sum(tl.where(rows[None, :] == TRIM, key, 0), axis=1), F).to(tl.float64)
        for j in tl.static_range(TRIM + 1, M - TRIM):
            acc += _key_value(tl.sum(tl.where(rows[None, :] == j, key, 0), axis=1), F).to(tl.float64)
        tl.store(OUT + cols, _to(acc / (M - 2 * TRIM), OUT), mask=cols < n)


#: stacks of more rows go to the reference (the per-column sort lives in registers)
MAX_ROWS = 32


def _sorted_rows_call(flat: torch.Tensor, trim: int, median: bool) -> torch.Tensor:
    """`flat`: (m, n) with unit column stride; one program per tile of columns."""
    m, n = flat.shape
    out = torch.empty(n, dtype=flat.dtype, device=flat.device)
    mp2 = max(2, triton.next_power_of_2(m))
    block = max(16, SORT_TILE // mp2)
    if n:
        _launch(_sorted_rows, (triton.cdiv(n, block),), flat, out, n, flat.stride(0), m, mp2, trim, median,
                64 if flat.dtype == torch.float64 else 32, block)
    return out


def coordinate_median(flat: torch.Tensor) -> torch.Tensor:
    return _sorted_rows_call(flat, 0, True)


def trimmed_mean(flat: torch.Tensor, trim: int) -> torch.Tensor:
    return _sorted_rows_call(flat, trim, False)
