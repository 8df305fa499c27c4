"""Profiling a user's PipelineModule: every stage's layers, whatever the local stage holds."""
from __future__ import annotations

from typing import Any

from ...placement.profile import Profile, profile_module
from . import internals


def profile_pipeline(module: Any, sample_input: Any, reps: int = 5, progress: bool = False,
                     labels: Any = None) -> Profile:
    """`pdv_ext.placement.profile.profile_module` for a built `PipelineModule`: each of its layers (from its
    specs) timed forward + backward on this process's device; with `labels`, the last layer's time includes
    the module's `loss_fn`. Save it with `.save(path)` and give it to `pdv plan --profile` or
    `pdv.placement.profile`."""
    return profile_module(module, sample_input, reps=reps, progress=progress, labels=labels,
                          layers=internals.layer_specs(module))
