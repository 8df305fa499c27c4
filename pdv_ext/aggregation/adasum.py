"""`adasum`: Adaptive Summation (Maleki et al., MLSys'21), per tensor, over any group of any size.

Two gradients a, b of one tensor combine as `(1 - a·b/(2|a|²)) a + (1 - a·b/(2|b|²)) b`: orthogonal
gradients add, identical ones average. The numerics are Horovod's (horovod/common/ops/adasum/adasum.h):
a·b, |a|², |b|² accumulated in float64 whatever the gradients' dtype (fp32, fp16, bf16, fp64), the
coefficient `1.0 - dot / normsq * 0.5` in float64, and 1 where that float64 squared norm is below
`sqrt(DBL_MIN)` (~1.49e-154, `HOROVOD_EPS`), i.e. only for a numerically zero side: identical gradients
average at any magnitude a float32 or fp16 gradient can have (1e-30 and 1e30 alike). Across ranks
the combination is the tree of Horovod's AdasumMPI: recursive vector-halving / distance-doubling. The
tensors are treated as one virtual flat buffer (their concatenation) but never copied into one: pieces of
the gradients themselves are sent (`Comm.exchange` takes lists of tensors), partner halves land in one
scratch buffer, and the combination is written back into the gradients. Small tensors (biases, norms)
are copied into one pack first and travel as one message: a message costs tens of microseconds of CPU
under gloo whatever its size; each packed tensor still gets its own coefficients. At the level of distance d,
partners r and r^d swap halves of their current slice, compute partial dot products and squared norms of
each tensor on the half they keep (float64, `pdv_ext.kernels`), sum those few scalars over the block of 2d
ranks that now jointly hold the two subtrees' results (recursive doubling inside the block), and combine.
A distance-halving gather then rebuilds every tensor on every rank, received straight into place.

Inputs of any layout are accepted (strided views, zero-size, one rank's view contiguous and another's
not): they are checked before any communication, non-contiguous ones are aggregated as contiguous copies
and the results copied back into the caller's views, so the collective sequence never depends on a
layout. Device: everything a call computes stays on the gradients' device — the float64 per-tensor
partial sums, their block sums (through `Comm.exchange`, like the gradient pieces themselves: the comm
takes tensors where the gradients live, gloo CPU, NCCL CUDA), the coefficients, and the per-layout index
tensors, built on the host once per layout and cached on the device. This module makes no host
synchronisation (nor do `pdv_ext.kernels`' CUDA and reference paths; should `adasum_dots` return its sums
on the host, they are moved to the device with one non-blocking copy per level). The one that remains is
the comm's: `HorovodComm.exchange` reads the received splits of Horovod's alltoall on the host.

Data shares ("count"): every replica's gradient enters as it is, whatever its share of the step's samples.
A gradient from fewer samples is a noisier estimate of the same gradient, not a smaller one, and Adasum's
operator is not linear: scaling a replica by its share would change the geometry it reacts to (identical
gradients of different scales no longer average: Adasum(a, 2a) = 1.5a).

Unlike Horovod (MPI only, power-of-two ranks, global set) this runs on any `Comm`: the ranks beyond the
largest power of two P fold their gradient into rank r - P first (a local pairwise Adasum) and get the
result back at the end. Every slice of the result is computed by exactly one rank, so all replicas end
bit-identical. Every rank calls the same sequence of collectives (idle ranks with empty exchanges), as
`Comm.exchange` requires.
"""
from __future__ import annotations

import bisect
import functools
import math
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from pydantic import Field

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, check_tensors, contiguous_inputs, group_by_dtype, register_aggregator

#: Horovod's zero-norm threshold: adasum.h compares each float64 squared norm with `sqrt(DBL_MIN)`
#: (checked against Horovod 0.28.1's MPI Adasum: identical float32 gradients of 1e-5, squared norm 4e-10,
#: come back averaged)
HOROVOD_EPS = math.sqrt(sys.float_info.min)

Segs = List[Tuple[int, int, int]]  # (tensor index, start, end) in flat-buffer coordinates


