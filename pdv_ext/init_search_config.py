"""Schema of `pdv.init_search` (parallel random-initialization search, `pdv_ext.init_search`)."""
from __future__ import annotations

from typing import List, Literal

from pydantic import Field, field_validator

from .config_base import StrictModel

#: initialization schemes a candidate can be drawn from (see `pdv_ext.init_search.apply_scheme`)
SCHEMES = ("default", "xavier", "xavier_normal", "kaiming", "kaiming_normal", "orthogonal")
Scheme = Literal["default", "xavier", "xavier_normal", "kaiming", "kaiming_normal", "orthogonal"]


class InitSearchConfig(StrictModel):
    """`pdv.init_search`: off unless `enabled`.

    Round 0 (coarse) draws `candidates` starting points per data-parallel rank from the grid
    `schemes` x `scales` with per-candidate seeds; each is trained `probe_steps` steps on the rank's own
    data. Ranks all-gather the scores, keep the best `keep_fraction`, and every later round resamples
    around the survivors with a relative spread of `spread * shrink**(round - 1)` (coarse-to-fine). The
    overall best candidate is broadcast and training starts from it on every rank.
    """

    enabled: bool = False
    candidates: int = Field(4, ge=1, description="new candidates each rank probes per round")
    schemes: List[Scheme] = Field(default_factory=lambda: ["default", "xavier", "kaiming", "orthogonal"])
    scales: List[float] = Field(default_factory=lambda: [1.0, 0.5, 1.5],
                                description="multipliers of the weight matrices (scaled variants)")
    probe_steps: int = Field(10, ge=1, description="optimizer steps per candidate")
    keep_fraction: float = Field(0.25, gt=0.0, le=1.0, description="share of all candidates that survive a round")
    rounds: int = Field(2, ge=1, description="1 coarse round + (rounds - 1) refinement rounds")
    spread: float = Field(0.3, ge=0.0, description="relative std of the resampling noise in round 1")
    shrink: float = Field(0.5, gt=0.0, le=1.0, description="spread factor per further round")
    seed: int = 0
    lr: float = Field(0.05, gt=0.0, description="probe optimizer learning rate")
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD momentum of the probe optimizer")
    score: Literal["final", "mean"] = "final"
    score_batches: int = Field(0, ge=0, description="extra batches held out of probing to score on (0: the probe "
                                                    "batches)")
    start_from: Literal["initial", "probed"] = "initial"

    @field_validator("schemes")
    @classmethod
    def _schemes(cls, v: List[str]) -> List[str]:
        if not v:
            raise ValueError(f"needs at least one scheme of {', '.join(SCHEMES)}")
        return v

    @field_validator("scales")
    @classmethod
    def _scales(cls, v: List[float]) -> List[float]:
        if not v or any(not (s > 0) for s in v):
            raise ValueError("needs at least one scale, all > 0")
        return v
