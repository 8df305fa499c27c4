"""Placement solvers: `solve(profile, cluster, num_stages|None, micro_batches, **options) -> Plan`.

Every solver returns a `Plan` scored by the same cost model (`pdv_ext.placement.cost`). Built-ins:
`dp` (exact over its search space), `differentiable` (relaxation + gradient descent + repair),
`deepspeed_parameters` and `deepspeed_uniform` (DeepSpeed's own partitions, row-major placement).
Third-party solvers register under the entry-point group `pdv_ext.solvers` or are named "module:function".
"""
from __future__ import annotations

from typing import Any, List, Optional

from ...registry import Registry

SOLVERS = Registry("solver", "pdv_ext.solvers")


def register_solver(name: str):
    return SOLVERS.register(name)


def divisors_widths(num_devices: int, num_layers: int, num_stages: Optional[int]) -> List[int]:
    """Data-parallel widths w allowed by DeepSpeed: w * stages = devices, 1 <= stages <= layers."""
    if num_stages is not None:
        if num_stages < 1 or num_devices % num_stages:
            raise ValueError(f"{num_stages} stages do not divide {num_devices} devices evenly "
                             "(DeepSpeed needs the same data-parallel width on every stage)")
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} stages but only {num_layers} layers")
        return [num_devices // num_stages]
    return [w for w in range(1, num_devices + 1) if num_devices % w == 0 and num_devices // w <= num_layers]


def solve(name: str, profile: Any, cluster: Any, num_stages: Optional[int] = None, micro_batches: int = 1,
          **options: Any):
    """Look up solver `name` and run it."""
    return SOLVERS.get(name)(profile, cluster, num_stages, micro_batches, **options)


from . import baselines, dp, differentiable  # noqa: E402,F401  (register the built-ins)
