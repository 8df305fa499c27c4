"""`straggler_topology`: a rank persistently slower than the others -> gossip with few peers; back when
it recovers (KungFu's adaptive-topology idea on the pipeline engine).

Slowness is a rank's *compute* time (forward+backward; wall times are equalised by the collectives)
over the median of all ranks. After `patience` consecutive slow steps the policy switches to
`gossip` (a spec, default `{"type": "gossip", "peers": 1}`); after `recover_patience` consecutive normal
steps it switches back to `fallback`. With `mode: "peers"` the run already gossips and the policy only
changes the peer count (`slow_peers` / `normal_peers`).
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field

from ...config_base import StrictModel
from ..base import Action, Policy, SetAggregator, SetGossipPeers, register_policy


@register_policy("straggler_topology")
class StragglerTopology(Policy):

    class Options(StrictModel):
        #: slow = time > threshold * median over ranks
        threshold: float = Field(1.5, gt=1.0)
        patience: int = Field(5, ge=1)
        recover_patience: int = Field(10, ge=1)
        #: "compute" (forward+backward time) or "wall" (whole step) per rank
        signal: Literal["compute", "wall"] = "compute"
        mode: Literal["aggregator", "peers"] = "aggregator"
        gossip: Union[str, Dict[str, Any]] = {"type": "gossip", "peers": 1}
        fallback: Union[str, Dict[str, Any]] = "mean"
        slow_peers: int = Field(1, ge=1)
        normal_peers: int = Field(2, ge=1)

    def __init__(self, options: Any = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        self.slow_steps = 0
        self.ok_steps = 0
        self.degraded = False
        self.straggler: Optional[int] = None

    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        times = metrics.get("compute_times" if self.options.signal == "compute" else "step_times") or []
        if len(times) < 2 or max(times) <= 0:
            return []
        med = statistics.median(times)
        worst = max(range(len(times)), key=times.__getitem__)
        slow = med > 0 and times[worst] > self.options.threshold * med
        if slow:
            self.slow_steps, self.ok_steps = self.slow_steps + 1, 0
        else:
            self.ok_steps, self.slow_steps = self.ok_steps + 1, 0
        o = self.options
        if not self.degraded and self.slow_steps >= o.patience:
            self.degraded, self.straggler = True, worst
            return [SetGossipPeers(o.slow_peers) if o.mode == "peers" else SetAggregator(o.gossip)]
        if self.degraded and self.ok_steps >= o.recover_patience:
            self.degraded, self.straggler = False, None
            return [SetGossipPeers(o.normal_peers) if o.mode == "peers" else SetAggregator(o.fallback)]
        return []

    def state_dict(self) -> Dict[str, Any]:
        return {"slow": self.slow_steps, "ok": self.ok_steps, "degraded": self.degraded, "straggler": self.straggler}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.slow_steps, self.ok_steps = state["slow"], state["ok"]
        self.degraded, self.straggler = state["degraded"], state["straggler"]

    @classmethod
    def aggregators_named(cls, options: StrictModel) -> List[tuple]:
        if options.mode == "peers":
            return []
        name = lambda s: s if isinstance(s, str) else s.get("type", "mean")  # noqa: E731
        return [("gossip", name(options.gossip)), ("fallback", name(options.fallback))]
