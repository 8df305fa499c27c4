"""Shared pieces of every config schema: the strict base model and error formatting (no heavy imports)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from .registry import did_you_mean


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class WithOptions:
    """A plug-in (aggregator, policy) configured by its own nested `Options` model: built from a dict, an
    `Options` instance or keyword arguments, validated strictly (unknown keys are errors)."""

    class Options(StrictModel):
        pass

    def __init__(self, options: Optional[Union[Dict[str, Any], StrictModel]] = None, **kwargs: Any):
        if isinstance(options, StrictModel):
            options = options.model_dump()
        self.options = self.Options.model_validate({**(options or {}), **kwargs})


class ConfigError(ValueError):
    """Bad configuration. `.errors` holds one line per problem, each naming the key path."""

    def __init__(self, errors: List[str]):
        self.errors = list(errors)
        super().__init__("invalid pdv config:\n  " + "\n  ".join(self.errors))


def _fields_of(model: Type[BaseModel], loc: Tuple[Any, ...]) -> List[str]:
    """Field names of the (nested) model at `loc`, for did-you-mean hints."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        ann = fields[part].annotation
        current = _model_in(ann)
    return list(getattr(current, "model_fields", {}) or [])


def _model_in(ann: Any) -> Optional[Type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def format_errors(exc: ValidationError, model: Type[BaseModel], prefix: str) -> List[str]:
    """pydantic errors -> `prefix.key.path: message` lines."""
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        path = ".".join([prefix] + [str(p) for p in loc if p != "__root__"]) if loc else prefix
        if err.get("type") == "extra_forbidden":
            parent_fields = _fields_of(model, loc[:-1])
            hint = did_you_mean(str(loc[-1]), parent_fields)
            known = f"; known keys: {', '.join(parent_fields)}" if parent_fields and not hint else ""
            lines.append(f"{path}: unknown key{hint}{known}")
        else:
            msg = err.get("msg", "invalid value")
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            lines.append(f"{path}: {msg} (got {err.get('input')!r})" if err.get("type") != "missing"
                         else f"{path}: required key is missing")
    return lines