@register_aggregator("adasum")
class Adasum(Aggregator):
    """Adasum of all replicas' gradients, tensor by tensor; identical result on every replica."""

    class Options(StrictModel):
        #: a float64 squared norm (of one tensor, over a subtree) below this counts as zero: that side's
        #: coefficient is 1. Default Horovod's `sqrt(DBL_MIN)` (~1.49e-154): only a numerically zero
        #: side is summed, any other pair of identical gradients is averaged whatever its magnitude.
        #: Raising it (e.g. to 1e-8) makes small but non-zero layers add up instead of averaging.
        eps: float = Field(HOROVOD_EPS, ge=0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scratch: Dict[torch.dtype, torch.Tensor] = {}

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        p2 = 1 << (comm.size.bit_length() - 1)
        self.report = {"ranks": comm.size, "levels": p2.bit_length() - 1, "folded_ranks": comm.size - p2}
        _adasum_all(grads, comm, self.options.eps, self._scratch_for, "adasum")
        return grads

    def _scratch_for(self, like: torch.Tensor, n: int) -> torch.Tensor:
        s = self._scratch.get(like.dtype)
        if s is None or s.numel() < n or s.device != like.device:
            s = torch.empty(n, dtype=like.dtype, device=like.device)
            self._scratch[like.dtype] = s
        return s[:n]


def check_adasum_inputs(tensors: Sequence[torch.Tensor], who: str = "adasum") -> None:
    """Reject, before any communication, what Adasum cannot take: besides `check_tensors` (dense tensors
    whose elements do not overlap), a non-floating dtype or tensors on more than one device. Local
    checks of this rank's call: in an SPMD program every rank raises the same error at the same call."""
    check_tensors(tensors, who)
    for i, t in enumerate(tensors):
        if not t.is_floating_point():
            raise TypeError(f"{who}: input {i} has dtype {t.dtype}; Adasum needs floating-point tensors")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{who}: inputs on more than one device ({', '.join(sorted(map(str, devices)))}); "
                         "call it once per device")


def _adasum_all(tensors: Sequence[torch.Tensor], comm: Comm, eps: float,
                scratch_for: Callable[[torch.Tensor, int], Optional[torch.Tensor]], who: str) -> None:
    """Checks, contiguous copies of non-contiguous inputs, one Adasum per dtype, results copied back."""
    check_adasum_inputs(tensors, who)
    if comm.size == 1 or not tensors:
        return
    work = contiguous_inputs(tensors)
    for idx in group_by_dtype(work).values():  # one pass per dtype; every rank has the same groups
        group = [work[i] for i in idx]
        n = sum(t.numel() for t in group)
        if n:  # the same on every rank (same shapes): an all-empty group needs no communication
            _adasum_group(group, comm, eps, scratch_for(group[0], n))
    for t, w in zip(tensors, work):
        if w is not t:
            t.copy_(w)


