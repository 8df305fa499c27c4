"""A placement plan: stage boundaries (DeepSpeed `parts`), rank mapping, predicted step time, breakdown.

JSON keys at the top level: `boundaries` and `rank_mapping` (what `pdv.placement.plan` and
`pdv_ext.integrations.deepspeed.resolve_placement` read), plus `predicted_step_time`, `solver`,
`solve_seconds`, `schedule`, `micro_batches` and `stages` (per-stage breakdown from the cost model).
Device index i of the cluster is global rank i.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

from .cluster import Cluster
from .cost import CostBreakdown, evaluate
from .profile import Profile


def row_major_mapping(num_stages: int, world_size: int) -> List[List[int]]:
    """DeepSpeed's default placement (PipeDataParallelTopology): stage s holds ranks s*D .. s*D+D-1."""
    dp = world_size // num_stages
    return [[s * dp + d for d in range(dp)] for s in range(num_stages)]


@dataclass(frozen=True)
class Layout:
    """Where a plan puts things: stage boundaries (DeepSpeed's `parts`: stage s holds layers
    boundaries[s] .. boundaries[s+1]-1) and the rank mapping `[stage][replica] -> global rank`. The one
    value type for it; `to_dict()` is the `{"boundaries", "rank_mapping"}` form files and messages carry."""

    boundaries: Sequence[int]
    rank_mapping: Sequence[Sequence[int]]

    def __post_init__(self) -> None:  # plain ints in lists, whatever was passed (tuples, numpy ints)
        object.__setattr__(self, "boundaries", [int(b) for b in self.boundaries])
        object.__setattr__(self, "rank_mapping", [[int(r) for r in row] for row in self.rank_mapping])

    @classmethod
    def from_dict(cls, d: Any) -> "Layout":
        """From a `{"boundaries", "rank_mapping"}` mapping (a plan JSON, a checkpoint's meta) or any object
        with those attributes (a Plan, a Replan action)."""
        if isinstance(d, dict):
            return cls(d["boundaries"], d["rank_mapping"])
        return cls(d.boundaries, d.rank_mapping)

    def to_dict(self) -> Dict[str, Any]:
        return {"boundaries": list(self.boundaries), "rank_mapping": [list(r) for r in self.rank_mapping]}

    @property
    def num_stages(self) -> int:
        return len(self.rank_mapping)

    @property
    def replicas(self) -> int:
        return len(self.rank_mapping[0]) if self.rank_mapping else 0


@dataclass
class Plan:
    boundaries: List[int]
    rank_mapping: List[List[int]]
    predicted_step_time: float = float("nan")
    solver: str = ""
    solve_seconds: float = 0.0
    schedule: str = "1f1b"
    micro_batches: int = 1
    feasible: bool = True
    stages: List[Dict[str, Any]] = field(default_factory=list)
    meta: Dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.rank_mapping)

    @property
    def layout(self) -> Layout:
        return Layout(self.boundaries, self.rank_mapping)

    @classmethod
    def scored(cls, profile: Profile, cluster: Cluster, boundaries: Sequence[int], groups: Sequence[Sequence[int]],
               micro_batches: int, solver: str = "", schedule: str = "1f1b", aggregator: str = "mean",
               seconds: float = 0.0, **meta: Any) -> "Plan":
        """Build a plan and score it with the cost model (every solver goes through here)."""
        cb: CostBreakdown = evaluate(profile, cluster, boundaries, groups, micro_batches, schedule, aggregator)
        d = cb.to_dict()
        return cls([int(b) for b in boundaries], [[int(r) for r in g] for g in groups], cb.step_time, solver,
                   seconds, schedule, micro_batches, cb.feasible, d["stages"],
                   {"pipeline_time": cb.pipeline_time, "tail_time": cb.tail_time, "bottleneck": cb.bottleneck,
                    "aggregator": aggregator, **meta})

    def to_dict(self) -> Dict[str, Any]:
        return {"boundaries": self.boundaries, "rank_mapping": self.rank_mapping,
                "predicted_step_time": self.predicted_step_time, "solver": self.solver,
                "solve_seconds": self.solve_seconds, "schedule": self.schedule, "micro_batches": self.micro_batches,
                "feasible": self.feasible, "stages": self.stages, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        if "boundaries" not in d or "rank_mapping" not in d:
            raise ValueError("a plan needs 'boundaries' and 'rank_mapping'")
        return cls(list(d["boundaries"]), [list(r) for r in d["rank_mapping"]],
                   float(d.get("predicted_step_time", float("nan"))), d.get("solver", ""),
                   float(d.get("solve_seconds", 0.0)), d.get("schedule", "1f1b"), int(d.get("micro_batches", 1)),
                   bool(d.get("feasible", True)), list(d.get("stages", [])), dict(d.get("meta", {})))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def table(self) -> str:
        """Stage | layers | devices | compute | comm | engine | link | reduce | update | memory, fixed-width.
        Layers are half-open, `[start, stop)`, as in `boundaries` and the JSON's `stages[].layers`."""
        rows = [("stage", "layers", "devices", "compute ms", "comm ms", "engine ms", "link ms", "reduce ms",
                 "update ms", "memory MiB")]
        for s in self.stages:
            lim = s.get("memory_limit")
            mem = f"{s['memory'] / 2 ** 20:.1f}" + (f"/{lim / 2 ** 20:.0f}" if lim else "")
            devs = ",".join(map(str, s["devices"]))
            rows.append((str(s["stage"]), f"[{s['layers'][0]}, {s['layers'][1]})",  # half-open, as `boundaries`
                         devs if len(devs) <= 24 else devs[:21] + "...",
                         f"{s['compute'] * 1e3:.3f}", f"{s['comm'] * 1e3:.3f}",
                         f"{s.get('engine', 0.0) * 1e3:.3f}", f"{s.get('link', 0.0) * 1e3:.3f}",
                         f"{s['reduce'] * 1e3:.3f}",
                         f"{s.get('update', 0.0) * 1e3:.3f}", mem))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(f"predicted step time: {self.predicted_step_time * 1e3:.3f} ms "
                     f"({self.schedule}, {self.micro_batches} micro-batches, solver {self.solver}, "
                     f"{'feasible' if self.feasible else 'OUT OF MEMORY'})")
        return "\n".join(lines)
