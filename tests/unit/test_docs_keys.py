"""Every config key of the "pdv" schema (and of every built-in aggregator's and policy's options) appears in
docs/*.md inside backticks (inline code or a code block). A failure lists the missing keys per section, so
each page's owner sees what to add."""
from __future__ import annotations

import pathlib
import re
from typing import Any, Dict, List, Set, Type

import pytest
from pydantic import BaseModel

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def documented_tokens() -> Set[str]:
    """Identifiers inside code (fenced blocks and inline backticks) of every docs page."""
    tokens: Set[str] = set()
    for page in DOCS.glob("**/*.md"):
        text = page.read_text(encoding="utf-8")
        fenced = re.findall(r"```.*?```", text, flags=re.S)
        text = re.sub(r"```.*?```", " ", text, flags=re.S)
        for code in fenced + re.findall(r"`([^`\n]+)`", text):
            tokens.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    return tokens


def _models_in(annotation: Any) -> List[Type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: List[Type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        found.extend(_models_in(arg))
    return found


def schema_keys(model: Type[BaseModel], path: str, out: Dict[str, List[str]]) -> Dict[str, List[str]]:
    """{section path: [keys]} for `model` and every model nested in its fields."""
    out.setdefault(path, [])
    for name, field in model.model_fields.items():
        out[path].append(field.alias or name)
        for sub in _models_in(field.annotation):
            schema_keys(sub, f"{path}.{name}", out)
    return out


def all_sections() -> Dict[str, List[str]]:
    from pdv_ext.aggregation import AGGREGATORS
    from pdv_ext.config import PDVConfig

    sections = schema_keys(PDVConfig, "pdv", {})
    for name in AGGREGATORS.names():
        cls = AGGREGATORS.get(name)
        if not getattr(cls, "__module__", "").startswith("pdv_ext."):
            continue  # a plugin installed in this environment documents itself
        options = getattr(cls, "Options", None)
        if options is not None:
            schema_keys(options, f"pdv.aggregation (type: {name})", sections)
    try:
        from pdv_ext.policy import POLICIES  # the package registers the built-in policies
    except ImportError:
        return sections
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        options = getattr(cls, "Options", None)
        if options is not None and getattr(cls, "__module__", "").startswith("pdv_ext."):
            schema_keys(options, f"pdv.policy.plugins (name: {name})", sections)
    return sections


def test_schema_walk_finds_nested_sections():
    sections = all_sections()
    assert {"pdv", "pdv.aggregation", "pdv.placement", "pdv.policy", "pdv.init_search", "pdv.faults"} <= set(sections)
    assert "enabled" in sections["pdv.init_search"] and "type" in sections["pdv.aggregation"]


def test_every_config_key_is_documented():
    tokens = documented_tokens()
    missing = {section: [k for k in keys if k not in tokens] for section, keys in all_sections().items()}
    missing = {s: ks for s, ks in missing.items() if ks}
    report = "\n".join(f"  {section}: {', '.join(keys)}" for section, keys in sorted(missing.items()))
    if missing:
        pytest.fail("config keys missing from docs/*.md (write them in backticks on the section's page):\n" + report,
                    pytrace=False)
