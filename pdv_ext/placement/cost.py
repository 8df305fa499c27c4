"""Pipeline step-time cost model (1F1B and GPipe) and per-stage breakdown.

For a plan with S stages on device groups g_0..g_{S-1} (each of the same data-parallel width w) and B
micro-batches:

    t_s   = compute_s + comm_s + engine_s                  (work of stage s's device per micro-batch)
    compute_s = sum of the stage's layers' fwd+bwd time / speed of the slowest device of g_s
    comm_s    = (message time at the input boundary + at the output boundary) / speed of g_s
                (the device's own send/recv work per micro-batch: one message each way per boundary)
    engine_s  = engine micro-batch time / speed of g_s
                (DeepSpeed's own work per micro-batch: schedule loop, LoadMicroBatch, ForwardPass and
                BackwardPass instructions' Python; send/recv instructions are gloo's work, in comm_s)
    x_s   = max over replicas r of [latency + activation bytes at the boundary / bandwidth](g_s[r] -> g_{s+1}[r])
            (the link's transfer per micro-batch and direction; 0 after the last stage; replicas that cross
            between the same two hosts send at once and share that link: its bandwidth / their number)
    r_s   = data-parallel reduction of the stage's gradient bytes over g_s (aggregator's pattern)
    u_s   = sum of the stage's layers' parameter update time / speed of the slowest device of g_s
            (grad norm + optimizer step + zero_grad: once per step, on every device, after the pipeline)
            + engine step time / speed of g_s (DeepSpeed's fixed work per step outside the micro-batches)
    step  = (B - 1) * max(max_s t_s, max_s x_s) + sum_s t_s + 2 sum_s x_s + max_s (r_s + u_s)

A link is a pipeline resource of its own: a send returns once the message is in the kernel's socket
buffer, so the transfer overlaps the devices' work, and a (full-duplex) link carries one activation and
one gradient per micro-batch, one each way. It bounds the steady state only when it is slower than every
stage (x_s in the max); the first micro-batch's activations and the last one's gradients cross every
link once (2 sum x_s in the fill and drain). The device's own send/recv work is in series with its
compute (comm_s).

The update is CPU work like compute, so a slow (or CPU-throttled) device pays it at its own speed (on
the emulated benchmark cluster, tens of milliseconds per step on the quarter-speed device).
DeepSpeed's default gradient clipping puts a global all-reduce of the gradient norm between reduction and
update, making the exact tail max_s r_s + max_s u_s; max_s (r_s + u_s) equals it when one stage is the
slowest at both (the usual case: the most parameters on the slowest devices) and keeps one per-stage
cap for the DP solver.

Memory per device of stage s: 4 * parameter bytes (weights, grads, two Adam moments) + in-flight
micro-batches * saved activation bytes, where 1F1B keeps min(S - s, B) micro-batches and GPipe keeps B.
A plan is feasible when every device's estimate fits its memory.

Everything a solver needs per (stage, layer range) is linear in prefix sums, so `StageParams` exposes
exactly the numbers the stage time, the tail (`StageParams.tail`) and the memory use: the DP solver and
this module share them.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .cluster import Cluster
from .profile import Profile

# communication pattern of each aggregator's data-parallel reduction
AGGREGATOR_PATTERN = {"mean": "ring", "sum": "ring", "ring": "ring", "adasum": "halving_doubling",
                      "gossip": "gossip", "zeno": "sliced_validation", "suspicion": "sliced", "median": "sliced",
                      "trimmed_mean": "sliced"}
OPTIMIZER_STATE_FACTOR = 4.0  # weights + grads + Adam m, v


def aggregator_pattern(name: str) -> str:
    """The reduction pattern the cost model assumes for aggregator `name`. A registered aggregator without a
    known pattern (a user plug-in) is costed as a ring all-reduce; an unknown name is an error, so a typo
    does not silently plan for the wrong reduction."""
    if name in AGGREGATOR_PATTERN:
        return AGGREGATOR_PATTERN[name]
    from ..aggregation import AGGREGATORS  # imports torch: only for names outside the table
    from ..registry import RegistryError, did_you_mean

    known = sorted(set(AGGREGATOR_PATTERN) | set(AGGREGATORS.names()))
    if not isinstance(name, str) or name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator '{name}'{did_you_mean(str(name), known)}; known: {', '.join(known)}")
    try:
        AGGREGATORS.get(name)  # a 'module:attr' name must import
    except RegistryError as exc:
        raise ValueError(str(exc)) from exc
    return "ring"


@dataclass
class StageCost:
    stage: int
    layers: List[int]           # [start, stop)
    devices: List[int]
    compute: float
    comm: float                 # the device's own send/recv work per micro-batch
    time: float                 # compute + comm + engine: the device's work per micro-batch
    reduce: float
    update: float               # parameter update (+ engine's per-step work) on the slowest device, once per step
    memory: float               # worst device, bytes
    memory_limit: float
    fits: bool
    engine: float = 0.0         # DeepSpeed's own work per micro-batch (in `time`)
    link: float = 0.0           # link transfer to the next stage per micro-batch and direction (overlapped)


@dataclass
class CostBreakdown:
    step_time: float
    pipeline_time: float
    tail_time: float            # max over stages of reduce + update, after the pipeline drains
    bottleneck: float           # max over stages of t_s and over links of x_s
    feasible: bool
    schedule: str
    micro_batches: int
    stages: List[StageCost] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        for k, v in list(d.items()):
            if isinstance(v, float) and math.isinf(v):
                d[k] = None
        for s in d["stages"]:
            if math.isinf(s["memory_limit"]):
                s["memory_limit"] = None
        return d


@dataclass
class StageParams:
    """Per-stage constants of the cost model for a fixed chain of device groups."""

    speed: np.ndarray           # (S,) slowest device's speed
    p2p: List[List[tuple]]      # per stage: [(latency, bandwidth)] over replica pairs to the next stage
    reduce_a: np.ndarray        # (S,) reduction time = a + b * gradient bytes
    reduce_b: np.ndarray
    mem_cap: np.ndarray         # (S,) smallest device memory
    inflight: np.ndarray        # (S,) micro-batches whose activations are held
    overhead: Optional[np.ndarray] = None    # (S,) engine work per micro-batch on the stage's slowest device
    tail_fixed: Optional[np.ndarray] = None  # (S,) engine work per step (outside micro-batches), same device

    def __post_init__(self):
        n = len(self.speed)
        self.overhead = np.zeros(n) if self.overhead is None else np.asarray(self.overhead, dtype=float)
        self.tail_fixed = np.zeros(n) if self.tail_fixed is None else np.asarray(self.tail_fixed, dtype=float)

    def link(self, s: int, act_bytes):
        """Worst replica's link transfer of `act_bytes` (scalar or array) to the next stage, one direction."""
        if not self.p2p[s]:
            return np.zeros_like(np.asarray(act_bytes, dtype=float))
        a = np.asarray(act_bytes, dtype=float)
        return np.max([lat + a / bw for lat, bw in self.p2p[s]], axis=0)

    def messages(self, s: int, msg_in, msg_out):
        """Send/recv work of stage s per micro-batch at its input and output boundaries (profiling-device
        seconds of one message each way, scalars or arrays), on the stage's slowest device."""
        first, last = s == 0, s == len(self.speed) - 1
        return ((0.0 if first else msg_in) + (0.0 if last else msg_out)) / self.speed[s]

    def reduce(self, s: int, param_bytes):
        return self.reduce_a[s] + self.reduce_b[s] * param_bytes

    def update(self, s: int, update):
        """The profiling device's update time of the stage's layers, on the stage's slowest device."""
        return update / self.speed[s]

    def tail(self, s: int, param_bytes, update):
        """Stage s's work after the pipeline drains: gradient reduction, then parameter update (plus the
        engine's fixed per-step work)."""
        return self.reduce(s, param_bytes) + self.update(s, update) + self.tail_fixed[s]


