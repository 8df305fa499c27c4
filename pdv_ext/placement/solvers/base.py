"""The solver protocol's plumbing: the registry, the input checks every solver relies on, and `solve`.

Apart from the package's `__init__` so that the built-in solvers can import it while the package
registers them (they need `register_solver` and `divisors_widths`; the package imports them).
"""
from __future__ import annotations

import inspect
from numbers import Integral
from typing import Any, List, Optional

from ...registry import Registry
from ..cost import aggregator_pattern
from ..plan import Plan

SOLVERS = Registry("solver", "pdv_ext.solvers")


def register_solver(name: str):
    return SOLVERS.register(name)


def divisors_widths(num_devices: int, num_layers: int, num_stages: Optional[int]) -> List[int]:
    """Data-parallel widths w allowed by DeepSpeed: w * stages = devices, 1 <= stages <= layers."""
    if num_stages is not None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, Integral) or num_stages < 1:
            raise ValueError(f"the number of stages must be an integer >= 1 (got {num_stages!r})")
        if num_devices % num_stages:
            raise ValueError(f"{num_stages} stages do not divide {num_devices} devices evenly "
                             "(DeepSpeed needs the same data-parallel width on every stage)")
        if num_stages > num_layers:
            raise ValueError(f"{num_stages} stages but only {num_layers} layers (every stage needs at least one)")
        return [num_devices // num_stages]
    return [w for w in range(1, num_devices + 1) if num_devices % w == 0 and num_devices // w <= num_layers]


def check_inputs(profile: Any, cluster: Any, num_stages: Optional[int], micro_batches: int,
                 aggregator: str = "mean") -> None:
    """What every solver assumes, checked once up front: bad input then gets one clear ValueError instead of a
    ZeroDivisionError / IndexError deep inside a solver, or a plan with a negative step time."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, Integral) or micro_batches < 1:
        raise ValueError(f"the number of micro-batches must be an integer >= 1 (got {micro_batches!r})")
    if num_stages is not None:
        divisors_widths(len(cluster), len(profile), num_stages)
    aggregator_pattern(aggregator)


def solve(name: str, profile: Any, cluster: Any, num_stages: Optional[int] = None, micro_batches: int = 1,
          **options: Any):
    """Look up solver `name`, check the inputs and the solver's signature, run it, check it returned a Plan
    (a "module:function" solver is user code: a mistake there must name it, not surface as a TypeError)."""
    fn = SOLVERS.get(name)
    check_inputs(profile, cluster, num_stages, micro_batches, options.get("aggregator", "mean"))
    args = (profile, cluster, num_stages, micro_batches)
    try:
        inspect.signature(fn).bind(*args, **options)
    except TypeError as exc:
        raise ValueError(f"solver '{name}' cannot be called as solver(profile, cluster, num_stages, "
                         f"micro_batches, {', '.join(f'{k}=...' for k in options)}): {exc}") from exc
    except ValueError:  # no signature to inspect (some builtins): just call it
        pass
    plan = fn(*args, **options)
    if not isinstance(plan, Plan):
        raise ValueError(f"solver '{name}' returned {type(plan).__name__}, not a Plan "
                         "(build one with pdv_ext.placement.plan.Plan.scored)")
    return plan

