"""`adasum`: Adaptive Summation (Maleki et al., MLSys'21), per tensor, over any group of any size.

Two gradients a, b of one tensor combine as `(1 - a·b/(2|a|²)) a + (1 - a·b/(2|b|²)) b` (a coefficient is 1
where that squared norm is below `eps`): orthogonal gradients add, identical ones average. Across ranks
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

Unlike Horovod (MPI only, power-of-two ranks, global set) this runs on any `Comm`: the ranks beyond the
largest power of two P fold their gradient into rank r - P first (a local pairwise Adasum) and get the
result back at the end. Every slice of the result is computed by exactly one rank, so all replicas end
bit-identical. Every rank calls the same sequence of collectives (idle ranks with empty exchanges), as
`Comm.exchange` requires.
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Sequence, Tuple

import torch

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, group_by_dtype, register_aggregator

Segs = List[Tuple[int, int, int]]  # (tensor index, start, end) in flat-buffer coordinates


@register_aggregator("adasum")
class Adasum(Aggregator):
    """Adasum of all replicas' gradients, tensor by tensor; identical result on every replica."""

    class Options(StrictModel):
        #: a squared norm below this counts as zero: that side's coefficient is 1 (Horovod uses 1e-8)
        eps: float = 1e-8

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scratch: Dict[torch.dtype, torch.Tensor] = {}

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        p2 = 1 << (comm.size.bit_length() - 1)
        self.report = {"ranks": comm.size, "levels": p2.bit_length() - 1, "folded_ranks": comm.size - p2}
        if comm.size == 1 or not grads:
            return grads
        for idx in group_by_dtype(grads).values():  # one pass per dtype; every rank has the same groups
            tensors = [grads[i] for i in idx]
            work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
            n = sum(t.numel() for t in work)
            adasum_tensors(work, comm, self.options.eps, self._scratch_for(work[0], n))
            for t, w in zip(tensors, work):
                if w is not t:
                    t.copy_(w)
        return grads

    def _scratch_for(self, like: torch.Tensor, n: int) -> torch.Tensor:
        s = self._scratch.get(like.dtype)
        if s is None or s.numel() < n or s.device != like.device:
            s = torch.empty(n, dtype=like.dtype, device=like.device)
            self._scratch[like.dtype] = s
        return s[:n]


