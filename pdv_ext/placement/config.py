"""Schema of `pdv.placement`: explicit stage boundaries / rank mapping, or a plan file, or plan at start-up."""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ..config_base import StrictModel


#: options of planning at start-up: without `cluster` nothing would read them
_PLANNING_KEYS = ("profile", "solver", "num_stages", "micro_batches", "schedule", "aggregator", "solver_options",
                  "input_shape", "input_dtype", "input_high", "profile_reps")


class PlacementConfig(StrictModel):
    """`pdv.placement`.

    - `boundaries`: layer indices where stages start, plus the layer count at the end
      (DeepSpeed's `parts`), e.g. `[0, 9, 15]` = layers 0-8 on stage 0, 9-14 on stage 1.
    - `rank_mapping`: per stage, the global ranks of its data-parallel replicas, e.g. `[[0, 3], [1, 2]]`.
    - `plan`: a plan JSON written by `pdv plan` (boundaries + mapping), or
    - `cluster` + `solver` (+ `profile`): plan at start-up (rank 0 plans and broadcasts).
    - `num_stages` (default: the PipelineModule's), `micro_batches` (default: 2 x stages), `schedule` (`1f1b` or `gpipe`), `aggregator` (reduction pattern the
      cost model assumes; default `mean`; a registered aggregator without a known pattern is costed as a
      ring), `solver_options` (keyword arguments of the solver).
    - Profiling at start-up when `profile` is absent or names a missing file (it is then written):
      `input_shape` (micro-batch input, e.g. `[4, 16]`), `input_dtype` (`float32` or `int64`),
      `input_high` (exclusive upper bound of int64 inputs, e.g. the vocabulary), `profile_reps`.
    """

    boundaries: Optional[List[int]] = None
    rank_mapping: Optional[List[List[int]]] = None
    plan: Optional[str] = None
    cluster: Optional[str] = None
    profile: Optional[str] = None
    solver: str = "dp"
    num_stages: Optional[int] = Field(default=None, ge=1)
    micro_batches: Optional[int] = Field(default=None, ge=1)
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    aggregator: str = "mean"
    solver_options: Dict[str, Any] = Field(default_factory=dict)
    input_shape: Optional[List[int]] = None
    input_dtype: Literal["float32", "int64"] = "float32"
    input_high: int = Field(default=256, ge=1)
    profile_reps: int = Field(default=3, ge=1)

    @field_validator("boundaries")
    @classmethod
    def _check_boundaries(cls, v: Optional[List[int]]) -> Optional[List[int]]:
        if v is None:
            return v
        if len(v) < 2 or v[0] != 0:
            raise ValueError("must start at 0 and list at least one stage, e.g. [0, 9, 15]")
        if any(b >= a for a, b in zip(v[1:], v[:-1])):
            raise ValueError("must be strictly increasing (every stage needs at least one layer)")
        return v

    @field_validator("rank_mapping")
    @classmethod
    def _check_mapping(cls, v: Optional[List[List[int]]]) -> Optional[List[List[int]]]:
        if v is None:
            return v
        if not v or any(not row for row in v):
            raise ValueError("needs one non-empty list of ranks per stage")
        widths = {len(row) for row in v}
        if len(widths) != 1:
            raise ValueError("every stage must have the same number of replicas (DeepSpeed's constraint)")
        flat = sorted(r for row in v for r in row)
        if flat != list(range(len(flat))):
            raise ValueError(f"must use each rank 0..{len(flat) - 1} exactly once")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "PlacementConfig":
        if self.boundaries is not None and self.rank_mapping is not None:
            if len(self.boundaries) - 1 != len(self.rank_mapping):
                raise ValueError(
                    f"boundaries describe {len(self.boundaries) - 1} stages but rank_mapping has "
                    f"{len(self.rank_mapping)}")
        if self.plan is not None and (self.boundaries is not None or self.rank_mapping is not None):
            raise ValueError("give either 'plan' or explicit 'boundaries'/'rank_mapping', not both")
        if self.cluster is not None and (self.plan is not None or self.boundaries is not None
                                         or self.rank_mapping is not None):
            raise ValueError("give either 'cluster' (plan at start-up) or 'plan'/'boundaries'/'rank_mapping'")
        idle = [k for k in _PLANNING_KEYS if k in self.model_fields_set]
        if self.cluster is None and idle:
            raise ValueError(f"{', '.join(idle)} only apply when planning at start-up: give 'cluster' too "
                             "(or use a plan written by `pdv plan`)")
        return self


    @field_validator("solver")
    @classmethod
    def _known_solver(cls, v: str) -> str:
        if ":" in v:
            return v
        from .solvers import SOLVERS

        if v not in SOLVERS:
            from ..registry import did_you_mean

            raise ValueError(f"unknown solver '{v}'{did_you_mean(v, SOLVERS.names())}; known: "
                             f"{', '.join(SOLVERS.names())}")
        return v

    @field_validator("aggregator")
    @classmethod
    def _known_aggregator(cls, v: str) -> str:
        """The cost model must know the reduction it plans for (see `cost.aggregator_pattern`)."""
        from .cost import aggregator_pattern

        aggregator_pattern(v)
        return v
