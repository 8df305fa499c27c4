"""DeepSpeed's own partitions with DeepSpeed's row-major placement: the baselines every solver must beat."""
from __future__ import annotations

import time
from typing import Any, List, Optional

import numpy as np

from ..plan import Plan, row_major_mapping
from .base import divisors_widths, register_solver


def row_major_groups(num_devices: int, num_stages: int) -> List[List[int]]:
    """Stage s holds ranks s*w .. s*w+w-1 (DeepSpeed's PipeDataParallelTopology)."""
    return row_major_mapping(num_stages, num_devices)


def _stages(cluster: Any, profile: Any, num_stages: Optional[int]) -> int:
    if num_stages is None:
        num_stages = min(len(cluster), len(profile))
        while len(cluster) % num_stages:
            num_stages -= 1
    divisors_widths(len(cluster), len(profile), num_stages)  # >= 1, divides the devices, <= layers
    return num_stages


def _baseline(method: str, profile, cluster, num_stages, micro_batches, schedule="1f1b", aggregator="mean", **_):
    from deepspeed.runtime import utils as ds_utils

    t0 = time.perf_counter()
    s = _stages(cluster, profile, num_stages)
    if method == "parameters":
        weights = [int(max(1, round(b))) if b > 0 else 0 for b in profile.arrays()["param_bytes"]]
        parts = ds_utils.partition_balanced(weights=weights, num_parts=s)
    else:
        parts = ds_utils.partition_uniform(num_items=len(profile), num_parts=s)
    parts = _repair_empty(list(parts), len(profile))
    return Plan.scored(profile, cluster, parts, row_major_groups(len(cluster), s), micro_batches,
                       solver=f"deepspeed_{method}", schedule=schedule, aggregator=aggregator,
                       seconds=time.perf_counter() - t0)


def _repair_empty(parts: List[int], n: int) -> List[int]:
    """DeepSpeed may return empty stages (zero-weight layers); give every stage at least one layer."""
    for i in range(1, len(parts)):
        parts[i] = max(parts[i], parts[i - 1] + 1)
    for i in range(len(parts) - 2, 0, -1):
        parts[i] = min(parts[i], parts[i + 1] - 1)
    parts[-1] = n
    return parts


@register_solver("deepspeed_parameters")
def deepspeed_parameters(profile, cluster, num_stages: Optional[int], micro_batches: int, **kw: Any) -> Plan:
    """deepspeed.runtime.utils.partition_balanced over parameter counts (DeepSpeed's default)."""
    return _baseline("parameters", profile, cluster, num_stages, micro_batches, **kw)


@register_solver("deepspeed_uniform")
def deepspeed_uniform(profile, cluster, num_stages: Optional[int], micro_batches: int, **kw: Any) -> Plan:
    """deepspeed.runtime.utils.partition_uniform: the same number of layers per stage."""
    return _baseline("uniform", profile, cluster, num_stages, micro_batches, **kw)
