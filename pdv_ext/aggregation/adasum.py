"""`adasum`: Adaptive Summation (Maleki et al., MLSys'21), per tensor, over any group of any size.

Two gradients a, b of one tensor combine as `(1 - a·b/(2|a|²)) a + (1 - a·b/(2|b|²)) b` (a coefficient is 1
where that squared norm is below `eps`): orthogonal gradients add, identical ones average. Across ranks
the combination is the tree of Horovod's AdasumMPI: recursive vector-halving / distance-doubling. At the
level of distance d, partners r and r^d swap halves of their current slice of one flat buffer holding
every tensor, compute partial dot products and squared norms of each tensor on the half they keep (float64,
`pdv_ext.kernels`), sum those few scalars over the block of 2d ranks that now jointly hold the two
subtrees' results, and combine. A distance-halving gather then rebuilds the whole buffer on every rank.

Unlike Horovod (MPI only, power-of-two ranks, global set) this runs on any `Comm`: the ranks beyond the
largest power of two P fold their gradient into rank r - P first (a local pairwise Adasum) and get the
result back at the end. Every slice of the result is computed by exactly one rank, so all replicas end
bit-identical. Every rank calls the same sequence of collectives (idle ranks with empty exchanges), as
`Comm.exchange` requires.
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Tuple

import torch

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, flatten, group_by_dtype, register_aggregator, unflatten_into

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
            buf = flatten(tensors)
            adasum_flat(buf, [t.numel() for t in tensors], comm, self.options.eps, self._scratch_for(buf))
            unflatten_into(buf, tensors)
        return grads

    def _scratch_for(self, buf: torch.Tensor) -> torch.Tensor:
        s = self._scratch.get(buf.dtype)
        if s is None or s.numel() < buf.numel() or s.device != buf.device:
            s = torch.empty(buf.numel(), dtype=buf.dtype, device=buf.device)
            self._scratch[buf.dtype] = s
        return s[: buf.numel()]


def _segments(offsets: List[int], lo: int, hi: int) -> Segs:
    """The pieces of each tensor inside [lo, hi) (empty pieces left out)."""
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


def _combine(buf: torch.Tensor, recv: torch.Tensor, segs: Segs, ca: torch.Tensor, cb: torch.Tensor) -> None:
    if not segs:
        return
    a = [buf[s:e] for _, s, e in segs]
    b = [recv[s:e] for _, s, e in segs]
    ts = torch.tensor([t for t, _, _ in segs])
    kernels.adasum_combine(a, b, ca[ts], cb[ts], out=a)


def adasum_flat(buf: torch.Tensor, sizes: List[int], comm: Comm, eps: float = 1e-8,
                scratch: torch.Tensor = None) -> torch.Tensor:
    """Adasum of `buf` (the concatenation of tensors of `sizes`) across `comm`, in place; returns `buf`."""
    size, rank = comm.size, comm.rank
    if size == 1:
        return buf
    n_t = len(sizes)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    n = offsets[-1]
    if buf.numel() != n:
        raise ValueError(f"adasum_flat: buffer has {buf.numel()} elements, sizes sum to {n}")
    recv = scratch if scratch is not None else torch.empty_like(buf)
    p2 = 1 << (size.bit_length() - 1)
    extra = size - p2

    # fold in: rank p2+i hands its gradient to rank i, which combines the two locally
    if rank >= p2:
        comm.exchange({rank - p2: buf}, {})
    elif rank < extra:
        comm.exchange({}, {rank + p2: recv})
        segs = _segments(offsets, 0, n)
        dot, mine, other = kernels.adasum_dots([buf[s:e] for _, s, e in segs], [recv[s:e] for _, s, e in segs])
        _combine(buf, recv, segs, *_coefficients(dot, mine, other, eps))
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
        if active:
            peer = rank ^ dist
            mid = lo + (hi - lo) // 2
            (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            comm.exchange({peer: buf[slo:shi]}, {peer: recv[klo:khi]})
            segs = _segments(offsets, klo, khi)
            if segs:
                ts = torch.tensor([t for t, _, _ in segs])
                dot, na, nb = kernels.adasum_dots([buf[s:e] for _, s, e in segs], [recv[s:e] for _, s, e in segs])
                part[0, ts] = dot
                part[1, ts] = na if left else nb  # row 1: the left subtree's |.|², row 2: the right one's
                part[2, ts] = nb if left else na
        else:
            comm.exchange({}, {})
        gathered = comm.all_gather(part.reshape(-1))
        if active:
            base = rank - rank % (2 * dist)
            tot = gathered[base].clone()
            for r in range(base + 1, base + 2 * dist):  # fixed order: the same sum on every member
                tot += gathered[r]
            tot = tot.view(3, n_t)
            dot, nl, nr = tot[0], tot[1], tot[2]
            ca, cb = _coefficients(dot, nl, nr, eps) if left else _coefficients(dot, nr, nl, eps)
            _combine(buf, recv, segs, ca, cb)
            kept.append((dist, lo, hi))
            lo, hi = klo, khi
        dist *= 2

    # all-gather by distance halving: swap finished slices until every rank holds the whole buffer
    for level in range(p2.bit_length() - 2, -1, -1):
        if active:
            dist, plo, phi = kept[level]
            peer = rank ^ dist
            olo, ohi = (hi, phi) if (rank & dist) == 0 else (plo, lo)
            comm.exchange({peer: buf[lo:hi]}, {peer: buf[olo:ohi]})
            lo, hi = plo, phi
        else:
            comm.exchange({}, {})

    # fold out
    if rank >= p2:
        comm.exchange({}, {rank - p2: buf})
    elif rank < extra:
        comm.exchange({rank + p2: buf}, {})
    else:
        comm.exchange({}, {})
    return buf
