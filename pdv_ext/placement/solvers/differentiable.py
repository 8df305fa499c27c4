"""`differentiable`: pipeDejavu's idea, made to work - a relaxation of the plan optimised by gradient descent.

Relaxation (torch autograd), for each allowed data-parallel width w:

* boundaries: S positive increments softmax(theta) * L, cumulated, give real-valued cuts b_1 < ... < b_{S-1};
  layer i belongs to stage s with weight sigmoid((i + 0.5 - b_s)/tau) - sigmoid((i + 0.5 - b_{s+1})/tau);
  the activation crossing cut s is a softmax-weighted (by distance to the cut) mix of the layers' outputs;
* placement: a Gumbel-softmax over the same device-group chains the `dp` solver searches
  (`dp.candidate_chains`), each chain giving every stage its speed, p2p links, reduction cost and memory;
* cost: the cost model with max replaced by a log-sum-exp, plus a quadratic memory-overflow penalty.

tau anneals from 2 layers to 0.1 over the steps. The result is rounded (nearest cut, argmax chain) and
repaired: cuts made strictly increasing, then a +-1 cut local search and a chain re-pick until the plan is
memory-feasible and no single move improves it. The returned plan is scored by the same cost model as the
other solvers; `meta` records the relaxed objective and the steps taken.
"""
from __future__ import annotations

import math
import time
from typing import Any, List, Optional, Sequence

import numpy as np

from ..cluster import Cluster
from ..cost import OPTIMIZER_STATE_FACTOR, evaluate, stage_params
from ..plan import Plan
from ..profile import Profile
from .base import divisors_widths, register_solver
from .dp import ChainDP, candidate_chains


def _chain_tensors(sps):
    import torch

    speed, lat, bw, ra, rb, cap, infl = [], [], [], [], [], [], []
    for sp in sps:
        speed.append(sp.speed)
        # worst replica link per cut (the cost model takes the max over pairs; one pair dominates in practice)
        lat.append([max((p[0] for p in pr), default=0.0) for pr in sp.p2p])
        bw.append([min((p[1] for p in pr), default=float("inf")) for pr in sp.p2p])
        ra.append(sp.reduce_a)
        rb.append(sp.reduce_b)
        cap.append(sp.mem_cap)
        infl.append(sp.inflight)
    t = lambda x: torch.tensor(np.asarray(x, dtype=float), dtype=torch.float64)  # noqa: E731
    return t(speed), t(lat), t(bw), t(ra), t(rb), t(cap), t(infl)


def _round(cuts: np.ndarray, num_layers: int) -> List[int]:
    s = len(cuts) + 1
    b = [0] + [int(round(c)) for c in cuts] + [num_layers]
    for i in range(1, s):
        b[i] = min(max(b[i], b[i - 1] + 1), num_layers - (s - i))
    return b


class _Scorer:
    """Fast cost of (bounds, chain k) with the DP's prefix-sum arithmetic (same numbers as cost.evaluate)."""

    def __init__(self, profile, chains, sps, micro_batches):
        self.dps = [ChainDP(profile, sp) for sp in sps]
        self.b1 = micro_batches - 1

    def __call__(self, bounds: Sequence[int], k: int) -> float:
        d = self.dps[k]
        mt, st, mr = d.stats(bounds)
        over = 0.0
        for s in range(d.S):
            lo, hi = bounds[s], bounds[s + 1]
            mem = OPTIMIZER_STATE_FACTOR * (d.P[hi] - d.P[lo]) + d.sp.inflight[s] * (d.V[hi] - d.V[lo])
            if math.isfinite(d.sp.mem_cap[s]):
                over += max(0.0, mem / d.sp.mem_cap[s] - 1.0)
        cost = self.b1 * mt + st + mr
        return cost * (1.0 + 10.0 * over) + (1e12 * over)


