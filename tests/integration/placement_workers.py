"""Rank-side functions of the placement integration tests."""
from __future__ import annotations

from typing import Any, Dict

from .workers import train_mlp


def train_with_placement(pdv: Dict[str, Any], steps: int = 1, layers: int = 8, stages: int = 2) -> Dict[str, Any]:
    """train_mlp through pdv_ext.initialize with a pdv.placement section; report what took effect."""
    out = train_mlp("pdv", steps=steps, stages=stages, layers=layers, pdv=pdv)
    out.pop("weights", None)
    return out
