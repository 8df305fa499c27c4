"""Wrapping a DeepSpeed pipeline engine's schedule instructions, per engine instance.

Its own module because two layers use it and neither owns it: the policy layer (`policy/engine.py`) times
forward/backward for the Monitor, and the step timer of `pdv emulate` times every instruction; the
DeepSpeed integration, which builds the engine, itself depends on the policy layer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


def wrap_instructions(engine: Any, wrap: Callable[[type, Callable], Callable],
                      instructions: Optional[Sequence[type]] = None) -> None:
    """Give `engine` an instance-level instruction map in which each of `instructions` (default: all)
    runs `wrap(instruction class, current function)`: how the policy layer times forward/backward and
    the placement benchmark times every instruction, on top of whatever map the engine has now."""
    imap = dict(engine._INSTRUCTION_MAP)
    for instr in (imap if instructions is None else instructions):
        imap[instr] = wrap(instr, imap[instr])
    engine._INSTRUCTION_MAP = imap