class _Virtual:
    """Contiguous tensors seen as one flat buffer (their concatenation), without copying them into one.

    `chunks` tile the same buffer in the same order, each contiguous in memory (by default the tensors
    themselves): messages are cut at chunk boundaries, so tensors packed into one chunk travel as one
    message, while dot products and combinations still go tensor by tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor] = ()):
        self.views, self.offsets = _layout(tensors)
        self.chunk_views, self.chunk_offsets = _layout(chunks) if chunks else (self.views, self.offsets)
        self.n = self.offsets[-1]
        self.key = tuple(self.offsets)
        if self.chunk_offsets[-1] != self.n:
            raise ValueError(f"adasum: chunks hold {self.chunk_offsets[-1]} elements, the tensors {self.n}")

    def segments(self, lo: int, hi: int) -> Segs:
        """The pieces of each tensor inside [lo, hi) (empty pieces left out)."""
        return _cut(self.offsets, lo, hi)

    def plan(self, lo: int, hi: int, device: torch.device) -> Tuple[Segs, Optional[torch.Tensor]]:
        """`segments(lo, hi)` and their tensor indices on `device`, cached per layout (`_plan`)."""
        return _plan(self.key, lo, hi, device)

    def pieces(self, segs: Segs) -> List[torch.Tensor]:
        """Views of the tensors for `segs`."""
        return [self.views[t][s - self.offsets[t]:e - self.offsets[t]] for t, s, e in segs]

    def messages(self, lo: int, hi: int) -> List[torch.Tensor]:
        """Views of the chunks inside [lo, hi): what is sent, or received in place."""
        offs = self.chunk_offsets
        return [self.chunk_views[c][s - offs[c]:e - offs[c]] for c, s, e in _cut(offs, lo, hi)]

    def message_bounds(self, lo: int, hi: int) -> List[Tuple[int, int]]:
        """Flat [start, end) of each message for [lo, hi): where it lands in a scratch buffer."""
        return [(s, e) for _, s, e in _cut(self.chunk_offsets, lo, hi)]


def _layout(tensors: Sequence[torch.Tensor]) -> Tuple[List[torch.Tensor], List[int]]:
    views = [t.view(-1) for t in tensors]
    offsets = [0]
    for v in views:
        offsets.append(offsets[-1] + v.numel())
    return views, offsets


def _cut(offsets: List[int], lo: int, hi: int) -> Segs:
    """(index, start, end) of each item of `offsets` overlapping [lo, hi), empty pieces left out."""
    out: Segs = []
    if hi <= lo:
        return out
    t = bisect.bisect_right(offsets, lo) - 1
    while t < len(offsets) - 1 and offsets[t] < hi:
        s, e = max(lo, offsets[t]), min(hi, offsets[t + 1])
        if e > s:
            out.append((t, s, e))
        t += 1
    return out


@functools.lru_cache(maxsize=4096)
def _plan(offsets: Tuple[int, ...], lo: int, hi: int, device: torch.device) -> Tuple[Segs, Optional[torch.Tensor]]:
    """The segments of [lo, hi) and their tensor indices as an int64 tensor on `device`: built on the host
    once per layout (tensor sizes, slice) and device, then reused every step (no per-call host->device
    copy; the layouts of one training run are a handful per rank)."""
    segs = _cut(list(offsets), lo, hi)
    if not segs:
        return segs, None
    idx = torch.tensor([t for t, _, _ in segs], dtype=torch.int64)
    return segs, idx.to(device, non_blocking=True)


def _coefficients(dot: torch.Tensor, mine: torch.Tensor, other: torch.Tensor, eps: float):
    """Horovod's coefficients, in float64 on the sums' device: `1 - dot / |.|² * 0.5`, or 1 where that
    squared norm is below `eps` (the division by a zero norm on the other branch is discarded)."""
    ca = torch.where(mine >= eps, 1.0 - dot / mine * 0.5, 1.0)
    cb = torch.where(other >= eps, 1.0 - dot / other * 0.5, 1.0)
    return ca, cb


def _sums_into(part: torch.Tensor, idx: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
    """Write per-segment float64 sums (`rows`, from `kernels.adasum_dots`, on whichever device it
    returns them) into the columns `idx` of `part`, on `part`'s device."""
    part.index_copy_(1, idx, torch.stack([r.to(torch.float64) for r in rows]).to(part.device, non_blocking=True))


def _block_sum(part: torch.Tensor, comm: Comm, rank: int, block: int, active: bool) -> torch.Tensor:
    """Sum `part` over the aligned block of `block` ranks holding `rank`, by recursive doubling (a + b
    on one side, b + a on the other: bitwise the same, so every member gets the identical sum)."""
    tmp = torch.empty_like(part)
    mask = 1
    while mask < block:
        if active:
            comm.exchange({rank ^ mask: part}, {rank ^ mask: tmp})
            part = part + tmp
        else:
            comm.exchange({}, {}, device=part.device)
        mask *= 2
    return part


#: tensors up to this many elements (biases, norms) are packed into one buffer and travel as one message:
#: every point-to-point message costs tens of microseconds of CPU under gloo, whatever its size
PACK_NUMEL = 1 << 16


