"""In-place recovery of a pipeline engine (`pdv.snapshots.in_place`): a peer died, the survivors go on.

`PDVPipelineEngine.train_batch` calls `recover(engine, error)` when a step failed with what a lost peer does
to a collective. The survivors then, in their own processes (pdv_ext/recovery/inplace.py has the why):
1. give the snapshot in flight half a second to be sealed, then shut down the connections to the old world's
   peers (gloo cannot be aborted): a live peer blocked in a collective with this rank fails at once and joins;
2. agree on who is left over the recovery store (`agree`); fewer than half -> the error is raised (this rank
   is more likely the odd one out than the world); everyone there (a heartbeat taken for lost, a connection
   dropped) -> the same ranks in a new world;
   the old snapshots are then left to themselves (nothing of the old world is sealed any more);
3. forget every process group, form the survivors' world on the recovery store;
4. plan for it: the start-up planner where `pdv.placement.cluster` describes the devices (the lost ones are
   not asked for), else the same stage boundaries with the survivors row-major over them;
5. build the new stage and engine as a move does, and load the newest complete snapshot into it;
6. hand the user's engine object the new state (as a move does) and the data position to their iterator.
A heartbeat thread (recovery/inplace.py `Heartbeat`) turns a host that vanished silently into the same
failure within `heartbeat_dead_s`. Anything that fails on the way exits the process (`EXIT_CODE`): a launcher's restart then resumes from the
snapshots as it would have without this, never from a half-built engine.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ...comm.torch_comm import InterruptedCollective, set_interrupt
from ...config_base import ConfigError
from ...log import logger
from ...placement.plan import Layout, row_major_mapping
from ...recovery import injected
from ...recovery.inplace import (Heartbeat, begin, close_peer_connections, connect, fill_exit_barrier,
                                 parse_address, peer_addresses, survivors)
from . import internals
from .checkpoint import plan_of
from .move import build_engine
from .runtime import runtime_of
from .snapshots import InterruptedWait
from .topology import MappedTopology, build_stage_layers, link_tied_layers

#: the exit status of a rank that could not recover in place (its launcher restarts it)
EXIT_CODE = 75

#: what a collective raises when a peer's process or host is gone (gloo's and NCCL's own words): any other
#: error is the user's or ours, and is raised as it is
_LOST_PEER_WORDS = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "Timed out",
                    "timed out", "gloo", "NCCL", "ProcessGroup", "peer")


@dataclass
class InPlace:
    """One rank's in-place recovery state, kept in the engine's runtime (a recovery carries it over)."""
    store: Any  # the recovery store, keys under this job's and epoch's prefix
    settle_s: float
    timeout_s: float
    raw_store: Any = None  # the same store without the prefix (torchrun's rendezvous store, if it is that)
    #: each rank's torchrun agent (GROUP_RANK), by rank: an agent lost with all its workers is checked into
    #: the exit barrier for the survivors' agents (None: not under torchrun)
    agents: Optional[List[int]] = None
    #: the agents of the rendezvous round (the exit barrier's size: a recovery does not start a new round)
    round_agents: int = 0
    #: the peers' addresses (what a survivor disconnects from first) and the store's, which it keeps
    peers: Set[str] = field(default_factory=set)
    keep: Tuple[str, int] = ("", 0)
    #: each rank's id for the heartbeats (its rank at start-up), by current rank
    uids: List[int] = field(default_factory=list)
    heartbeat: Any = None
    generation: int = 0
    #: the global step at which the last recovery resumed (a failure of the first step after it is raised)
    resumed_at: Optional[int] = None
    recoveries: List[Dict[str, Any]] = field(default_factory=list)


def setup(engine: Any, cfg: Any) -> Optional[InPlace]:
    """At start-up (collective): the recovery store's client, under a prefix rank 0 draws for this life of the
    job. None unless `pdv.snapshots.in_place`."""
    if cfg is None or not cfg.in_place:
        return None
    injected.faults(FAULT_ENV, FAULT_PHASES)  # a bad fault spec: said now, not half-way through a recovery
    address = cfg.store_address()
    if not address:
        raise ConfigError(["pdv.snapshots.store: in_place needs a store that outlives the training hosts "
                           "(HOST:PORT; or set PDV_RECOVERY_STORE, or launch with torchrun --rdzv-endpoint)"])
    box = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    agents: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(agents, os.environ.get("GROUP_RANK") if os.environ.get("TORCHELASTIC_RUN_ID") else None)
    raw = connect(address, timeout_s=cfg.timeout)
    from torch.distributed import PrefixStore

    host, port = parse_address(address)
    keep = (socket.gethostbyname(host), port)
    dist.barrier()  # every process group of the engine has connected: their peers' addresses are known
    peers = peer_addresses(keep)
    prefix = f"pdv-inplace/{cfg.job_name()}/{box[0]}/"
    rank, world = dist.get_rank(), dist.get_world_size()

    def shut(why: str) -> None:  # a collective or wait of this rank's on the old world fails now
        n = close_peer_connections(peers, keep)
        logger.warning(f"pdv in-place recovery: {why}: {n} connection(s) of the old world shut down")

    beat = Heartbeat(address, prefix, rank, list(range(world)),
                     lambda uids: shut(f"no heartbeat from rank(s) {uids} for {cfg.heartbeat_dead_s:g} s"),
                     dead_after_s=cfg.heartbeat_dead_s,
                     on_begun=lambda gen: shut(f"another rank began recovering (generation {gen})"))
    # the aggregators' collectives (on gloo) and the wait for the snapshot in flight give up when it is set
    set_interrupt(beat.interrupted)
    return InPlace(store=PrefixStore(prefix, raw), settle_s=cfg.settle_s, timeout_s=cfg.timeout, raw_store=raw,
                   peers=peers, keep=keep, uids=list(range(world)), heartbeat=beat,
                   agents=[int(a) for a in agents] if all(a is not None for a in agents) else None,
                   round_agents=len({a for a in agents if a is not None}))


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is what a collective raises when a peer is gone (a torch distributed error, or gloo's or
    NCCL's words for a closed or silent connection)."""
    if isinstance(error, (InterruptedWait, InterruptedCollective)):  # a wait of this rank's, given up (a peer lost)
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    return isinstance(error, RuntimeError) and any(w in str(error) for w in _LOST_PEER_WORDS)


