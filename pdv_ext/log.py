"""pdv_ext's own logger (`logging.getLogger("pdv_ext")`): what pdv_ext did, at INFO, visible by default.

The start-up summary and the policies' applied actions are news, not problems: at WARNING they read as
something gone wrong, and DeepSpeed's logger (the previous home of the summary) shows only WARNING and
above by default. So pdv_ext has a logger of its own at INFO with one handler on stdout (where DeepSpeed
logs too, so the lines interleave with the job's own prints), the same line format, and no propagation to
the root logger (no line twice when a script configures logging). Only rank 0 logs these lines.

Quieter: `"log_level": "warning"` (or `"error"`) in the DeepSpeed config, which `pdv_ext.initialize`
applies to this logger as DeepSpeed applies it to its own; or, anywhere,
`logging.getLogger("pdv_ext").setLevel(logging.WARNING)`. To route the lines through your own handlers,
remove this one and set `propagate = True`.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Dict, Optional

logger = logging.getLogger("pdv_ext")

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}


def _install() -> None:
    if any(getattr(h, "_pdv_ext", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(stream=sys.stdout)
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"))
    handler._pdv_ext = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


_install()


def apply_log_level(ds_config: Optional[Dict[str, Any]]) -> None:
    """The DeepSpeed config's `"log_level"` (DeepSpeed's own key) applies to pdv_ext's lines too."""
    level = (ds_config or {}).get("log_level")
    if isinstance(level, str) and level.lower() in LEVELS:
        logger.setLevel(LEVELS[level.lower()])
