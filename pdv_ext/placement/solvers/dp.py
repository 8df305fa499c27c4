"""`dp`: exact dynamic programming over stage boundaries, stage count and device-group chains.

Search space (the optimum is exact over exactly this set, for the cost model in `cost.py`):

* data-parallel width w with w * S = number of devices (DeepSpeed: the same width on every stage) and
  1 <= S <= layers; or the given S;
* device groups and their order along the pipeline ("chain") from these candidates, each also reversed:
  ``host``   devices sorted by (host, speed desc, rank), cut into consecutive groups of w
             (data parallelism inside a host, neighbouring stages on the same host);
  ``speed``  devices sorted by (speed desc, host, rank), cut into groups of w (equal-speed groups);
  ``spread`` group j = every S-th device of the ``host`` order (each group spans hosts, neighbouring
             stages share hosts: cheap activations, reductions over the inter-host link);
* every split of the L layers into S contiguous non-empty ranges, stage s on chain group s.

Objective: step = (B-1) * max_s q_s + sum_s v_s + max_s r_s (see cost.py), memory-feasible only, where
q_s = max(t_s, x_s) (the stage's device time per micro-batch and its outgoing link's transfer), v_s =
t_s + 2 x_s and r_s is the stage's tail after the pipeline drains (gradient reduction + parameter update).

Algorithm, for one chain: q_s(k, l), v_s(k, l) and r_s(k, l) are prefix-sum expressions, so
G(M, R) = min sum_s v_s subject to q_s <= M, r_s <= R is an O(S * L * band) DP vectorised with numpy,
where band = the longest layer range whose compute fits M. F(M) = min_R R + G(M, R) is found by walking
R down through the breakpoints (the solution's own max r, then just below it) until the sum alone
exceeds the best; the outer walk does the same over M, starting from the minimal feasible bottleneck M*
(a min-max DP) and stopping when (B-1) M* + F(M) >= best. Both walks only visit values at which the
optimum changes, so they are exact, and in practice take a handful of DP passes.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..cluster import Cluster
from ..cost import OPTIMIZER_STATE_FACTOR, StageParams, stage_params
from ..plan import Plan
from ..profile import Profile
from .base import divisors_widths, register_solver

INF = float("inf")


def candidate_chains(cluster: Cluster, w: int) -> Dict[str, List[List[int]]]:
    """The group chains of the search space for data-parallel width w (see module docstring)."""
    n = len(cluster)
    s = n // w
    host_idx = {h: i for i, h in enumerate(cluster.hosts)}
    by_host = sorted(range(n), key=lambda d: (host_idx[cluster.host_of(d)], -cluster.speed(d), d))
    by_speed = sorted(range(n), key=lambda d: (-cluster.speed(d), host_idx[cluster.host_of(d)], d))
    chains = {
        "host": [by_host[i * w:(i + 1) * w] for i in range(s)],
        "speed": [by_speed[i * w:(i + 1) * w] for i in range(s)],
        "spread": [by_host[j::s] for j in range(s)],
    }
    out: Dict[str, List[List[int]]] = {}
    seen = set()
    for name, ch in chains.items():
        for tag, c in ((name, ch), (name + "-reversed", ch[::-1])):
            key = tuple(tuple(g) for g in c)
            if key not in seen:
                seen.add(key)
                out[tag] = c
    return out


class ChainDP:
    """The DP of one chain of device groups (numbers exactly as `cost.evaluate` computes them)."""

    def __init__(self, profile: Profile, sp: StageParams):
        arr = profile.arrays()
        self.L = len(profile)
        self.S = len(sp.speed)
        z = np.zeros(1)
        self.C = np.concatenate([z, np.cumsum(arr["fwd_bwd"])])
        self.P = np.concatenate([z, np.cumsum(arr["param_bytes"])])
        self.V = np.concatenate([z, np.cumsum(arr["saved_bytes"])])
        self.U = np.concatenate([z, np.cumsum(arr["update"])])
        self.sp = sp
        act = np.concatenate([z, arr["act_bytes"]])  # act[l] = output bytes of layer l-1 (boundary l)
        msg = np.concatenate([z, arr["p2p"]])
        # per boundary l: the stage's send/recv work at its output (comm) / its input (msg_in), and its
        # outgoing link's transfer (link); the engine's per-micro-batch work is a per-stage constant, in comm
        zero = np.zeros(self.L + 1)
        self.comm = [zero + sp.messages(s, 0.0, msg) + sp.overhead[s] for s in range(self.S)]
        self.link = [zero + (sp.link(s, act) if s < self.S - 1 else 0.0) for s in range(self.S)]
        self.msg_in = [zero + sp.messages(s, msg, 0.0) for s in range(self.S)]
        self.vmax = float(sp.speed.max())
        self._bands: Dict[int, Any] = {}
        self._terms: Dict[Tuple[int, int], Any] = {}
        self._cache_size = 0
        self._mstar = None
        self._ub = None

    def band(self, m: float) -> int:
        """Longest layer range whose compute alone fits under m on the fastest group (rounded up to the
        band of a generous bound, so that the walks below reuse one set of cached terms)."""
        cap = self.L - self.S + 1
        if not math.isfinite(m):
            return cap
        if self._ub is None:
            self._ub = self._upper_bound()
        if m <= self._ub:
            m = self._ub
        ends = np.searchsorted(self.C, self.C + m * self.vmax * (1 + 1e-12), side="right") - 1
        return int(max(1, min(cap, (ends - np.arange(self.L + 1)).max())))

    def _band_arrays(self, band: int):
        """Prefix-sum differences for every end l = 0..L and start l-1..l-band (shared by all stages)."""
        got = self._bands.get(band)
        if got is None:
            l = np.arange(self.L + 1)
            K = l[:, None] - np.arange(1, band + 1)[None, :]
            Kc = np.maximum(K, 0)
            got = (K, Kc, self.C[l][:, None] - self.C[Kc], self.P[l][:, None] - self.P[Kc],
                   self.V[l][:, None] - self.V[Kc], self.U[l][:, None] - self.U[Kc])
            if len(self._bands) > 8:
                self._bands.clear()
            self._bands[band] = got
        return got

    def _stage_terms(self, s: int, band: int):
        """For stage s: end indices l, candidate starts K (l x band), valid (incl. memory) mask, q (capped by
        the bottleneck), v (summed), r."""
        key = (s, band)
        got = self._terms.get(key)
        if got is not None:
            return got
        K, Kc, dC, dP, dV, dU = self._band_arrays(band)
        lo, hi = s + 1, self.L - (self.S - 1 - s)
        l = np.arange(lo, hi + 1)
        K, Kc, dC, dP, dV, dU = (K[lo:hi + 1], Kc[lo:hi + 1], dC[lo:hi + 1], dP[lo:hi + 1], dV[lo:hi + 1],
                                 dU[lo:hi + 1])
        sp = self.sp
        valid = (K >= s) & (OPTIMIZER_STATE_FACTOR * dP + sp.inflight[s] * dV <= sp.mem_cap[s])
        Kc = np.maximum(Kc, s)
        t = np.where(valid, dC / sp.speed[s] + self.comm[s][lo:hi + 1][:, None] + self.msg_in[s][Kc], INF)
        x = self.link[s][lo:hi + 1][:, None]
        q, v = np.maximum(t, x), t + 2.0 * x
        r = sp.tail(s, dP, dU)
        got = (l, Kc, valid, q, v, r)
        if self._cache_size + t.size * 4 < 3e7:
            self._terms[key] = got
            self._cache_size += t.size * 4
        return got

    def run(self, m: float = INF, r_cap: float = INF, minmax: bool = False, band: Optional[int] = None):
        """Sum-DP under caps (or min-max DP of t when `minmax`). Returns (value, boundaries) or (inf, None)."""
        band = self.band(m) if band is None else band
        prev = np.full(self.L + 1, INF)
        prev[0] = 0.0
        cur = np.empty(self.L + 1)
        choice = []
        capped_m, capped_r = math.isfinite(m), math.isfinite(r_cap)
        for s in range(self.S):
            l, K, valid, q, v, r = self._stage_terms(s, band)
            cand = np.maximum(prev[K], q) if minmax else prev[K] + v
            if capped_m:
                cand[q > m] = INF
            if capped_r:
                cand[r > r_cap] = INF
            j = cand.argmin(axis=1)
            cur.fill(INF)
            cur[l[0]:l[-1] + 1] = np.take_along_axis(cand, j[:, None], axis=1)[:, 0]  # the argmin's value
            choice.append(j)  # the start of stage s ending at l is K[l - l0, j[l - l0]]
            prev, cur = cur, prev
        if not math.isfinite(prev[self.L]):
            return INF, None
        bounds = [self.L]
        for s in range(self.S - 1, -1, -1):
            l, K = self._stage_terms(s, band)[:2]
            i = bounds[-1] - l[0]
            bounds.append(int(K[i, choice[s][i]]))
        return float(prev[self.L]), bounds[::-1]

    def stats(self, bounds: Sequence[int]) -> Tuple[float, float, float]:
        """(max q, sum v, max r) of a partition, with the DP's own arithmetic."""
        qs, vs, rs = [], [], []
        for s in range(self.S):
            k, l = bounds[s], bounds[s + 1]
            t = (self.C[l] - self.C[k]) / self.sp.speed[s] + self.comm[s][l] + self.msg_in[s][k]
            qs.append(max(t, self.link[s][l]))
            vs.append(t + 2.0 * self.link[s][l])
            rs.append(self.sp.tail(s, self.P[l] - self.P[k], self.U[l] - self.U[k]))
        return max(qs), float(sum(vs)), max(rs)

    def min_bottleneck(self):
        """M*: the smallest feasible max stage time (min-max DP, banded by a balanced split's bottleneck)."""
        if self._mstar is None:
            m_star, bounds = self.run(minmax=True, band=self.band(0.0))
            if bounds is None:  # the band may have cut off the only memory-feasible splits: full band
                m_star, bounds = self.run(minmax=True, band=self.L - self.S + 1)
            self._mstar = (m_star, bounds)
        return self._mstar

    def lower_bound(self, micro_batches: int) -> float:
        """No partition of this chain costs less: (B-1) M* + all compute on the fastest group."""
        m_star, bounds = self.min_bottleneck()
        return (micro_batches - 1) * m_star + self.C[-1] / self.vmax if bounds is not None else INF

    def solve(self, micro_batches: int, best: float = INF, max_passes: int = 10_000):
        """Exact minimum of (B-1) max t + sum t + max r over this chain, or (best, None) when nothing here
        beats `best`. Returns (cost, bounds, passes, exact)."""
        b1 = micro_batches - 1
        passes, exact = 1, True
        m_star, bounds = self.min_bottleneck()
        if bounds is None:
            return INF, None, passes, exact
        best_bounds = None
        sum_lb = self.C[-1] / self.vmax  # sum of stage times >= all compute on the fastest group
        no_tail = (self.sp.reduce_b.max() == 0 and self.sp.reduce_a.max() == 0 and self.U[-1] == 0
                   and self.sp.tail_fixed.max() == 0)

        def inner(m: float):
            """F(m) = min_R R + G(m, R) -> (value, bounds, max t of that solution, lower bound of F(m)).
            Stops early once nothing at this m can beat the global best (then the outer walk stops too)."""
            nonlocal passes, exact
            f_best, f_bounds, f_mt = INF, None, INF
            r_hi, r_lb, walked = INF, None, 0
            band = self.band(m)
            lb = INF
            while passes < max_passes:
                g, bd = self.run(m, r_hi, band=band)
                passes += 1
                if bd is None:
                    lb = f_best
                    break
                mt, st, mr = self.stats(bd)
                if st + mr < f_best:
                    f_best, f_bounds, f_mt = st + mr, bd, mt
                if no_tail:
                    lb = f_best
                    break
                walked += 1
                if r_lb is None and walked >= 3:  # a long walk: the smallest achievable max r bounds it
                    r_lb = self._min_max_r(m, band)
                    passes += 1
                rl = r_lb or 0.0
                lb = min(f_best, st + rl)
                if st + rl >= f_best or mr <= rl or b1 * m_star + lb >= best:
                    break
                r_hi = np.nextafter(mr, -INF)
            else:
                exact = False
            return f_best, f_bounds, f_mt, lb

        # outer search over the bottleneck M: branch and bound on intervals [a, b] of M. F is
        # non-increasing, so every plan whose bottleneck lies in [a, b] costs >= (B-1) a + F(b); evaluating
        # F at the middle also settles [mt, mid] (F is constant there: that plan is optimal on it).
        self._ub = m_star  # band the sum-DPs by the largest M they will see (smaller band, faster passes)
        val, bd, mt, lb = inner(m_star if b1 > 0 else INF)
        if bd is not None:
            best, best_bounds = min((best, best_bounds), (b1 * mt + val, bd), key=lambda x: x[0])
        if b1 > 0 and bd is not None and math.isfinite(best):
            top = (best - sum_lb) / b1
            self._ub = max(top, m_star)
            self._terms.clear()
            self._cache_size = 0
            if top > m_star:
                f_top, bd_top, mt_top, lb_top = inner(top)
                if bd_top is not None and b1 * mt_top + f_top < best:
                    best, best_bounds = b1 * mt_top + f_top, bd_top
                # intervals (a, b, lower bound of F on [a, b], whether F(b) itself has been evaluated). Below
                # a solved plan's bottleneck the bound is F just above it, loose by that plan's own step.
                # When not even the interval's top b can be pruned with it (b1 b + bound <= best: just below
                # the best plan's own bottleneck, where the bound is that plan's F), bisection never prunes
                # the upper half and converged on the breakpoint one halving at a time (1024 layers / 4096
                # devices: ~40 evaluations of F); such an interval is evaluated at its top instead, which
                # tightens the bound to F(b) and settles [mt, b]. Others are bisected.
                stack = [(m_star, mt_top, lb_top, True)] if bd_top is not None else []
                while stack and passes < max_passes:
                    stack.sort(key=lambda x: b1 * x[0] + x[2])
                    lo, hi, f_hi, top_known = stack.pop(0)
                    if b1 * lo + f_hi >= best * (1 - 1e-12) or hi < lo or (top_known and hi <= lo):
                        continue
                    tight = not top_known and b1 * hi + f_hi <= best * (1 + 1e-12)
                    m = hi if tight else 0.5 * (lo + hi)
                    f_m, bd_m, mt_m, lb_m = inner(m)
                    if m < hi:
                        stack.append((np.nextafter(m, INF), hi, f_hi, top_known))
                    if bd_m is None:  # nothing feasible up to m
                        continue
                    if b1 * mt_m + f_m < best:
                        best, best_bounds = b1 * mt_m + f_m, bd_m
                    stack.append((lo, np.nextafter(mt_m, -INF), lb_m, False))
            else:
                pass
        elif b1 == 0 and bd is not None:
            pass
        if passes >= max_passes:
            exact = False
        return best, best_bounds, passes, exact

    def _upper_bound(self) -> float:
        """Bottleneck of a speed-weighted compute-balanced split: an upper bound of M* that bands the
        min-max DP (no range longer than the band can sit in a split with a smaller bottleneck)."""
        share = np.cumsum(self.sp.speed) / self.sp.speed.sum()
        cuts = [0] + [int(np.searchsorted(self.C, self.C[-1] * share[i - 1])) for i in range(1, self.S)] + [self.L]
        for i in range(1, self.S):
            cuts[i] = min(max(cuts[i], cuts[i - 1] + 1), self.L - (self.S - i))
        mt, _, _ = self.stats(cuts)
        return float(mt)

    def _min_max_r(self, m: float, band: int) -> float:
        """min over partitions with t <= m of max r (a min-max DP on r)."""
        prev = np.full(self.L + 1, INF)
        prev[0] = 0.0
        for s in range(self.S):
            l, K, valid, q, v, r = self._stage_terms(s, band)
            cand = np.maximum(prev[K], r)
            cand[q > m] = INF
            cur = np.full(self.L + 1, INF)
            cur[l] = cand.min(axis=1)
            prev = cur
        return float(prev[self.L])