def recover(engine: Any, error: BaseException) -> bool:
    """Recover `engine` in place after `error` (see the module docstring). True: recovered, run the step again;
    False: not a lost peer, raise `error`. Exits the process when recovery itself fails."""
    rt = runtime_of(engine)
    ip: Optional[InPlace] = getattr(rt, "in_place", None)
    if ip is None or not lost_peer(error):
        return False
    if ip.resumed_at is not None and int(engine.global_steps) == ip.resumed_at:
        logger.error("pdv in-place recovery: the first step after the last recovery failed too; leaving")
        return False
    t0, wall0 = time.perf_counter(), time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    if ip.heartbeat is not None:
        ip.heartbeat.pause()
    if engine.pdv_snapshots is not None:  # the snapshot in flight: a moment to be sealed, if it needs no one lost
        engine.pdv_snapshots.wait_briefly(0.5)
    # every live peer blocked in a collective with this rank fails now, not at the group's timeout
    closed = close_peer_connections(ip.peers, ip.keep)
    gen = ip.generation + 1
    try:  # every other rank's heartbeat sees it and makes that rank join, whatever it waits on
        begin(ip.store, gen)
    except Exception as exc:  # noqa: BLE001 - the agreement below says what is wrong with the store
        logger.warning(f"pdv in-place recovery: could not announce the recovery ({exc})")
    uid = ip.uids[rank]
    _fault("report", uid)
    uids = ip.uids if ip.heartbeat is not None else None
    members, gen = survivors(ip.store, gen, rank, world, ip.settle_s, uids=uids, warn=logger.warning)
    t_agree = time.perf_counter()
    if engine.pdv_snapshots is not None:  # nothing of the old world is sealed from here on
        engine.pdv_snapshots.abandon()
    old_agents = ip.agents
    for attempt in range(world):
        if 2 * len(members) < world:
            logger.error(f"pdv in-place recovery: {len(members)} of {world} ranks reported after the error: too "
                         "few to be the survivors")
            return False
        try:
            report = _rebuild(engine, ip, gen, members, backend, rank, uid)
            break
        except _BeforeCommit as exc:  # a member lost while the new world formed: without it, from the top
            if attempt + 1 == world or isinstance(exc.__cause__, ConfigError):
                _leave()
            logger.warning(f"pdv in-place recovery: generation {gen} of ranks {members} failed while it formed "
                           f"({(str(exc.__cause__).splitlines() or [''])[0][:200]}); agreeing again without "
                           "the ranks that went silent")
            close_peer_connections(ip.peers, ip.keep)  # those of the new world still in it fail now, and join
            internals.forget_process_groups()
            members, gen = survivors(ip.store, gen + 1, rank, world, ip.settle_s, uids=uids, warn=logger.warning)
        except BaseException:  # noqa: BLE001 - never go on with a half-built engine: the launcher restarts us
            _leave()
    report.update(detect_error=(str(error).splitlines() or [""])[0][:200], agree_s=t_agree - t0,
                  seconds=time.perf_counter() - t0, old_rank=rank, old_world=world, t_start=wall0, closed=closed,
                  t_ready=time.time() - report["resume_s"] - report["commit_s"])
    if old_agents is not None and dist.get_rank() == 0:  # torchrun: the lost agents, for the survivors' exit
        lost = set(old_agents) - {old_agents[r] for r in members}
        try:
            fill_exit_barrier(ip.raw_store, os.environ["TORCHELASTIC_RUN_ID"], len(lost), ip.round_agents)
            report["exit_barrier_filled"] = len(lost)
        except Exception as exc:  # noqa: BLE001 - the agents then wait their timeout at the end: say so
            logger.warning(f"pdv in-place recovery: could not check the {len(lost)} lost torchrun agents into "
                           f"the exit barrier ({exc}); the survivors' agents will wait for them at the end")
    new_ip: InPlace = runtime_of(engine).in_place
    new_ip.recoveries.append(report)
    if dist.get_rank() == 0:
        logger.info(f"pdv: recovered in place at step {report['step']}: world {world} -> {len(members)} "
                    f"(lost ranks {sorted(set(range(world)) - set(members))}), plan {report['plan']}, "
                    f"{report['seconds']:.2f} s")
    return True


