"""Schema of `pdv.placement`: explicit stage boundaries / rank mapping, or a plan file, or plan at start-up."""
from __future__ import annotations

from typing import List, Optional

from pydantic import field_validator, model_validator

from ..config_base import StrictModel


class PlacementConfig(StrictModel):
    """`pdv.placement`.

    - `boundaries`: layer indices where stages start, plus the layer count at the end
      (DeepSpeed's `parts`), e.g. `[0, 9, 15]` = layers 0-8 on stage 0, 9-14 on stage 1.
    - `rank_mapping`: per stage, the global ranks of its data-parallel replicas, e.g. `[[0, 3], [1, 2]]`.
    - `plan`: a plan JSON written by `pdv plan` (boundaries + mapping), or
    - `cluster` + `solver` (+ `profile`): plan at start-up (rank 0 plans and broadcasts).
    """

    boundaries: Optional[List[int]] = None
    rank_mapping: Optional[List[List[int]]] = None
    plan: Optional[str] = None
    cluster: Optional[str] = None
    profile: Optional[str] = None
    solver: str = "dp"
    num_stages: Optional[int] = None
    micro_batches: Optional[int] = None

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
        return self
