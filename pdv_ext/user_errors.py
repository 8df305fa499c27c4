"""A launch that fails on bad configuration says why once, not in one traceback per rank.

Every rank reads and validates the same config, so a `ConfigError` (a known, user-facing error: each line
names the key and what is wrong) is raised on all of them at the same point; printed by each with its
traceback, four ranks gave about 110 lines for one typo. Under `exit_on_config_error`, rank 0 prints the
error's lines to stderr, every rank exits with status 2 (the launcher sees the same failure from each), and
no traceback is printed. Any other exception propagates as before: it may differ between ranks, and its
traceback is the information.

Without the decorator, the public entry points that read the user's settings (`pdv_ext.initialize`,
`pdv_ext.load_pdv`, `PDVPipelineEngine.load_checkpoint`) still raise `ConfigError`, so a caller can catch
it; on its way out they install `exit_if_uncaught`'s `sys.excepthook`, which turns a ConfigError that
nothing caught (it would end the process with a traceback per rank) into the same clean stop: the lines
once, status 2. Other exceptions, and any exception in an interactive session, reach the previous hook.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional, TypeVar

from .config_base import ConfigError

F = TypeVar("F", bound=Callable[..., Any])

#: exit status of a run stopped by a ConfigError (the `pdv` commands use 2 for invalid input too)
EXIT_CONFIG_ERROR = 2

#: the line above a ConfigError's lines (a subclass may set its own `heading`)
HEADING = "pdv_ext: invalid configuration (fix it and run again; `pdv check-config FILE` checks a file):"

_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "HOROVOD_RANK")


def launcher_rank() -> Optional[int]:
    """This process's global rank: from torch.distributed when it is up, else from the launcher's
    environment (deepspeed, torchrun, mpirun, horovodrun); None when nothing says (a plain `python`)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def report_config_error(exc: ConfigError, stream: Any = None) -> None:
    """Rank 0 (or a process no launcher started) prints the error's lines; other ranks print nothing."""
    if launcher_rank() not in (None, 0):
        return
    stream = stream if stream is not None else sys.stderr
    lines = exc.errors or [str(exc)]
    print(getattr(exc, "heading", None) or HEADING, file=stream)
    for line in lines:
        print(f"  {line}", file=stream)
    stream.flush()


def _exit_hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
    """sys.excepthook while installed: an uncaught ConfigError -> its lines once, status 2 (SystemExit raised
    from the hook ends the interpreter with that status, atexit handlers run); anything else -> the hook
    that was there before."""
    interactive = hasattr(sys, "ps1") or sys.flags.interactive
    if isinstance(exc, ConfigError) and not interactive:
        report_config_error(exc)
        sys.stdout.flush()
        raise SystemExit(EXIT_CONFIG_ERROR)
    _previous_hook(exc_type, exc, tb)


_previous_hook: Callable[..., Any] = sys.excepthook


def install_exit_hook() -> None:
    """Make an uncaught ConfigError end the process like `exit_on_config_error` does (idempotent; chains to
    the hook in place, so a tool's own excepthook still sees every other exception)."""
    global _previous_hook
    if sys.excepthook is not _exit_hook:
        _previous_hook = sys.excepthook
        sys.excepthook = _exit_hook


def exit_if_uncaught(fn: F) -> F:
    """Decorate a public entry point: a ConfigError it raises still propagates (catch it to handle it), and
    one that nothing catches ends the process with its lines once and status 2 (`install_exit_hook`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError:
            install_exit_hook()
            raise

    return run  # type: ignore[return-value]


def exit_on_config_error(main: F) -> F:
    """Decorate a training script's `main`: a ConfigError ends the run with its lines printed once (rank 0)
    and exit status 2 on every rank, without a traceback.

        @pdv_ext.exit_on_config_error
        def main(): ...
    """

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except ConfigError as exc:
            report_config_error(exc)
            sys.stdout.flush()
            raise SystemExit(EXIT_CONFIG_ERROR) from None

    return run  # type: ignore[return-value]