def _plan(engine: Any, new_world: int) -> Dict[str, Any]:
    """Stage boundaries and rank mapping for the survivors (see the module docstring)."""
    old = plan_of(engine)
    cluster = engine.pdv_config.placement.cluster
    if cluster is not None:
        from ...placement.startup import plan_for_module  # the lost devices are not among the ranks asking

        plan = plan_for_module(engine.module, engine.pdv_config.placement, layers=internals.layer_specs(engine.module))
        return {"boundaries": list(plan["boundaries"]), "rank_mapping": [list(r) for r in plan["rank_mapping"]]}
    stages = len(old["rank_mapping"])
    if new_world % stages:
        raise ConfigError([f"in-place recovery: {new_world} ranks left cannot run the {stages} stages of the "
                           f"plan (set pdv.placement.cluster to let the planner choose another depth)"])
    return {"boundaries": list(old["boundaries"]), "rank_mapping": row_major_mapping(stages, new_world)}


class _BeforeCommit(Exception):
    """The new world failed before the engine you hold took over its state (a member lost while it formed,
    built or loaded): the survivors can agree again and start over. The cause is `__cause__`."""


def _leave() -> None:
    traceback.print_exc()
    logger.error("pdv in-place recovery failed; exiting for a restart from the snapshots")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


#: `PHASE:UID[,PHASE:UID...]`: the rank whose start-up rank is UID kills itself (SIGKILL) at that phase of an
#: in-place recovery (the tests of a second failure during one): `report` (before it reports), `form` (agreed
#: on, before the new world's process group), `build` (group formed, before the engine), `load` (engine
#: built, before the snapshot is loaded)
FAULT_ENV = "PDV_INPLACE_FAULT"
FAULT_PHASES = ("report", "form", "build", "load")


def _fault(phase: str, uid: int) -> None:
    if injected.fires(FAULT_ENV, FAULT_PHASES, phase, uid):
        import signal

        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _rebuild(engine: Any, ip: InPlace, gen: int, members: List[int], backend: str, rank: int,
             uid: int) -> Dict[str, Any]:
    """Form generation `gen` of `members`, build its engine and load the snapshot into it, then hand the state
    to `engine`. A failure before that hand-over is raised as `_BeforeCommit` (nothing of `engine` changed)."""
    try:  # the engine's groups wait for a silent member as long as the new world does, not torch's 30 minutes
        with internals.new_groups_time_out_after(ip.timeout_s):
            built, new, step, plan, times = _form_and_build(engine, ip, gen, members, backend, rank, uid)
    except BaseException as exc:  # noqa: BLE001
        raise _BeforeCommit(str(exc)) from exc
    return _commit(engine, ip, gen, members, built, new, step, plan, times)