def adasum_tensors(tensors: Sequence[torch.Tensor], comm: Comm, eps: float = HOROVOD_EPS,
                   scratch: Optional[torch.Tensor] = None) -> Sequence[torch.Tensor]:
    """Adasum of each of `tensors` across `comm`, in place; returns `tensors`.

    Collective: every rank passes tensors of the same shapes and dtypes in the same order. Any layout
    (strided views such as a matrix column, zero-size, a different layout on each rank) and any mix of
    floating dtypes (one pass per dtype) is accepted; results equal those of contiguous copies and are
    written into the given tensors. What cannot be taken (see `check_adasum_inputs`) is rejected before
    any communication. `scratch` (optional) is a receive buffer, used for the dtype group it fits (same
    dtype and device, at least as many elements)."""
    def scratch_for(like: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        if (scratch is not None and scratch.dtype == like.dtype and scratch.device == like.device
                and scratch.is_contiguous() and scratch.numel() >= n):
            return scratch.view(-1)[:n]
        return None

    _adasum_all(tensors, comm, eps, scratch_for, "adasum_tensors")
    return tensors


def _adasum_group(tensors: Sequence[torch.Tensor], comm: Comm, eps: float,
                  scratch: Optional[torch.Tensor] = None) -> None:
    """Adasum of contiguous tensors of one dtype and device (at least one element in all), in place."""
    small = [t for t in tensors if t.numel() <= PACK_NUMEL]
    if len(small) < 2:
        _adasum_virtual(_Virtual(tensors), comm, eps, scratch)
        return
    # same shapes on every rank -> the same packing everywhere; the small tensors go first, packed
    large = [t for t in tensors if t.numel() > PACK_NUMEL]
    pack = torch.cat([t.reshape(-1) for t in small])
    packed = list(torch.split(pack, [t.numel() for t in small]))
    _adasum_virtual(_Virtual(packed + large, [pack] + large), comm, eps, scratch)
    for t, v in zip(small, packed):
        t.view(-1).copy_(v)


#: halving points are kept on multiples of this many elements (64 bytes of float32): with tensors whose
#: sizes are multiples of it too (the usual widths), every piece a kernel sees starts on a 16-byte line and
#: the GPU kernels load and store 16 bytes at a time (`kernels.triton_gpu._aligned`)
SPLIT_ALIGN = 16


def _half(n: int) -> int:
    """Where a slice of n elements is halved: n // 2, rounded down to SPLIT_ALIGN once that leaves both
    halves at least that long. The same on every rank (sizes are); any split is a valid Adasum tree."""
    h = n // 2
    return h - h % SPLIT_ALIGN if h >= 2 * SPLIT_ALIGN else h


def _adasum_virtual(buf: _Virtual, comm: Comm, eps: float, scratch: Optional[torch.Tensor] = None) -> None:
    size, rank = comm.size, comm.rank
    n, n_t = buf.n, len(buf.views)
    dev = buf.views[0].device
    recv = scratch if scratch is not None else torch.empty(n, dtype=buf.views[0].dtype, device=dev)
    if recv.numel() != n:
        raise ValueError(f"adasum: scratch has {recv.numel()} elements, the tensors {n}")

    def into_recv(segs: Segs) -> List[torch.Tensor]:
        return [recv[s:e] for _, s, e in segs]

    def recv_messages(lo: int, hi: int) -> List[torch.Tensor]:
        return [recv[s:e] for s, e in buf.message_bounds(lo, hi)]

    def pair(segs: Segs) -> "kernels.AdasumPair":
        """This rank's pieces and the received ones of `segs`: their dots, later their combination into
        this rank's pieces (the lists checked once per level)."""
        return kernels.adasum_pair(buf.pieces(segs), into_recv(segs))

    def combine(p: "kernels.AdasumPair", idx: Optional[torch.Tensor], ca: torch.Tensor, cb: torch.Tensor) -> None:
        p.combine(ca.index_select(0, idx), cb.index_select(0, idx), out=p.a)

    p2 = 1 << (size.bit_length() - 1)
    extra = size - p2

    # fold in: rank p2+i hands its gradient to rank i, which combines the two locally
    if rank >= p2:
        comm.exchange({rank - p2: buf.messages(0, n)}, {}, device=dev)
    elif rank < extra:
        comm.exchange({}, {rank + p2: recv_messages(0, n)}, device=dev)
        everything, idx = buf.plan(0, n, dev)
        sums = torch.zeros(3, n_t, dtype=torch.float64, device=dev)  # per tensor, as `combine` indexes them
        p = pair(everything)
        _sums_into(sums, idx, p.dots())
        combine(p, idx, *_coefficients(sums[0], sums[1], sums[2], eps))
    else:
        comm.exchange({}, {}, device=dev)

    # reduce-scatter by vector halving, distance doubling
    active = rank < p2
    lo, hi = 0, n
    kept: List[Tuple[int, int, int]] = []  # (distance, parent lo, parent hi) for the gather phase
    dist = 1
    while dist < p2:
        part = torch.zeros(3, n_t, dtype=torch.float64, device=dev)  # per tensor: a·b, |left|², |right|²
        left = (rank & dist) == 0
        segs: Segs = []
        idx: Optional[torch.Tensor] = None
        level: Optional[kernels.AdasumPair] = None
        if active:
            peer = rank ^ dist
            mid = lo + _half(hi - lo)
            (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            segs, idx = buf.plan(klo, khi, dev)
            comm.exchange({peer: buf.messages(slo, shi)}, {peer: recv_messages(klo, khi)})
            if segs:
                level = pair(segs)
                dot, na, nb = level.dots()
                # row 1: the left subtree's |.|², row 2: the right one's
                _sums_into(part, idx, (dot, na, nb) if left else (dot, nb, na))
        else:
            comm.exchange({}, {}, device=dev)
        tot = _block_sum(part.reshape(-1), comm, rank, 2 * dist, active).view(3, n_t)
        if active:
            dot, nl, nr = tot[0], tot[1], tot[2]
            ca, cb = _coefficients(dot, nl, nr, eps) if left else _coefficients(dot, nr, nl, eps)
            if level is not None:
                combine(level, idx, ca, cb)
            kept.append((dist, lo, hi))
            lo, hi = klo, khi
        dist *= 2

    # all-gather by distance halving: swap finished slices, straight into the tensors, until every rank
    # holds everything
    for level in range(p2.bit_length() - 2, -1, -1):
        if active:
            dist, plo, phi = kept[level]
            peer = rank ^ dist
            olo, ohi = (hi, phi) if (rank & dist) == 0 else (plo, lo)
            comm.exchange({peer: buf.messages(lo, hi)}, {peer: buf.messages(olo, ohi)})
            lo, hi = plo, phi
        else:
            comm.exchange({}, {}, device=dev)

    # fold out
    if rank >= p2:
        comm.exchange({}, {rank - p2: buf.messages(0, n)}, device=dev)
    elif rank < extra:
        comm.exchange({rank + p2: buf.messages(0, n)}, {}, device=dev)
    else:
        comm.exchange({}, {}, device=dev)


def adasum_flat(buf: torch.Tensor, sizes: List[int], comm: Comm, eps: float = HOROVOD_EPS,
                scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Adasum of `buf` (the concatenation of tensors of `sizes`) across `comm`, in place; returns `buf`.

    `buf` may be any floating tensor of that many elements in any layout (a non-contiguous one is reduced
    as a contiguous copy and the result copied back). Bad input is rejected before any communication.
    `scratch`, if given, is a contiguous receive buffer of `buf`'s dtype and device and size."""
    check_adasum_inputs([buf], "adasum_flat")
    sizes = [int(k) for k in sizes]
    if any(k < 0 for k in sizes) or buf.numel() != sum(sizes):
        raise ValueError(f"adasum_flat: buffer has {buf.numel()} elements, sizes {sizes} sum to {sum(sizes)}")
    if scratch is not None and (scratch.dtype != buf.dtype or scratch.device != buf.device
                                or not scratch.is_contiguous() or scratch.numel() != buf.numel()):
        raise ValueError("adasum_flat: scratch must be contiguous, of the buffer's dtype, device and size "
                         f"(got {scratch.dtype} {scratch.device} with {scratch.numel()} elements)")
    if comm.size == 1 or not buf.numel():
        return buf
    work = buf if buf.is_contiguous() else buf.contiguous()
    flat = work.view(-1)  # already one chunk: nothing to pack, one message per swap
    _adasum_virtual(_Virtual(list(torch.split(flat, sizes)), [flat]), comm, eps,
                    None if scratch is None else scratch.view(-1))
    if work is not buf:
        buf.copy_(work)
    return buf
