"""Planning at start-up: `"pdv": {"placement": {"cluster": "c.yaml", "solver": "dp", "profile": "p.json"}}`.

Rank 0 loads (or measures) the layer profile and runs the solver; the plan is broadcast so that every
rank applies the same boundaries and mapping. Errors on rank 0 are broadcast too, so no rank hangs.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Dict, Optional, Sequence, Tuple

from ..config_base import ConfigError
from .cluster import Cluster
from .profile import Profile, ProfileMemoryError, profile_module
from .plan import Layout


def _sample_input(pl: Any):
    import torch

    if not pl.input_shape:
        raise ConfigError(["pdv.placement.input_shape: needed to profile the model at start-up (or give "
                           "pdv.placement.profile, a profile JSON written by `pdv profile`)"])
    if pl.input_dtype == "int64":
        return torch.randint(0, pl.input_high, tuple(pl.input_shape))
    return torch.randn(*pl.input_shape)


def load_or_profile(module: Any, pl: Any, layers: Sequence[Any]) -> Profile:
    """The profile named by `pl.profile`, or a fresh one (saved to `pl.profile` when it names a new file)."""
    if pl.profile and os.path.exists(pl.profile):
        try:
            return Profile.load(pl.profile)
        except ConfigError as exc:  # its lines name the file and the key
            raise ConfigError([f"pdv.placement.profile: {e}" for e in exc.errors]) from exc
    try:
        prof = profile_module(module, _sample_input(pl), reps=pl.profile_reps, layers=layers)
    except ProfileMemoryError as exc:
        raise ConfigError([f"pdv.placement.profile: not given, and the model cannot be profiled at start-up: {exc}"]) from exc
    if pl.profile:
        os.makedirs(os.path.dirname(os.path.abspath(pl.profile)), exist_ok=True)  # e.g. runs/x/profile.json
        prof.save(pl.profile)
    return prof


def load_cluster(path: str, key: str = "pdv.placement.cluster") -> Cluster:
    """The cluster YAML the config names; its errors prefixed with the key, as `pdv check-config` prints them."""
    try:
        return Cluster.load(path)
    except ConfigError as exc:
        raise ConfigError([f"{key}: {line}" for line in exc.errors]) from exc


def make_plan(module: Any, pl: Any, world_size: int, micro_batches: Optional[int] = None, *,
              layers: Sequence[Any], ranks_at: Optional[Sequence[Tuple[str, int]]] = None) -> Dict[str, Any]:
    """Rank 0's work: cluster + profile + solver -> plan dict (`layers`: the module's layer specs).

    A job with fewer ranks than the cluster has devices (restarted after devices or hosts were lost) plans
    for the devices its ranks run on: `ranks_at` gives each rank's (host, local rank, device name or None);
    rank r runs on the device of its name (PDV_DEVICE_NAME, which `pdv emulate` sets: under torchrun's
    elastic agents ranks come in rendezvous order), else on the local-rank-th device listed for its host
    (`Cluster.devices_of`), and the plan's rank mapping is over the job's ranks."""
    from .solvers import solve

    cluster = load_cluster(pl.cluster)
    present = None
    if ranks_at is not None:
        names = [at[2] if len(at) > 2 else None for at in ranks_at]
        present = cluster.devices_named(names)  # each rank's device by name, whatever order the ranks came in
        if present is None and len(cluster) > world_size:
            present = cluster.devices_of([at[0] for at in ranks_at], [at[1] for at in ranks_at])
    if present is not None and present != list(range(len(cluster))):
        left = f"the {world_size} devices left" if world_size < len(cluster) else "in the order of the ranks"
        cluster = cluster.subset(present, source=f"{pl.cluster} ({left})")
    if len(cluster) != world_size:
        where = "" if ranks_at is None else (" (the ranks run on hosts " +
                                             ", ".join(sorted({h for h, _ in ranks_at})) + ")")
        raise ConfigError([f"pdv.placement.cluster: '{pl.cluster}' describes {len(cluster)} devices but the job "
                           f"has {world_size} ranks{where}"])
    prof = load_or_profile(module, pl, layers)
    if len(prof) != len(layers):
        raise ConfigError([f"pdv.placement.profile: has {len(prof)} layers but the model has "
                           f"{len(layers)}"])
    stages = pl.num_stages or module.num_stages
    mb = pl.micro_batches or micro_batches or 2 * stages
    plan = solve(pl.solver, prof, cluster, stages, mb, schedule=pl.schedule, aggregator=pl.aggregator,
                 **pl.solver_options)
    # which device each rank runs on: policies that model the devices (replan) follow it after a recovery
    return {**plan.to_dict(), "devices": [d.name for d in cluster.devices]}


def on_rank0(fn: Any, what: str) -> Any:
    """`fn()` run on rank 0 only, its result - or its error - on every rank (one object broadcast): a
    file that exists on one node only, or a failure on rank 0, must not leave the other ranks waiting in
    the next collective. Without torch.distributed, just `fn()`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = {"ok": fn()}
        except ConfigError as exc:
            box[0] = {"config_error": exc.errors}
        except Exception as exc:  # every rank must learn about the failure
            box[0] = {"error": f"{type(exc).__name__}: {exc}"}
    dist.broadcast_object_list(box, src=0)
    got = box[0]
    if "config_error" in got:
        raise ConfigError(got["config_error"])
    if "error" in got:
        raise RuntimeError(f"{what} failed on rank 0: {got['error']}")
    return got["ok"]


def plan_for_module(module: Any, placement_cfg: Any, micro_batches: Optional[int] = None, *,
                    layers: Sequence[Any]) -> Dict[str, Any]:
    """Plan on rank 0, broadcast, return the same plan dict on every rank (also kept as `module._pdv_plan`);
    `layers` are the module's layer specs (every stage's)."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialized else (1 if module is None else module.world_size)
    ranks_at = None
    if initialized:  # where each rank runs (host, local rank): a smaller job plans for the devices it has
        ranks_at = [None] * world
        dist.all_gather_object(ranks_at, (os.environ.get("PDV_HOST") or socket.gethostname(),
                                          int(os.environ.get("LOCAL_RANK", "0")), os.environ.get("PDV_DEVICE_NAME")))
    plan = on_rank0(lambda: make_plan(module, placement_cfg, world, micro_batches, layers=layers,
                                      ranks_at=ranks_at), "placement planning")
    if module is not None:
        module._pdv_plan = plan  # the start-up summary reports its solver and predicted step time
    return plan


def read_plan(path: str) -> Dict[str, Any]:
    """A plan JSON (`pdv plan --out`): its boundaries and rank mapping, read on rank 0 and broadcast (a
    stale or missing copy on another node would give it other stages, or an error only there)."""
    def read() -> Dict[str, Any]:
        try:
            with open(path, encoding="utf-8") as f:
                plan = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError([f"pdv.placement.plan: cannot read plan '{path}': {exc}"]) from exc
        if not isinstance(plan, dict) or plan.get("boundaries") is None or plan.get("rank_mapping") is None:
            raise ConfigError([f"pdv.placement.plan: '{path}' has no 'boundaries'/'rank_mapping'"])
        return Layout.from_dict(plan).to_dict()

    return on_rank0(read, "reading the placement plan")