def _repair(score: _Scorer, bounds: List[int], k: int, num_layers: int, max_rounds: int = 200):
    """Local search: +-1 moves of single cuts and re-picking the chain, best-improvement, until stable."""
    best = score(bounds, k)
    for _ in range(max_rounds):
        cand = (best, bounds, k)
        for j in range(len(score.dps)):
            v = score(bounds, j)
            if v < cand[0] - 1e-15:
                cand = (v, bounds, j)
        for i in range(1, len(bounds) - 1):
            for d in (-1, 1):
                nb = list(bounds)
                nb[i] += d
                if not (nb[i - 1] < nb[i] < nb[i + 1]):
                    continue
                v = score(nb, k)
                if v < cand[0] - 1e-15:
                    cand = (v, nb, k)
        if cand[0] >= best - 1e-15:
            break
        best, bounds, k = cand
    return bounds, k


def _optimise(profile: Profile, cluster: Cluster, w: int, micro_batches: int, schedule: str, aggregator: str,
              steps: int, seed: int, lr: float):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead (and fight other processes)
    try:
        return _optimise_inner(profile, cluster, w, micro_batches, schedule, aggregator, steps, seed, lr)
    finally:
        torch.set_num_threads(threads)


def _optimise_inner(profile, cluster, w, micro_batches, schedule, aggregator, steps, seed, lr):
    import torch

    L = len(profile)
    s = len(cluster) // w
    named = candidate_chains(cluster, w)
    names, chains = list(named), list(named.values())
    arr = profile.arrays()
    c = torch.tensor(arr["fwd_bwd"], dtype=torch.float64)
    scale = float(c.sum()) / s or 1.0
    c = c / scale
    p = torch.tensor(arr["param_bytes"], dtype=torch.float64)
    a = torch.tensor(arr["act_bytes"], dtype=torch.float64)
    v = torch.tensor(arr["saved_bytes"], dtype=torch.float64)
    u = torch.tensor(arr["update"], dtype=torch.float64) / scale
    m = torch.tensor(arr["p2p"], dtype=torch.float64) / scale
    sps = [stage_params(cluster, ch, micro_batches, schedule, aggregator, profile.engine) for ch in chains]
    speed, lat, bw, ra, rb, cap, infl = _chain_tensors(sps)
    lat, ra = lat / scale, ra / scale
    eng = torch.tensor(np.array([sp.overhead for sp in sps]), dtype=torch.float64) / scale     # (K, S)
    tfix = torch.tensor(np.array([sp.tail_fixed for sp in sps]), dtype=torch.float64) / scale
    bw, rb = bw * scale, rb / scale
    gen = torch.Generator().manual_seed(seed)
    # start from the split that balances compute against the stages' mean speed over the chains
    v0 = speed.mean(0).numpy()
    cum = np.concatenate([[0.0], np.cumsum(arr["fwd_bwd"])])
    share = np.cumsum(v0) / v0.sum()
    cuts0 = _round(np.array([np.searchsorted(cum, cum[-1] * share[i - 1]) for i in range(1, s)], dtype=float), L)
    theta = torch.log(torch.tensor(np.diff(cuts0), dtype=torch.float64)).requires_grad_(True)
    phi = torch.zeros(len(chains), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theta, phi], lr=lr)
    centers = torch.arange(L, dtype=torch.float64) + 0.5
    ends = torch.arange(1, L + 1, dtype=torch.float64)
    b1 = micro_batches - 1
    tau0 = 0.5 * L / s
    last = float("nan")
    for step in range(steps):
        frac = step / max(1, steps - 1)
        tau = tau0 * (0.1 ** frac)          # layers: from half a mean stage to a twentieth
        temp = 1.0 * (0.1 ** frac)          # Gumbel-softmax temperature
        inc = torch.softmax(theta, 0) * L
        cuts = torch.cumsum(inc, 0)[:-1]                                    # (S-1,)
        edges = torch.cat([torch.tensor([-1e9], dtype=torch.float64), cuts,
                           torch.tensor([1e9], dtype=torch.float64)])
        sig = torch.sigmoid((centers[None, :] - edges[:, None]) / tau)    # (S+1, L)
        member = sig[:-1] - sig[1:]                                         # (S, L)
        near = torch.softmax(-((ends[None, :] - cuts[:, None]) / tau) ** 2, dim=1)  # (S-1, L)
        act = near @ a                                                      # (S-1,)
        comp = member @ c                                                   # (S,)
        prm = member @ p
        sav = member @ v
        t = comp[None, :] / speed                                           # (K, S)
        x = lat[:, :-1] + act[None, :] / bw[:, :-1]                         # (K, S-1) link, one way
        msg = torch.nn.functional.pad(near @ m, (1, 1))                    # (S+1,) per cut, 0 at the ends
        t = t + (msg[:-1] + msg[1:])[None, :] / speed                       # send/recv work at both cuts
        t = t + eng                                                         # engine work per micro-batch
        r = ra + rb * prm[None, :] + (member @ u)[None, :] / speed + tfix      # tail: reduce + update + engine
        smooth = 0.05 * (t.detach().mean() + 1e-12)
        tmax = smooth * torch.logsumexp(torch.cat([t, x], dim=1) / smooth, dim=1)  # stages and links
        rs = 0.05 * (r.detach().mean() + 1e-12)
        rmax = rs * torch.logsumexp(r / rs, dim=1) if float(r.detach().abs().max()) > 0 else r.sum(1) * 0
        mem = OPTIMIZER_STATE_FACTOR * prm[None, :] + infl * sav[None, :]
        finite = torch.isfinite(cap)
        over = torch.where(finite, torch.relu(mem / torch.where(finite, cap, torch.ones_like(cap)) - 1), 0 * mem)
        cost = b1 * tmax + t.sum(1) + 2 * x.sum(1) + rmax + 10.0 * (over ** 2).sum(1) * (t.sum(1).detach() + 1)
        g = -torch.log(-torch.log(torch.rand(len(chains), generator=gen, dtype=torch.float64) * (1 - 2e-9) + 1e-9))
        pi = torch.softmax((phi + g) / temp, 0)
        loss = (pi * cost).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = float(loss.detach()) * scale
    with torch.no_grad():
        cuts = (torch.cumsum(torch.softmax(theta, 0) * L, 0)[:-1]).numpy()
    k = int(torch.argmax(phi))
    bounds = _round(cuts, L)
    bounds, k = _repair(_Scorer(profile, chains, sps, micro_batches), bounds, k, L)
    return bounds, chains[k], names[k], last


