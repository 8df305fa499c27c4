"""`gossip`: sparse, compressed gossip instead of an all-reduce (CHOCO-SGD-style error feedback).

Each step:
1. every rank derives the same random peer graph from (seed, step): the ranks sit on a seeded random ring
   and each talks to its `peers` nearest ring neighbours (plus one random matching when `peers` is odd);
   mixing weights are Metropolis-Hastings, 1/(1 + max(deg_i, deg_j)), symmetric and doubly stochastic;
2. a rank adds its gradient to the part of its past updates not yet shared (the error-feedback buffer),
   sends the `ratio` largest entries of that sum to its peers (`comm.exchange`, values + indices) and
   keeps the rest for later;
3. it applies  w_ii c_i + sum_j w_ij c_j  of the messages c. Because the weights are doubly stochastic the
   group's average update equals the average of what was sent: nothing is lost, only delayed.
Every `sync_every` steps an exact all-reduce moves every replica to the group's average cumulative update
(sent + still buffered), so replicas differ only between syncs. `report["consensus_distance"]` is the RMS
distance of the replicas' cumulative updates from their average, estimated from a 64-bucket count sketch
summed in float64 (one all-gather of 64 float64 per rank; the same number on every device).

Data shares ("weight"): with unequal per-rank sample counts a rank's gradient enters multiplied by m x its
share of the step's samples. Mixing and the exact syncs keep the group's average, so the replicas' average
update is the sample-weighted mean (the exact mean over the step's samples), as with `mean`.

Small groups: `peers` is capped at m - 1 (everyone), with one GroupSizeWarning naming the key; a group of
one is the identity (it applies its gradient plus whatever error feedback it still holds).

Same result on every device: everything random is drawn on the host from seeded CPU generators (the
peer graph, the sketch's signs), the top-k follows `pdv_ext.kernels`' contract (ascending indices, ties to
the lower index, NaN above +inf) whichever implementation answers, indices travel as integers beside the
values (never bit-cast into the float payload), and the mix is formed in a fixed order (peers in
ascending rank, then the own message) with each weighted message rounded once (`w * vals`, then a plain
add: no multiply-add that a device may fuse and another may not). Each target entry receives at most one
add per message (the k indices are distinct), so `index_add_`'s scatter order does not matter.

Host syncs on CUDA: none in the mix; one per call for the reported consensus distance (a float for the
Monitor), after its all-reduce on the device. The top-k's are those of the kernel implementation.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from pydantic import Field

from .. import kernels
from ..comm.base import Comm
from ..config_base import StrictModel
from .base import Aggregator, register_aggregator
from .groups import SmallGroups
from .robust import exact, flat_dtype, flatten_as, write_back

SKETCH = 64
#: rows of 64 entries summed per float64 chunk of the sketch (CPU: a cache-sized chunk; a device: few launches)
SKETCH_ROWS_CPU = 4096
SKETCH_ROWS_DEVICE = 1 << 16


def peer_graph(size: int, peers: int, seed: int, step: int) -> List[List[int]]:
    """Neighbour lists of the step's random peer graph (identical on every rank)."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    ring = torch.randperm(size, generator=g).tolist()
    pos = {r: i for i, r in enumerate(ring)}
    nbrs = [set() for _ in range(size)]
    for r in range(size):
        for d in range(1, peers // 2 + 1):
            for other in (ring[(pos[r] + d) % size], ring[(pos[r] - d) % size]):
                if other != r:
                    nbrs[r].add(other)
    if peers % 2:
        if size % 2 == 0:  # the opposite point of the ring: a perfect matching
            for r in range(size):
                nbrs[r].add(ring[(pos[r] + size // 2) % size])
        else:  # a random matching of size - 1 ranks (one rank keeps one peer fewer)
            order = torch.randperm(size, generator=g).tolist()[: size - 1]
            for a, b in zip(order[0::2], order[1::2]):
                nbrs[a].add(b)
                nbrs[b].add(a)
    return [sorted(n - {r}) for r, n in enumerate(nbrs)]


@register_aggregator("gossip")
class Gossip(SmallGroups, Aggregator):
    """Top-k gossip with error feedback; replicas drift between exact syncs by design."""

    #: replicas apply different updates (the non-finite guard must agree before aggregating)
    replicas_identical = False
    shares = "weight"
    per_parameter_state = ("residual", "applied")

    class Options(StrictModel):
        #: peers each rank exchanges with per step (capped at the data-parallel group size - 1)
        peers: int = Field(2, ge=1)
        #: fraction of entries sent per step, in (0, 1]; 1 sends the whole not-yet-shared update
        ratio: float = Field(0.01, gt=0, le=1)
        #: exact all-reduce every this many steps (0 = never)
        sync_every: int = Field(0, ge=0)
        #: seed of the peer schedule (identical on every rank)
        seed: int = 0

    def __init__(self, options=None, **kw):
        super().__init__(options, **kw)
        self.residual: Optional[torch.Tensor] = None  # not-yet-shared part of this rank's updates
        self.applied: Optional[torch.Tensor] = None   # cumulative update applied by this rank
        self._sketch: Optional[Dict[str, Any]] = None  # row signs of the consensus sketch, for n entries
        self._buf: Optional[torch.Tensor] = None  # flat gradients / output, reused

    def set_peers(self, peers: int) -> None:
        """Change the peer count (policy action SetGossipPeers); takes effect at the next step."""
        self.options.peers = int(peers)

    group_limits = {"peers": (lambda m: m - 1, "a rank has at most m - 1 peers")}

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        peers_now = self.fit_group(comm)["peers"]
        opt = self.options
        g = self._buf = flatten_as(grads, flat_dtype(grads), out=self._buf)  # reused; free again after top-k
        factor = self.share_factor(comm)
        if factor is not None:  # unequal data shares: the group's average update becomes sample-weighted
            g.mul_(factor)
        n = g.numel()
        if self.residual is None or self.residual.numel() != n:
            self.residual = torch.zeros_like(g)
            self.applied = torch.zeros_like(g)
        self.residual = self.residual.to(device=g.device, dtype=g.dtype)
        self.applied = self.applied.to(device=g.device, dtype=g.dtype)
        synced = opt.sync_every > 0 and (self.step + 1) % opt.sync_every == 0
        if comm.size == 1:  # alone: apply everything, shared with nobody (identity when nothing is held back)
            out = g.add_(self.residual)
            self.residual.zero_()
            self.applied += out
            peers: List[int] = []
        elif synced:
            target = self.applied + self.residual + g
            comm.all_reduce(target, "sum")  # then a true division (robust.exact): the same bits everywhere
            target.div_(exact(comm.size, target))
            out = target - self.applied
            self.residual.zero_()
            peers = []
            self.applied += out
        else:
            out, peers = self._gossip(g, comm, peers_now)  # adds what it applies to self.applied, sparsely
        self.report = {"consensus_distance": self._consensus_distance(comm), "peers": peers, "synced": synced}
        return write_back(out, grads)

    def _gossip(self, g: torch.Tensor, comm: Comm, n_peers: int):
        opt, n, me = self.options, g.numel(), comm.rank
        nbrs = peer_graph(comm.size, n_peers, opt.seed, self.step)
        k = n if opt.ratio >= 1 else max(1, min(n, math.ceil(opt.ratio * n)))
        idx, vals = kernels.topk_error_feedback(g, self.residual, k)
        vals = vals.to(g.dtype)
        if k == n:  # every entry, in index order: the values are the dense message
            msg = [vals]
        else:  # values and their indices (int32 while they fit) as one two-part message
            msg = [vals, idx.to(torch.int32 if n < 2 ** 31 else torch.int64)]
        recvs = {p: [torch.empty_like(t) for t in msg] for p in nbrs[me]}
        comm.exchange({p: msg for p in nbrs[me]}, recvs, device=g.device)
        deg = [len(x) for x in nbrs]
        out = g.zero_()  # the flat gradient is in the residual now: its buffer becomes the output
        self_w = 1.0
        for p in sorted(recvs):  # a fixed order of adds: peers in ascending rank, then the own message
            w = 1.0 / (1 + max(deg[me], deg[p]))
            self_w -= w
            self._add(recvs[p], w, out, self.applied)
        self._add(msg, self_w, out, self.applied)
        return out, nbrs[me]

    @staticmethod
    def _add(msg: List[torch.Tensor], w: float, *targets: torch.Tensor) -> None:
        """targets += (w x the message's values), the product rounded once (dense when the message carries
        every entry, else at its k distinct indices: a sparse message costs k, not n)."""
        scaled = msg[0] * w
        if len(msg) == 1:
            for t in targets:
                t.add_(scaled)
            return
        idx = msg[1].long()
        for t in targets:
            t.index_add_(0, idx, scaled)

    def _consensus_distance(self, comm: Comm) -> float:
        """sqrt(mean_i |u_i - mean u|^2) of the cumulative updates u, from a linear sketch of each: entry j
        goes to bucket j mod 64, and every row of 64 consecutive entries gets one seeded random sign, so
        the sketch is one matrix-vector product over u seen as (n/64, 64). Independent signs per row make
        |sketch|^2 an unbiased estimate of |u|^2 (cross terms within a bucket come from different rows,
        whose signs are independent); striping spreads every tensor over all buckets. 4 bytes of state per
        64 entries.

        Exact enough to be the same number on every device: the sketch is summed in float64 (the +-1
        products of float32 values are exact, so only float64 rounding remains, ~1e-16 of |u|), in chunks
        of rows so no float64 copy of u is made; the ranks' sketches are all-gathered (64 float64 each)
        and the spread is taken about their mean. A float32 sketch carried rounding of ~1e-8 |u| that
        depends on the device's summation order, and the uncentred E[x^2] - E[x]^2 cancelled: replicas
        equal up to rounding (after a sync, or with every rank a peer) got a distance that was that
        rounding, different on CPU and CUDA. 16 M entries on CPU: ~5 ms (a float32 sketch took ~3)."""
        u = self.applied
        n = u.numel()
        if comm.size == 1 or n == 0:
            return 0.0
        rows, full = n // SKETCH, n - n % SKETCH
        sign = self._sketch["sign"] if self._sketch is not None and self._sketch["n"] == n else None
        if sign is None or sign.device != u.device:
            gen = torch.Generator().manual_seed(12345)
            # drawn on the host (the same signs whatever the device), uploaded without a stream sync
            sign = torch.randint(0, 2, (rows + 1,), generator=gen).to(torch.float64).mul_(2).sub_(1)
            sign = sign.to(u.device, non_blocking=True)
            self._sketch = {"sign": sign, "n": n}
        m, me = comm.size, comm.rank
        sk = torch.zeros(m, SKETCH, dtype=torch.float64, device=u.device)
        mine = sk[me]
        if rows:
            step = SKETCH_ROWS_CPU if u.device.type == "cpu" else SKETCH_ROWS_DEVICE
            view = u[:full].view(rows, SKETCH)
            buf = torch.empty(min(step, rows), SKETCH, dtype=torch.float64, device=u.device)
            for r0 in range(0, rows, step):  # a fixed order of chunks: float64 copies a chunk at a time
                part = view[r0:r0 + step]
                chunk = buf[: part.shape[0]]
                chunk.copy_(part)
                mine.addmv_(chunk.t(), sign[r0:r0 + part.shape[0]])
        mine[: n - full] += u[full:].double() * sign[rows]  # the ragged last row
        comm.all_gather_into(sk)  # on the device: the host sees only the final number
        var = (sk - sk.sum(0).div_(exact(m, sk))).pow_(2).sum().div_(exact(m, sk)).sqrt()
        return float(var)  # the call's one host sync

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "residual": self.residual, "applied": self.applied,
                "peers": self.options.peers, "seed": self.options.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.residual = state.get("residual")
        self.applied = state.get("applied")
        if "peers" in state:
            self.options.peers = int(state["peers"])
        if "seed" in state:
            self.options.seed = int(state["seed"])
