"""Data shares: how many micro-batches of a step's fixed global batch each data-parallel replica takes.

Synchronous data parallelism waits for its slowest replica. Giving each replica the share of the global
batch that fits its speed lets all of them finish together, and nothing about the optimisation changes:
the global batch and its gradient (the sample-weighted mean, see pdv_ext.aggregation) stay the same.

A replica of a pipeline with S stages runs its n micro-batches in about (n + S - 1) x t, t being its
slowest stage's time per micro-batch (1F1B / GPipe: the bubble of S - 1 micro-batches). The best integer
split of M micro-batches minimises the slowest replica's time; `best_shares` finds it exactly (greedy:
each next micro-batch goes to the replica that would finish it first, which is optimal for a max of
increasing per-replica costs). Used by the `rebalance` policy, by `pdv.data_shares: "by_throughput"` at
start-up and by `pdv bench adapt`'s oracle.
"""
from __future__ import annotations

import heapq
import math
from typing import Any, List, Optional, Sequence


def replica_time(n: int, t: float, stages: int = 1) -> float:
    """Time a replica needs for `n` micro-batches at `t` seconds per micro-batch on its slowest stage."""
    return (n + stages - 1) * t if n > 0 else 0.0


def predicted_step(shares: Sequence[int], times: Sequence[float], stages: int = 1) -> float:
    """The slowest replica's compute time for `shares` (the step's compute part: the rest is the same for
    every split)."""
    return max(replica_time(n, t, stages) for n, t in zip(shares, times))


def best_shares(times: Sequence[float], total: int, stages: int = 1, minimum: int = 1) -> List[int]:
    """The split of `total` micro-batches over the replicas (seconds per micro-batch `times`) that minimises
    the slowest replica's time, every replica keeping at least `minimum`. Ties go to the lower index, so
    equal times give the equal split (and the same answer on every rank)."""
    m = len(times)
    if m == 0:
        raise ValueError("best_shares: no replicas")
    if total < minimum * m:
        raise ValueError(f"best_shares: {total} micro-batches cannot give {m} replicas at least {minimum} each")
    if any(not (t > 0 and math.isfinite(t)) for t in times):
        raise ValueError(f"best_shares: times per micro-batch must be positive and finite (got {list(times)})")
    shares = [minimum] * m
    heap = [(replica_time(minimum + 1, t, stages), i) for i, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(total - minimum * m):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (replica_time(shares[i] + 1, times[i], stages), i))
    return shares


def equal_shares(total: int, replicas: int) -> List[int]:
    """`total` micro-batches split as evenly as possible (the first replicas take one more)."""
    return [total // replicas + (1 if i < total % replicas else 0) for i in range(replicas)]


def rescale_shares(shares: Sequence[int], total: int) -> List[int]:
    """`shares` carried to a global batch of `total` micro-batches in the same proportions (largest
    remainders; every replica keeps at least one): a batch change keeps the split another policy chose for
    the replicas' speeds instead of undoing it."""
    n, old = len(shares), sum(shares)
    if total < n:
        raise ValueError(f"{total} micro-batches cannot give each of {n} replicas one")
    exact = [s * total / old for s in shares]
    out = [max(1, int(x)) for x in exact]
    while sum(out) < total:  # the largest remainders first
        out[max(range(n), key=lambda i: (exact[i] - out[i], -i))] += 1
    while sum(out) > total:  # a replica raised to one: taken from those most above their exact share
        out[max((i for i in range(n) if out[i] > 1), key=lambda i: (out[i] - exact[i], -i))] -= 1
    return out


def shares_by_throughput(throughputs: Sequence[float], total: int, stages: int = 1) -> List[int]:
    """`pdv.data_shares: "by_throughput"`: the best split for replicas of the given relative speeds."""
    return best_shares([1.0 / s for s in throughputs], total, stages)


def check_shares(shares: Sequence[int], replicas: int, total: Optional[int] = None,
                 what: str = "data shares") -> List[int]:
    """`shares` as a list of positive ints, one per replica (summing to `total` when given); ValueError
    naming what is wrong otherwise."""
    out = [int(n) for n in shares]
    if any(n != s for n, s in zip(out, shares)) or any(n < 1 for n in out):
        raise ValueError(f"{what}: every replica needs a whole number of micro-batches >= 1 (got {list(shares)})")
    if len(out) != replicas:
        raise ValueError(f"{what}: {len(out)} values for {replicas} data-parallel replicas (got {list(shares)})")
    if total is not None and sum(out) != total:
        raise ValueError(f"{what}: {list(shares)} add up to {sum(out)} micro-batches but the global batch has "
                         f"{total} (the shares split the step's batch, they do not change it)")
    return out


def static_shares(spec: Any, replicas: int, total: int, stages: int = 1,
                  replica_ranks: Optional[Sequence[Sequence[int]]] = None,
                  cluster_path: Optional[str] = None) -> Optional[List[int]]:
    """`pdv.data_shares` at start-up: None for "equal", the list checked against the run, or for
    "by_throughput" the best split for the cluster YAML's devices (rank r runs on the YAML's device r; a
    replica is as fast as its slowest device, `replica_ranks[d]` being its ranks). ConfigError naming the
    key otherwise."""
    from ..config_base import ConfigError

    if spec is None or spec == "equal":
        return None
    if spec == "by_throughput":
        from ..placement.startup import load_cluster

        cluster = load_cluster(cluster_path)
        ranks = replica_ranks or [[d] for d in range(replicas)]
        if max(r for rs in ranks for r in rs) >= len(cluster):
            raise ConfigError([f"pdv.data_shares: 'by_throughput' needs a device per rank, but {cluster_path} "
                               f"describes {len(cluster)} devices"])
        speeds = [min(cluster.devices[r].throughput for r in rs) for rs in ranks]
        return shares_by_throughput(speeds, total, stages)
    try:
        return check_shares(spec, replicas, total, what="pdv.data_shares")
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
