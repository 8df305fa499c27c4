"""Schema of `pdv.policy`: the Monitor's outputs and the plugins the PolicyRunner runs.

Each plugin entry is `{"name": <registered name | entry point | "module:Class">, **options}`; the options
are checked against that policy class's own `Options` model (like aggregators) by `policy_plugins`, a
whole-config check that `pdv_ext.config` runs, so that `pdv check-config` reports them with their key path.
No heavy imports here.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional

from pydantic import ValidationError, field_validator

from ..aggregation import AGGREGATORS
from ..config_base import StrictModel, format_errors
from ..registry import RegistryError, did_you_mean, factory_errors
from .base import POLICIES, Policy


class MonitorConfig(StrictModel):
    """`pdv.policy.monitor`: what the Monitor measures and where it writes."""

    #: measure even with no plugins (metrics.csv for plots); plugins always turn it on
    enabled: bool = False
    #: directory for `metrics.csv` (rank 0) and TensorBoard events; None = keep metrics in memory only
    output_dir: Optional[str] = None
    #: also write TensorBoard events when `tensorboard` is importable
    tensorboard: bool = True
    #: estimate the gradient noise scale (two sums of squares over the gradients per step)
    gns: bool = True
    #: the noise scale of Adam's preconditioned gradients (each element over the square root of the optimizer's
    #: second moment, as Pollux estimates it for Adam): what an Adam step sees, not plain SGD's. Where the
    #: optimizer keeps `exp_avg_sq` per parameter (torch Adam / AdamW, fp32 without ZeRO); elsewhere the plain
    #: noise scale (with a warning). The first step (no second moment yet) gives no reading.
    gns_preconditioned: bool = False
    #: EMA smoothing factor of the GNS estimates (weight of the past)
    ema: float = 0.95
    #: flush metrics.csv every N steps
    flush_every: int = 20

    @field_validator("ema")
    @classmethod
    def _ema(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError("must be in [0, 1)")
        return v

    @field_validator("flush_every")
    @classmethod
    def _flush(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v


class PolicyConfig(StrictModel):
    """`pdv.policy`: plugins run by the PolicyRunner."""

    plugins: List[Dict[str, Any]] = []
    #: a plugin that raises is reported and disabled ("disable") or stops the run ("raise")
    on_error: Literal["disable", "raise"] = "disable"
    #: gather metrics over all ranks and agree on actions every N steps (window means; rank 0 still
    #: records a local row per step): one small collective per N steps
    every: int = 1
    #: LR rule used by SetBatchSize actions that do not name one
    lr_scaling: Literal["none", "linear", "sqrt", "adascale"] = "sqrt"
    monitor: MonitorConfig = MonitorConfig()

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, v: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        for i, p in enumerate(v):
            if not isinstance(p.get("name"), str) or not p["name"]:
                raise ValueError(f"plugin {i} needs a 'name' (a registered policy or 'module:Class')")
        return v

    @field_validator("every")
    @classmethod
    def _every(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @property
    def active(self) -> bool:
        """True when the engine should build a Monitor (and a runner when there are plugins)."""
        return bool(self.plugins) or self.monitor.enabled


def policy_plugins(cfg: Any, prefix: str) -> List[str]:
    """Plugin names and options, and the aggregators that policies name, checked with the whole config."""
    errors: List[str] = []
    for i, spec in enumerate(cfg.policy.plugins):
        path = f"{prefix}.policy.plugins.{i}"
        try:
            cls = POLICIES.get(spec["name"])
        except RegistryError as exc:
            errors.append(f"{path}.name: {exc}")
            continue
        if not (isinstance(cls, type) and issubclass(cls, Policy)):  # only building it tells
            errors.extend(factory_errors(cls, {k: v for k, v in spec.items() if k != "name"}, Policy, spec["name"],
                                         f"{path}.name"))
            continue
        model = getattr(cls, "Options", None)
        if model is None:
            continue
        try:
            parsed = model.model_validate({k: v for k, v in spec.items() if k != "name"})
        except ValidationError as exc:
            errors.extend(format_errors(exc, model, path))
            continue
        named = getattr(cls, "aggregators_named", None)
        if named is None:
            continue
        for key, agg in named(parsed):
            if agg not in AGGREGATORS:
                errors.append(f"{path}.{key}: unknown aggregator '{agg}'{did_you_mean(agg, AGGREGATORS.names())}; "
                              f"known: {', '.join(AGGREGATORS.names())}")
    return errors

