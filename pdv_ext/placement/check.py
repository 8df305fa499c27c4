"""What `pdv check-config` checks of `pdv.placement` beyond its schema: what the launch will load.

The schema (`placement/config.py`) sees names; the launch then reads the cluster YAML, the plan JSON and
the profile JSON, imports a `"module:function"` solver, and fails there, on rank 0, after the process
group started, when one is missing or malformed or does not match the job's size. This module loads the
same files the same way (relative paths in a config file read from its folder, as at launch) and checks the sizes
they must agree on, so that all of it is one line per problem before anything starts.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, List, Optional, Tuple

from pydantic import ValidationError

from ..config_base import ConfigError, format_errors
from ..registry import RegistryError
from .cluster import Cluster, ClusterDefaultWarning
from .config import PlacementConfig
from .profile import Profile
from .solvers import SOLVERS


def load_cluster(path: str, key: str, notes: List[str]) -> Tuple[Optional[Cluster], List[str]]:
    """(the cluster or None, its errors prefixed by `key`); the defaults it fills go to `notes`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ClusterDefaultWarning)
        try:
            cluster = Cluster.load(path)
        except ConfigError as exc:
            return None, [f"{key}: {line}" for line in exc.errors]
    notes.extend(f"{key}: {w.message}" for w in caught if issubclass(w.category, ClusterDefaultWarning))
    return cluster, []


def _plan_file(path: str, key: str) -> Tuple[Optional[PlacementConfig], List[str]]:
    """The plan's boundaries and rank mapping, checked by the same rules as explicit ones in the config."""
    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
    except (OSError, ValueError) as exc:
        return None, [f"{key}: cannot read plan '{path}': {exc}"]
    if not isinstance(plan, dict) or plan.get("boundaries") is None or plan.get("rank_mapping") is None:
        return None, [f"{key}: '{path}' has no 'boundaries'/'rank_mapping' (write one with `pdv plan --out`)"]
    try:
        return PlacementConfig(boundaries=plan["boundaries"], rank_mapping=plan["rank_mapping"]), []
    except ValidationError as exc:
        return None, [f"{key}: {line}" for line in format_errors(exc, PlacementConfig, path)]


def placement_errors(pl: PlacementConfig, world_size: Optional[int] = None, stages: Optional[int] = None,
                     notes: Optional[List[str]] = None, prefix: str = "pdv.placement") -> Tuple[List[str], Optional[int]]:
    """(errors, the pipeline's stage count where the section fixes it) of a schema-valid `pdv.placement`:
    the files it names load, a `module:function` solver imports, and their sizes agree with each other and
    with `world_size` ranks in `stages` stages when given. Defaults a cluster fills go to `notes`."""
    notes = notes if notes is not None else []
    errors: List[str] = []
    planned: Optional[Tuple[int, str]] = None  # (stage count, the key that fixes it)
    ranks: Optional[Tuple[int, str]] = None    # (rank count, the key that fixes it)
    if pl.num_stages is not None:
        planned = (pl.num_stages, f"{prefix}.num_stages")
    if pl.rank_mapping is not None:
        planned = (len(pl.rank_mapping), f"{prefix}.rank_mapping")
        ranks = (sum(len(r) for r in pl.rank_mapping), f"{prefix}.rank_mapping")
    elif pl.boundaries is not None:
        planned = (len(pl.boundaries) - 1, f"{prefix}.boundaries")
    if pl.plan is not None:
        plan, errs = _plan_file(pl.plan, f"{prefix}.plan")
        errors += errs
        if plan is not None:
            planned = (len(plan.rank_mapping), f"{prefix}.plan")
            ranks = (sum(len(r) for r in plan.rank_mapping), f"{prefix}.plan")
    if pl.cluster is not None:
        cluster, errs = load_cluster(pl.cluster, f"{prefix}.cluster", notes)
        errors += errs
        if cluster is not None:
            ranks = (len(cluster), f"{prefix}.cluster")
            if planned is not None and len(cluster) % planned[0]:
                errors.append(f"{planned[1]}: {planned[0]} stages do not divide the {len(cluster)} devices of "
                              f"'{pl.cluster}' (DeepSpeed gives every stage the same number of ranks)")
        if pl.profile and os.path.exists(pl.profile):
            try:
                prof = Profile.load(pl.profile)
            except ConfigError as exc:
                errors += [f"{prefix}.profile: {line}" for line in exc.errors]
            else:
                want = stages or (planned[0] if planned else None)
                if want is not None and want > len(prof):
                    errors.append(f"{prefix}.profile: '{pl.profile}' has {len(prof)} layers, fewer than the "
                                  f"{want} stages")
        elif not pl.input_shape:
            what = f"'{pl.profile}' does not exist yet" if pl.profile else "no profile is given"
            errors.append(f"{prefix}.input_shape: needed to profile the model at start-up ({what}); or give "
                          f"{prefix}.profile, a profile JSON written by `pdv profile`")
        if ":" in pl.solver:
            try:
                SOLVERS.get(pl.solver)
            except RegistryError as exc:
                errors.append(f"{prefix}.solver: {exc}")
    if world_size is not None and ranks is not None and ranks[0] != world_size:
        what = "describes" if ranks[1].endswith(".cluster") else "places"
        unit = "devices (device i is rank i)" if what == "describes" else "ranks"
        errors.append(f"{ranks[1]}: {what} {ranks[0]} {unit} but --world-size {world_size}")
    if stages is not None and planned is not None and planned[0] != stages and \
            planned[1].endswith((".plan", ".rank_mapping")):  # num_stages and boundaries: config.topology_errors
        errors.append(f"{planned[1]}: {planned[0]} stages, but --stages {stages}")
    return errors, (planned[0] if planned else None)
