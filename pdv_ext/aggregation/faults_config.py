"""Schema of `pdv.faults`: make chosen ranks Byzantine, for robustness tests.

Kept free of heavy imports: `pdv_ext.config` assembles it into the `"pdv"` section.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from pydantic import Field, field_validator

from ..config_base import StrictModel

#: built-in attacks (anything else must be a "module:function" user attack)
ATTACKS = ("sign_flip", "gaussian", "bit_flip", "scaled", "label_flip", "nan")


class FaultsConfig(StrictModel):
    """`pdv.faults`: which ranks misbehave and how. Empty `byzantine_ranks` = no faults."""

    #: global ranks that send corrupted gradients (or, for label_flip, train on flipped labels)
    byzantine_ranks: List[int] = []
    #: sign_flip | gaussian | bit_flip | scaled | label_flip | nan | "module:function" (a user attack)
    attack: str = "sign_flip"
    #: sign_flip sends -scale * g (default 1); scaled sends -scale * mean of the honest gradients (default 10)
    scale: Optional[float] = None
    #: standard deviation of the gaussian attack's noise (added to the gradient)
    sigma: float = Field(10.0, ge=0)
    #: bit_flip: probability that an entry gets one random bit of its float representation flipped
    flip_prob: float = Field(1e-3, gt=0, le=1)
    #: label_flip: number of classes (label y becomes num_classes - 1 - y)
    num_classes: int = Field(10, ge=2)
    #: first step at which the Byzantine ranks misbehave
    start_step: int = Field(0, ge=0)
    #: seed of the attacks' randomness (noise, flipped bits)
    seed: int = 0
    #: user attacks: gather every rank's honest gradients for `ctx.all_grads` (one all-gather per step)
    omniscient: bool = True
    #: free-form options handed to a user attack as `ctx.options`
    options: Dict[str, Any] = {}

    @field_validator("byzantine_ranks")
    @classmethod
    def _ranks(cls, v: List[int]) -> List[int]:
        if any(r < 0 for r in v):
            raise ValueError("ranks must be >= 0")
        if len(set(v)) != len(v):
            raise ValueError("a rank is listed twice")
        return sorted(v)

    @field_validator("attack")
    @classmethod
    def _attack(cls, v: str) -> str:
        if v in ATTACKS:
            return v
        module, _, fn = v.partition(":")
        if not module or not fn:
            from ..registry import did_you_mean

            raise ValueError(f"unknown attack '{v}'{did_you_mean(v, ATTACKS)}; built-in: {', '.join(ATTACKS)}, or 'module:function'")
        return v
