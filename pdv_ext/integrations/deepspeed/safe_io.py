"""pdv's checkpoint files hold tensors and plain values only, and load with `torch.load(weights_only=True)`.

A pickle can run code when it is loaded; a checkpoint directory is often shared, copied or downloaded. So
everything pdv writes (its per-rank state, the layer-keyed files, their meta) is checked to be tensors,
numbers, strings, None and lists / tuples / dicts of those before it is written, and read back with torch's
restricted unpickler. A file that needs more (crafted, or written by something else) is refused with one
error naming it. DeepSpeed's own checkpoint files are loaded by DeepSpeed, which still trusts them
(it loads them without torch's restriction): docs/deepspeed.md says so.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from ...config_base import ConfigError

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def check_plain(obj: Any, where: str = "state") -> None:
    """Raise TypeError naming the first value under `obj` that is not a tensor or a plain value."""
    if isinstance(obj, (torch.Tensor,) + _SCALARS):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__name__} is not a plain value")
            check_plain(v, f"{where}[{k!r}]")
        return
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__name__} is not a tensor or a plain value "
                    "(pdv's checkpoint files load with weights_only=True)")


def save_plain(obj: Any, path: str, what: str = "state") -> int:
    """Check `obj` (`check_plain`), write it through a temporary name (a reader never sees half a file);
    returns the bytes written."""
    check_plain(obj, what)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return os.path.getsize(path)


def load_plain(path: str, map_location: Any = "cpu") -> Any:
    """`torch.load(path, weights_only=True)`; a file that needs anything else is refused (ConfigError)."""
    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError([f"load_checkpoint: {path} was refused: it holds more than tensors and plain values, which "
                           f"pdv never writes (the file was crafted or written by something else; torch's "
                           f"weights_only loader: {first})"]) from None
