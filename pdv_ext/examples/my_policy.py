"""Template for your own policy: copy this file (`pdv example plugins DIR`), rename the class, change
`after_step`.

Use it from the config without packaging anything (the module is looked up on sys.path, then in the
working directory: run from the folder you copied it to, or put that folder on PYTHONPATH):

    "pdv": {"policy": {"plugins": [{"name": "my_policy:PlateauLR", "patience": 20}]}}

(`configs/my_plugins.json` does; in place, without copying, the name is `pdv_ext.examples.my_policy:PlateauLR`),
or register a name for it in your package's pyproject.toml:
    [project.entry-points."pdv_ext.policies"]
    plateau_lr = "my_pkg.my_policy:PlateauLR"

A policy only decides: its `after_step` runs on rank 0, must not communicate, and returns Actions that
the runner applies on every rank at the same step (`__init__`, `on_train_begin` and `load_state_dict` run
on every rank). Whatever `state_dict` returns is saved in checkpoints. Python puts a script's own folder
first on sys.path: a copy called my_policy.py next to a script of yours is the one that script imports.
"""
from __future__ import annotations

from typing import Any, Dict, List

from pydantic import Field

from pdv_ext.config_base import StrictModel
from pdv_ext.policy import Action, Policy, SetLearningRate


class PlateauLR(Policy):
    """Multiply the LR by `factor` when the smoothed loss has not improved by `min_delta` for `patience` steps."""

    class Options(StrictModel):  # your config keys; unknown or ill-typed keys are config errors
        patience: int = Field(50, ge=1)
        factor: float = Field(0.5, gt=0.0, lt=1.0)
        min_delta: float = Field(1e-3, ge=0.0)
        smoothing: float = Field(0.9, ge=0.0, lt=1.0)

    def __init__(self, options: Any = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        self.ema = None
        self.best = float("inf")
        self.since_best = 0

    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        loss = metrics.get("loss")
        if loss is None:
            return []
        o = self.options
        self.ema = loss if self.ema is None else o.smoothing * self.ema + (1 - o.smoothing) * loss
        if self.ema < self.best - o.min_delta:
            self.best, self.since_best = self.ema, 0
            return []
        self.since_best += 1
        if self.since_best < o.patience:
            return []
        self.since_best = 0
        return [SetLearningRate(scale=o.factor)]

    def state_dict(self) -> Dict[str, Any]:
        return {"ema": self.ema, "best": self.best, "since_best": self.since_best}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.ema, self.best, self.since_best = state["ema"], state["best"], state["since_best"]