def reduce_coeffs(cluster: Cluster, group: Sequence[int], pattern: str, crossing_share: int = 1,
                  gossip_peers: int = 1, gossip_ratio: float = 0.01) -> tuple:
    """(a, b) with reduction time = a + b * bytes over `group`, for the aggregator's pattern.

    Links are taken along the ring group[0] -> group[1] -> ... -> group[0]; an inter-host edge's bandwidth
    is divided by `crossing_share` (groups reducing across the same host link at once)."""
    w = len(group)
    if w <= 1:
        return 0.0, 0.0
    lats, bws = [], []
    for i in range(w):
        a, b = group[i], group[(i + 1) % w]
        ln = cluster.link(a, b)
        share = crossing_share if cluster.host_of(a) != cluster.host_of(b) else 1
        lats.append(ln.latency)
        bws.append(ln.bandwidth / share)
    lat, bw = max(lats), min(bws)
    traffic = reduce_traffic(pattern, w, gossip_peers, gossip_ratio)
    if pattern in ("ring", "sliced"):  # sliced: all-to-all of 1/w slices + all-gather: a ring all-reduce's bytes
        return 2 * (w - 1) * lat, traffic / bw
    if pattern == "halving_doubling":
        return 2 * math.ceil(math.log2(w)) * lat, traffic / bw
    if pattern == "gossip":
        return gossip_peers * lat, traffic / bw
    return 3 * (w - 1) * lat, traffic / bw  # sliced_validation (reduce_traffic checked the name)


