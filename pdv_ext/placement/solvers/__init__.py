"""Placement solvers: `solve(profile, cluster, num_stages|None, micro_batches, **options) -> Plan`.

Every solver returns a `Plan` scored by the same cost model (`pdv_ext.placement.cost`). Built-ins:
`dp` (exact over its search space), `differentiable` (relaxation + gradient descent + repair),
`deepspeed_parameters` and `deepspeed_uniform` (DeepSpeed's own partitions, row-major placement).
Third-party solvers register under the entry-point group `pdv_ext.solvers` or are named "module:function".
"""
from __future__ import annotations

from .base import SOLVERS, check_inputs, divisors_widths, register_solver, solve
from . import baselines, dp, differentiable  # noqa: E402,F401  (register the built-ins)

__all__ = ["SOLVERS", "check_inputs", "divisors_widths", "register_solver", "solve"]
