"""`schedule`: step-based changes from the config — batch size, LR, aggregator, gossip peers.

    {"name": "schedule", "changes": [{"step": 100, "micro_batches": 8, "lr_rule": "linear"},
                                     {"step": 500, "aggregator": {"type": "gossip", "peers": 1}}]}

A change at step N is decided after the N-th step completed and applies from step N+1 on.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import model_validator

from ...config_base import StrictModel
from ..base import (Action, LRRule, Policy, SetAggregator, SetBatchSize, SetGossipPeers, SetLearningRate,
                    register_policy)


class Change(StrictModel):
    step: int
    micro_batches: Optional[int] = None
    micro_batch_size: Optional[int] = None
    lr_rule: Optional[LRRule] = None
    lr: Optional[float] = None
    lr_scale: Optional[float] = None
    aggregator: Optional[Union[str, Dict[str, Any]]] = None
    gossip_peers: Optional[int] = None

    @model_validator(mode="after")
    def _something(self) -> "Change":
        if all(getattr(self, k) is None for k in ("micro_batches", "micro_batch_size", "lr", "lr_scale",
                                                 "aggregator", "gossip_peers")):
            raise ValueError("a change needs at least one of micro_batches, micro_batch_size, lr, lr_scale, "
                             "aggregator, gossip_peers")
        for k in ("micro_batches", "micro_batch_size", "gossip_peers"):
            v = getattr(self, k)
            if v is not None and v < 1:
                raise ValueError(f"{k} must be >= 1")
        return self


@register_policy("schedule")
class Schedule(Policy):
    """Apply the listed changes at their steps."""

    class Options(StrictModel):
        changes: List[Change] = []

    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        out: List[Action] = []
        for c in self.options.changes:
            if c.step != metrics["step"]:
                continue
            if c.micro_batches is not None or c.micro_batch_size is not None:
                out.append(SetBatchSize(c.micro_batches, c.micro_batch_size, c.lr_rule))
            if c.lr is not None or c.lr_scale is not None:
                out.append(SetLearningRate(lr=c.lr, scale=c.lr_scale))
            if c.aggregator is not None:
                out.append(SetAggregator(c.aggregator))
            if c.gossip_peers is not None:
                out.append(SetGossipPeers(c.gossip_peers))
        return out

    @classmethod
    def aggregators_named(cls, options: StrictModel) -> List[tuple]:
        out = []
        for i, c in enumerate(options.changes):
            if c.aggregator is not None:
                name = c.aggregator if isinstance(c.aggregator, str) else c.aggregator.get("type", "mean")
                out.append((f"changes.{i}.aggregator", name))
        return out