def reduce_traffic(pattern: str, w: int, gossip_peers: int = 1, gossip_ratio: float = 0.01) -> float:
    """Bytes each member sends (and receives) per gradient byte in a reduction over `w` members: what both
    the link and the member's own CPU (a gloo reduction's copies and sums) work through."""
    if w <= 1:
        return 0.0
    if pattern in ("ring", "halving_doubling", "sliced"):
        return 2 * (w - 1) / w
    if pattern == "gossip":
        return gossip_peers * gossip_ratio
    if pattern == "sliced_validation":  # the sliced exchange plus an all-to-all of the validation gradients (zeno)
        return 3 * (w - 1) / w
    raise ValueError(f"unknown reduction pattern '{pattern}'")


def stage_params(cluster: Cluster, groups: Sequence[Sequence[int]], micro_batches: int,
                 schedule: str = "1f1b", aggregator: str = "mean", engine: Optional[Dict[str, Any]] = None
                 ) -> StageParams:
    """Per-stage constants; `engine` = `Profile.engine` (DeepSpeed's per-micro-batch and per-step work on
    the profiling device), scaled to each stage's slowest device like compute."""
    s_count = len(groups)
    pattern = aggregator_pattern(aggregator)
    speed = np.array([min(cluster.speed(d) for d in g) for g in groups], dtype=float)
    p2p = []
    for s in range(s_count):
        if s == s_count - 1:
            p2p.append([])
            continue
        # the replicas of a stage send their activations at the same time: those that cross between the same
        # two hosts share that host pair's link, like the reductions below
        replicas = list(zip(groups[s], groups[s + 1]))
        hosts = [(cluster.host_of(a), cluster.host_of(b)) for a, b in replicas]
        sharing = Counter(h for h in hosts if h[0] != h[1])
        pairs = {}
        for (a, b), h in zip(replicas, hosts):
            ln = cluster.link(a, b)
            pairs[(ln.latency, ln.bandwidth / sharing.get(h, 1))] = None
        p2p.append(list(pairs))
    # contention: how many groups cross hosts on each host's link
    crossing: Dict[str, int] = {}
    for g in groups:
        hs = {cluster.host_of(d) for d in g}
        if len(hs) > 1:
            for h in hs:
                crossing[h] = crossing.get(h, 0) + 1
    ra, rb = np.zeros(s_count), np.zeros(s_count)
    # the reduction's own work per byte sent on the profiling device (gloo's copies and sums on a CPU, where a
    # device's CPU, not the link, can bound it); 0 where not measured
    per_byte = float((engine or {}).get("reduce_byte", 0.0))
    per_grad = float((engine or {}).get("reduce_grad_byte", 0.0))
    for s, g in enumerate(groups):
        hs = {cluster.host_of(d) for d in g}
        share = max((crossing.get(h, 1) for h in hs), default=1) if len(hs) > 1 else 1
        ra[s], rb[s] = reduce_coeffs(cluster, g, pattern, share)
        if len(g) > 1:
            rb[s] += (per_grad + per_byte * reduce_traffic(pattern, len(g))) / speed[s]
    cap = np.array([min(cluster.memory(d) for d in g) for g in groups], dtype=float)
    if schedule == "gpipe":
        infl = np.full(s_count, float(micro_batches))
    elif schedule == "1f1b":
        infl = np.array([float(min(s_count - s, micro_batches)) for s in range(s_count)])
    else:
        raise ValueError(f"unknown schedule '{schedule}' (1f1b or gpipe)")
    per_mb = float((engine or {}).get("micro_batch", 0.0))
    step = float((engine or {}).get("step", 0.0))
    overhead = np.full(s_count, per_mb) / speed
    return StageParams(speed, p2p, ra, rb, cap, infl, overhead, np.full(s_count, step) / speed)


