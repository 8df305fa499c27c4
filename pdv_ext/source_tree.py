"""Whether pdv_ext runs from its source checkout or from an installed wheel, and where build products go.

A checkout (an editable install or PYTHONPATH) keeps its JIT-built ops in `<repo>/build/torch_extensions`,
which `make setup` fills once. An installed package must not write beside itself (site-packages may be
read-only or shared), so there the cache is left to TORCH_EXTENSIONS_DIR or torch's own default.
No torch import here: the launcher sets up rank environments with it before anything heavy loads.
"""
from __future__ import annotations

import os
from typing import Optional

#: the directory holding the `pdv_ext` package
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_root() -> Optional[str]:
    """The repository root when pdv_ext is imported from its source tree (it has the pyproject.toml), else None."""
    return ROOT if os.path.isfile(os.path.join(ROOT, "pyproject.toml")) else None


def jit_cache_dir() -> Optional[str]:
    """TORCH_EXTENSIONS_DIR when set, else `<repo>/build/torch_extensions` in a checkout, else None
    (an installed package: torch's default applies)."""
    root = checkout_root()
    return os.environ.get("TORCH_EXTENSIONS_DIR") or (os.path.join(root, "build", "torch_extensions") if root else None)
