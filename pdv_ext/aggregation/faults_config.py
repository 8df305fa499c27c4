"""Schema of `pdv.faults` (Byzantine fault injection for robustness tests). Filled by the aggregation work."""
from __future__ import annotations

from typing import List

from ..config_base import StrictModel


class FaultsConfig(StrictModel):
    """`pdv.faults`: which ranks misbehave and how. Empty = no faults."""

    byzantine_ranks: List[int] = []