@register_solver("differentiable")
def solve_differentiable(profile: Profile, cluster: Cluster, num_stages: Optional[int], micro_batches: int,
                         schedule: str = "1f1b", aggregator: str = "mean", steps: int = 200, seed: int = 0,
                         lr: float = 0.02, max_widths: int = 6, **_: Any) -> Plan:
    """Gradient descent on the relaxed cost (see module docstring), then rounding + repair."""
    t0 = time.perf_counter()
    widths = divisors_widths(len(cluster), len(profile), num_stages)
    if len(widths) > max_widths:  # spread the tried widths over the range (log-spaced)
        idx = np.unique(np.round(np.linspace(0, len(widths) - 1, max_widths)).astype(int))
        widths = [widths[i] for i in idx]
    best = None
    for w in widths:
        if len(cluster) // w == 1:
            bounds, chain, name, relaxed = [0, len(profile)], [list(range(len(cluster)))], "all", float("nan")
        else:
            bounds, chain, name, relaxed = _optimise(profile, cluster, w, micro_batches, schedule, aggregator,
                                                     steps, seed, lr)
        plan = Plan.scored(profile, cluster, bounds, chain, micro_batches, solver="differentiable",
                           schedule=schedule, aggregator=aggregator, chain=name, relaxed_cost=relaxed, steps=steps)
        key = (not plan.feasible, plan.predicted_step_time)
        if best is None or key < (not best.feasible, best.predicted_step_time):
            best = plan
    best.solve_seconds = time.perf_counter() - t0
    return best