class _Virtual:
    """Contiguous tensors seen as one flat buffer (their concatenation), without copying them into one.

    `chunks` tile the same buffer in the same order, each contiguous in memory (by default the tensors
    themselves): messages are cut at chunk boundaries, so tensors packed into one chunk travel as one
    message, while dot products and combinations still go tensor by tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor] = ()):
        self.views, self.offsets = _layout(tensors)
        self.chunk_views, self.chunk_offsets = _layout(chunks) if chunks else (self.views, self.offsets)
        self.n = self.offsets[-1]
        if self.chunk_offsets[-1] != self.n:
            raise ValueError(f"adasum: chunks hold {self.chunk_offsets[-1]} elements, the tensors {self.n}")

    def segments(self, lo: int, hi: int) -> Segs:
        """The pieces of each tensor inside [lo, hi) (empty pieces left out)."""
        return _cut(self.offsets, lo, hi)

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


def _coefficients(dot: torch.Tensor, mine: torch.Tensor, other: torch.Tensor, eps: float):
    one = torch.ones_like(dot)
    ca = torch.where(mine >= eps, 1.0 - dot / mine * 0.5, one)
    cb = torch.where(other >= eps, 1.0 - dot / other * 0.5, one)
    return ca, cb


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
            comm.exchange({}, {})
        mask *= 2
    return part


#: tensors up to this many elements (biases, norms) are packed into one buffer and travel as one message:
#: every point-to-point message costs tens of microseconds of CPU under gloo, whatever its size
PACK_NUMEL = 1 << 16


def adasum_tensors(tensors: Sequence[torch.Tensor], comm: Comm, eps: float = 1e-8,
                   scratch: torch.Tensor = None) -> Sequence[torch.Tensor]:
    """Adasum of each of `tensors` (contiguous, one dtype) across `comm`, in place; returns `tensors`."""
    if comm.size == 1 or not tensors:
        return tensors
    small = [t for t in tensors if t.numel() <= PACK_NUMEL]
    if len(small) < 2:
        _adasum_virtual(_Virtual(tensors), comm, eps, scratch)
        return tensors
    # same shapes on every rank -> the same packing everywhere; the small tensors go first, packed
    large = [t for t in tensors if t.numel() > PACK_NUMEL]
    pack = torch.cat([t.reshape(-1) for t in small])
    packed = list(torch.split(pack, [t.numel() for t in small]))
    _adasum_virtual(_Virtual(packed + large, [pack] + large), comm, eps, scratch)
    for t, v in zip(small, packed):
        t.view(-1).copy_(v)
    return tensors


def _adasum_virtual(buf: _Virtual, comm: Comm, eps: float, scratch: torch.Tensor = None) -> None:
    size, rank = comm.size, comm.rank
    n, n_t = buf.n, len(buf.views)
    recv = scratch if scratch is not None else torch.empty(n, dtype=buf.views[0].dtype, device=buf.views[0].device)
    if recv.numel() != n:
        raise ValueError(f"adasum: scratch has {recv.numel()} elements, the tensors {n}")

    def into_recv(segs: Segs) -> List[torch.Tensor]:
        return [recv[s:e] for _, s, e in segs]

    def recv_messages(lo: int, hi: int) -> List[torch.Tensor]:
        return [recv[s:e] for s, e in buf.message_bounds(lo, hi)]

    def combine(segs: Segs, ca: torch.Tensor, cb: torch.Tensor) -> None:
        if segs:
            ts = torch.tensor([t for t, _, _ in segs])
            mine = buf.pieces(segs)
            kernels.adasum_combine(mine, into_recv(segs), ca[ts], cb[ts], out=mine)

    p2 = 1 << (size.bit_length() - 1)
    extra = size - p2

    # fold in: rank p2+i hands its gradient to rank i, which combines the two locally
    everything = buf.segments(0, n)
    if rank >= p2:
        comm.exchange({rank - p2: buf.messages(0, n)}, {})
    elif rank < extra:
        comm.exchange({}, {rank + p2: recv_messages(0, n)})
        sums = torch.zeros(3, n_t, dtype=torch.float64)  # per tensor, as `combine` indexes them (an empty
        sums[:, [t for t, _, _ in everything]] = torch.stack(  # tensor has no segment)
            kernels.adasum_dots(buf.pieces(everything), into_recv(everything)))
        combine(everything, *_coefficients(sums[0], sums[1], sums[2], eps))
    else:
        comm.exchange({}, {})

    # reduce-scatter by vector halving, distance doubling
    active = rank < p2
    lo, hi = 0, n
    kept: List[Tuple[int, int, int]] = []  # (distance, parent lo, parent hi) for the gather phase
    dist = 1
    while dist < p2:
        part = torch.zeros(3, n_t, dtype=torch.float64)
        left = (rank & dist) == 0
        segs: Segs = []
        if active:
            peer = rank ^ dist
            mid = lo + (hi - lo) // 2
            (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            segs = buf.segments(klo, khi)
            comm.exchange({peer: buf.messages(slo, shi)}, {peer: recv_messages(klo, khi)})
            if segs:
                ts = torch.tensor([t for t, _, _ in segs])
                dot, na, nb = kernels.adasum_dots(buf.pieces(segs), into_recv(segs))
                part[0, ts] = dot
                part[1, ts] = na if left else nb  # row 1: the left subtree's |.|², row 2: the right one's
                part[2, ts] = nb if left else na
        else:
            comm.exchange({}, {})
        tot = _block_sum(part.reshape(-1), comm, rank, 2 * dist, active).view(3, n_t)
        if active:
            dot, nl, nr = tot[0], tot[1], tot[2]
            ca, cb = _coefficients(dot, nl, nr, eps) if left else _coefficients(dot, nr, nl, eps)
            combine(segs, ca, cb)
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
            comm.exchange({}, {})

    # fold out
    if rank >= p2:
        comm.exchange({}, {rank - p2: buf.messages(0, n)})
    elif rank < extra:
        comm.exchange({rank + p2: buf.messages(0, n)}, {})
    else:
        comm.exchange({}, {})


def adasum_flat(buf: torch.Tensor, sizes: List[int], comm: Comm, eps: float = 1e-8,
                scratch: torch.Tensor = None) -> torch.Tensor:
    """Adasum of `buf` (the concatenation of tensors of `sizes`) across `comm`, in place; returns `buf`."""
    if buf.numel() != sum(sizes):
        raise ValueError(f"adasum_flat: buffer has {buf.numel()} elements, sizes sum to {sum(sizes)}")
    flat = buf.view(-1)
    if comm.size > 1 and flat.numel():  # already one chunk: nothing to pack, one message per swap
        _adasum_virtual(_Virtual(list(torch.split(flat, list(sizes))), [flat]), comm, eps, scratch)
    return buf