def evaluate(profile: Profile, cluster: Cluster, boundaries: Sequence[int], groups: Sequence[Sequence[int]],
             micro_batches: int, schedule: str = "1f1b", aggregator: str = "mean") -> CostBreakdown:
    """Step time and per-stage breakdown of a plan (boundaries = DeepSpeed parts; groups[s] = devices)."""
    arr = profile.arrays()
    n = len(profile)
    if list(boundaries)[0] != 0 or list(boundaries)[-1] != n or len(boundaries) - 1 != len(groups):
        raise ValueError(f"boundaries {list(boundaries)} do not split {n} layers into {len(groups)} stages")
    sp = stage_params(cluster, groups, micro_batches, schedule, aggregator, profile.engine)
    stages = []
    for s in range(len(groups)):
        k, l = boundaries[s], boundaries[s + 1]
        if l <= k:
            raise ValueError(f"stage {s} has no layers (boundaries {list(boundaries)})")
        compute = float(arr["fwd_bwd"][k:l].sum() / sp.speed[s])
        link = float(sp.link(s, arr["act_bytes"][l - 1])) if s < len(groups) - 1 else 0.0
        comm = float(sp.messages(s, arr["p2p"][k - 1] if k else 0.0, arr["p2p"][l - 1]))
        engine = float(sp.overhead[s])
        params = float(arr["param_bytes"][k:l].sum())
        red = float(sp.reduce(s, params))
        upd = float(sp.update(s, arr["update"][k:l].sum())) + float(sp.tail_fixed[s])
        mem = OPTIMIZER_STATE_FACTOR * params + sp.inflight[s] * float(arr["saved_bytes"][k:l].sum())
        stages.append(StageCost(s, [int(k), int(l)], [int(d) for d in groups[s]], compute, comm,
                                compute + comm + engine, red, upd, mem, float(sp.mem_cap[s]),
                                bool(mem <= sp.mem_cap[s]), engine, link))
    times = [st.time for st in stages]
    links = [st.link for st in stages]
    bottleneck = max(max(times), max(links))
    pipe = (micro_batches - 1) * bottleneck + sum(times) + 2 * sum(links)
    tail = max(st.reduce + st.update for st in stages)
    return CostBreakdown(pipe + tail, pipe, tail, bottleneck, all(st.fits for st in stages), schedule,
                         micro_batches, stages)
