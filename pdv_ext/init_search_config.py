"""Schema of `pdv.init_search` (parallel random-initialization search). Filled by the init-search work."""
from __future__ import annotations

from .config_base import StrictModel


class InitSearchConfig(StrictModel):
    """`pdv.init_search`: off unless `enabled`."""

    enabled: bool = False