@register_solver("dp")
def solve_dp(profile: Profile, cluster: Cluster, num_stages: Optional[int], micro_batches: int,
             schedule: str = "1f1b", aggregator: str = "mean", **_: Any) -> Plan:
    t0 = time.perf_counter()
    best = (INF, None, None, None)
    passes, exact, tried = 0, True, 0
    speeds = np.array([cluster.speed(d) for d in range(len(cluster))])
    total = float(np.sum(profile.arrays()["fwd_bwd"]))
    biggest = float(np.max(profile.arrays()["fwd_bwd"]))
    cands = []
    for w in divisors_widths(len(cluster), len(profile), num_stages):
        for name, chain in candidate_chains(cluster, w).items():
            v = speeds[np.array(chain)].min(axis=1)
            # no split beats perfect balance (sum_s compute_s * v_s = total) nor the biggest layer on the
            # fastest group; every stage time adds up to at least all compute on the fastest group
            m_lb = max(total / v.sum(), biggest / v.max())
            cands.append(((micro_batches - 1) * m_lb + total / v.max(), name, chain))
    cands.sort(key=lambda x: x[0])
    # order the most promising chains by the sharper bound (B-1) M* + ...: the first solved optimum prunes
    # the rest harder. Ordering only changes the speed, never the result.
    head = [c for c in cands if c[0] <= 1.3 * cands[0][0]][:12] if cands else []
    sharp = []
    for lb, name, chain in head:
        dp = ChainDP(profile, stage_params(cluster, chain, micro_batches, schedule, aggregator,
                                                   profile.engine))
        sharp.append((dp.lower_bound(micro_batches), name, chain, dp))
        passes += 1
    sharp.sort(key=lambda x: x[0])
    queue = sharp + [(lb, name, chain, None) for lb, name, chain in cands[len(head):]]
    for lb, name, chain, dp in queue:
        if lb >= best[0]:
            if dp is None:
                break  # the cheap bounds are sorted: nothing after this can win
            continue
        if dp is None:
            dp = ChainDP(profile, stage_params(cluster, chain, micro_batches, schedule, aggregator,
                                                   profile.engine))
            if dp.lower_bound(micro_batches) >= best[0]:
                passes, tried = passes + 1, tried + 1
                continue
        cost, bounds, p, ex = dp.solve(micro_batches, best[0])
        dp._terms.clear()
        dp._bands.clear()
        passes, exact, tried = passes + p, exact and ex, tried + 1
        if bounds is not None and cost < best[0]:
            best = (cost, bounds, chain, name)
    if best[1] is None:
        raise ValueError("no memory-feasible plan exists in the dp search space (devices too small?)")
    return Plan.scored(profile, cluster, best[1], best[2], micro_batches, solver="dp", schedule=schedule,
                       aggregator=aggregator, seconds=time.perf_counter() - t0, chain=best[3], dp_passes=passes,
                       chains_tried=tried, exact=exact, dp_cost=best[0])