def _form_and_build(engine: Any, ip: InPlace, gen: int, members: List[int], backend: str, rank: int,
                    uid: int) -> Tuple[Any, Any, int, Dict[str, Any], Dict[str, float]]:
    from torch.distributed import PrefixStore

    times: Dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        times[name] = now - mark[0]
        mark[0] = now

    new_rank, new_world = members.index(rank), len(members)
    _fault("form", uid)
    internals.forget_process_groups()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(new_rank), str(new_world)
    dist.init_process_group(backend, store=PrefixStore(f"g{gen}/pg/", ip.store), rank=new_rank,
                            world_size=new_world, timeout=timedelta(seconds=ip.timeout_s))
    lap("group_s")
    _fault("build", uid)
    plan = _plan(engine, new_world)
    width_before, width = int(engine.grid.get_data_parallel_world_size()), len(plan["rank_mapping"][0])
    if width != width_before and not internals.gradients_are_micro_batch_means() and new_rank == 0:
        logger.warning(f"pdv in-place recovery: {width_before} -> {width} replicas per stage on DeepSpeed "
                       f"{internals.deepspeed_version()}, whose pipeline engine sums the micro-batch gradients: "
                       f"from here the gradient is {width_before}/{width} of its scale before (as after any restart "
                       "of such a job at another width); Adam absorbs most of it, the losses drift ~1e-4 from a "
                       "run that kept its width. DeepSpeed >= 0.19.3 keeps the scale")
    new = internals.module_copy(engine)
    topo = MappedTopology(plan["rank_mapping"])
    internals.set_topology(new, topo)
    rng = torch.get_rng_state()  # building layers re-seeds it (seed_layers)
    try:
        build_stage_layers(new, plan["boundaries"], topo.get_coord(new_rank).pipe)
    finally:
        torch.set_rng_state(rng)
    new._pdv_placement = Layout(plan["boundaries"], plan["rank_mapping"]).to_dict()
    link_tied_layers(new)
    given = runtime_of(engine).build.get("model_parameters")
    if isinstance(given, (list, tuple)) and given and all(isinstance(g, dict) for g in given):
        raise ConfigError(["in-place recovery: parameter groups (model_parameters as dicts) are not carried over "
                           "yet; pass model.parameters()"])
    params = [p for p in new.parameters() if p.requires_grad]
    built = build_engine(engine, new, len(plan["rank_mapping"][0]), params)
    lap("engine_s")
    if built.pdv_snapshots is None:
        raise ConfigError(["in-place recovery needs pdv.snapshots"])
    try:
        _fault("load", uid)
        step = built.pdv_snapshots.resume(built)
        if step is None:
            raise RuntimeError("in-place recovery: no snapshot of this job on the survivors' hosts")
    except BaseException:
        built.pdv_snapshots.abandon()  # (its keeper process) the next attempt builds another
        raise
    lap("resume_s")
    return built, new, int(step), plan, times


def _commit(engine: Any, ip: InPlace, gen: int, members: List[int], built: Any, new: Any, step: int,
            plan: Dict[str, Any], times: Dict[str, float]) -> Dict[str, Any]:
    mark = [time.perf_counter()]
    it = engine.data_iterator
    internals.swap_engine_state(engine, engine.module, built, new)
    glue = getattr(engine, "pdv_policy", None)
    if glue is not None:
        glue.rebind(engine)
    if engine.is_first_stage() or engine.is_last_stage():
        engine.data_iterator = it
    rt = runtime_of(engine)
    rt.pending_replica = (engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size())
    ip.generation, ip.resumed_at = gen, int(step)
    if ip.agents is not None:  # the survivors' agents, by their new ranks (a next recovery counts from these)
        ip.agents = [ip.agents[r] for r in members]
    ip.uids = [ip.uids[r] for r in members]
    if ip.heartbeat is not None:
        ip.heartbeat.watch(ip.uids, generation=gen)
    rt.in_place = ip
    times["commit_s"] = time.perf_counter() - mark[0]
    return {"step": int(step), "generation": gen, "world": len(members), "plan": plan, **times}
