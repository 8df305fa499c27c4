"""Schema of `pdv.policy`. Filled by the adaptive-policy work."""
from __future__ import annotations

from typing import Any, Dict, List, Literal

from ..config_base import StrictModel


class PolicyConfig(StrictModel):
    """`pdv.policy`: plugins run by the PolicyRunner."""

    plugins: List[Dict[str, Any]] = []
    on_error: Literal["disable", "raise"] = "disable"
