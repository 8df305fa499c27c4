"""Move a running pipeline to new stage boundaries and a new rank placement, in the same processes.

    report = move_engine(engine, boundaries=[0, 2, 4, 6, 8], rank_mapping=[[0], [1], [2], [3]])

Collective: every rank calls it with the same plan, between two `train_batch` calls (or from a policy
action at the end of one). In order:

1. check: every rank got the same plan, the plan is well formed, the global batch divides into the new
   data-parallel width (one ConfigError on every rank otherwise, before anything moves);
2. collect: each stage reassembles its parameters whole (placement/layer_state.py: fp32 masters and
   optimizer state of BF16_Optimizer / ZeRO-1 partitions, over the stage's data-parallel group);
3. transfer: every parameter the new plan puts on a rank that does not hold it travels from one old owner
   - replica d's own copy to the new replica d - layer by layer, one message per (source, destination)
   pair on the world group (torch.distributed point-to-point: no shared filesystem);
4. build: new groups, the new stage's layers (weights loaded), then a new PDVPipelineEngine in the same
   processes, its optimizer state, step counters, LR schedule, loss scaler and pdv's state (aggregator
   state per parameter, batch geometry keeping the global batch; the policy glue - Monitor and runner -
   is carried over, not rebuilt);
5. commit: the user's engine object and PipelineModule object take over the new ones' state in place
   (both keep working: `engine.train_batch(...)` goes on); the iterator passed to the next `train_batch`
   gets the global data position and the rank's new replica (`ElasticBatches.set_replica`).

Every phase that can fail locally (a rank raising, out of memory on the new stage) ends in an agreement
(one all-gather of a flag): a failure anywhere is one MoveError on every rank and the old engine is left
as it was - it trains on under the old plan; the move writes nothing to disk. Not covered: an error
inside DeepSpeed's own engine constructor (it communicates; a rank failing there leaves its peers
waiting until the process group's timeout).
"""
from __future__ import annotations

import copy
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig

from ...config_base import ConfigError
from ...placement.layer_state import ParamState, is_aggregator_key, stages_owning
from ...placement.plan import Layout
from . import internals
from .checkpoint import local_entries, plan_of, rebased_pdv_state, replicas_differ
from .layer_state import apply_global_state, apply_params, global_state, layers_of
from .pdv_state import apply_state
from .runtime import runtime_of
from .topology import MappedTopology, build_stage_layers, link_tied_layers


class MoveError(RuntimeError):
    """A move failed on some rank; raised on every rank, the engine unchanged (the old plan trains on)."""

    def __init__(self, phase: str, failures: Dict[int, str]):
        self.phase, self.failures = phase, dict(failures)
        where = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        super().__init__(f"moving the pipeline failed in phase '{phase}' ({where}); nothing was changed: the engine "
                         "trains on under its old plan")


@dataclass
class MoveReport:
    """What a move did and cost (identical on every rank)."""

    moved: bool
    seconds: float  # wall time of the move, slowest rank
    bytes_moved: int  # bytes sent rank to rank (weights, fp32 masters, optimizer and aggregator state)
    bytes_gathered: int  # bytes of whole tensors reassembled from ZeRO-1 / BF16 partitions (old stages)
    messages: int  # point-to-point messages (one per source/destination pair)
    params_moved: int  # parameter copies that changed rank
    phases: Dict[str, float] = field(default_factory=dict)  # seconds per phase, slowest rank
    old_plan: Dict[str, Any] = field(default_factory=dict)
    new_plan: Dict[str, Any] = field(default_factory=dict)
    step: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------
# Agreement
# ---------------------------------------------------------------------------------------------------
def _gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _agreed(phase: str, fn: Callable[[], Any], hook: Optional[Callable[[str], None]],
            share: Callable[[Any], Any] = lambda result: None) -> Tuple[Any, List[Any]]:
    """Run `fn` (then the test hook) on this rank; one all-gather tells every rank whether all succeeded
    (and carries `share(result)` from each). A failure anywhere raises the same error on every rank."""
    result, error, config_errors = None, None, None
    try:
        result = fn()
        if hook is not None:
            hook(phase)
    except ConfigError as exc:
        config_errors = exc.errors
    except Exception as exc:  # noqa: BLE001 - every rank must learn about any failure
        error = f"{type(exc).__name__}: {exc}"
    seen = _gather({"error": error, "config_errors": config_errors,
                    "shared": share(result) if error is None and config_errors is None else None})
    bad_config = [e for s in seen if s["config_errors"] for e in s["config_errors"]]
    if bad_config:
        raise ConfigError(list(dict.fromkeys(bad_config)))
    failures = {r: s["error"] for r, s in enumerate(seen) if s["error"] is not None}
    if failures:
        raise MoveError(phase, failures)
    return result, [s["shared"] for s in seen]


# ---------------------------------------------------------------------------------------------------
# Check
# ---------------------------------------------------------------------------------------------------
def _checked_plan(engine: Any, boundaries: Sequence[int], rank_mapping: Sequence[Sequence[int]]) -> Dict[str, Any]:
    """The new plan, validated (ConfigError naming the key)."""
    if not getattr(getattr(engine, "pdv_runtime", None), "build", None) or not hasattr(engine, "reduction_grads"):
        raise ConfigError(["engine: move_engine needs a PDVPipelineEngine built by pdv_ext.initialize"])
    n = internals.num_layers(engine.module)
    try:
        parts = [int(b) for b in boundaries]
        rows = [[int(r) for r in row] for row in rank_mapping]
    except (TypeError, ValueError) as exc:
        raise ConfigError([f"boundaries/rank_mapping: integers expected ({exc})"]) from exc
    errors = []
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != n or any(b >= c for b, c in zip(parts, parts[1:])):
        errors.append(f"boundaries: must rise strictly from 0 to the layer count {n} (got {parts})")
    try:
        MappedTopology(rows)
    except ValueError as exc:
        errors.append(f"rank_mapping: {exc}")
    else:
        if sum(len(r) for r in rows) != dist.get_world_size():
            errors.append(f"rank_mapping: places {sum(len(r) for r in rows)} ranks but the job has "
                          f"{dist.get_world_size()}")
        if len(parts) - 1 != len(rows):
            errors.append(f"boundaries: describe {len(parts) - 1} stages but rank_mapping {len(rows)}")
        tbs, mbs = int(engine.train_batch_size()), int(engine.train_micro_batch_size_per_gpu())
        width = int(engine.grid.get_data_parallel_world_size())
        if not internals.gradients_are_micro_batch_means():
            release = f"DeepSpeed {internals.deepspeed_version()}"
            if rows and len(rows[0]) != width:
                errors.append(f"rank_mapping: {width} -> {len(rows[0])} replicas per stage needs DeepSpeed >= 0.19.3: "
                              f"the pipeline engine of {release} sums the micro-batch gradients, so a new width would "
                              "change the gradient's scale")
            if replicas_differ(engine):
                errors.append(f"pdv.aggregation.type: moving replicas that hold different weights "
                              f"('{engine.aggregator.name}') needs DeepSpeed >= 0.19.3 (on {release} the moved "
                              "replicas' Adam step counts did not follow: resume from a checkpoint instead)")
        if rows and tbs % (mbs * len(rows[0])):
            errors.append(f"rank_mapping: {len(rows[0])} replicas per stage cannot keep the global batch {tbs} at "
                          f"micro-batch size {mbs}")
    build = runtime_of(engine).build
    sched = build.get("lr_scheduler")
    if sched is not None and not callable(sched):
        errors.append("lr_scheduler: a scheduler object built on the old optimizer cannot follow a move; pass a "
                      "callable (optimizer -> scheduler) or configure the scheduler in the DeepSpeed config")
    opt = build.get("optimizer")
    if opt is not None and not callable(opt) and not isinstance(opt, torch.optim.Optimizer):
        errors.append(f"optimizer: {type(opt).__name__} cannot be rebuilt for the new stage; pass a torch optimizer, "
                      "a callable (params -> optimizer) or configure it in the DeepSpeed config")
    if errors:
        raise ConfigError(errors)
    return Layout(parts, rows).to_dict()


# ---------------------------------------------------------------------------------------------------
# Transfer
# ---------------------------------------------------------------------------------------------------
def _spec(st: ParamState) -> Dict[str, Any]:
    return {"tensors": [(k, tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in st.tensors().items()],
            "scalars": st.scalars()}


def _pack(tensors: List[torch.Tensor], device: Any) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors])


def _nbytes(shape: Tuple[int, ...], dtype: str) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


@dataclass
class _Route:
    """Where each parameter of this rank's new stage comes from."""

    source: int
    keep_aggregator: bool  # the destination's replica existed before: its own aggregator state comes along


def _routes(module: Any, names: Sequence[str], old: Dict[str, Any], new: Dict[str, Any]
            ) -> Dict[int, Dict[str, _Route]]:
    """rank -> name -> route, for every rank's new stage (the same table on every rank)."""
    old_map, new_map = old["rank_mapping"], new["rank_mapping"]
    dp_old = len(old_map[0])
    out: Dict[int, Dict[str, _Route]] = {}
    for s_new, row in enumerate(new_map):
        lo, hi = new["boundaries"][s_new], new["boundaries"][s_new + 1]
        for d_new, r in enumerate(row):
            d_src = d_new if d_new < dp_old else 0  # replica d keeps its own state; new replicas start from replica 0
            table = out.setdefault(r, {})
            for name in names:
                layers = layers_of(module, name)
                if not any(lo <= l < hi for l in layers):
                    continue
                owners = [old_map[s][d_src] for s in stages_owning(layers, old["boundaries"])]
                table[name] = _Route(r if r in owners else owners[0], d_new < dp_old)
    return out


def _transfer(held: Dict[str, ParamState], specs: List[Dict[str, Any]], routes: Dict[int, Dict[str, _Route]],
              rank: int, device: Any, hook: Optional[Callable[[str], None]]
              ) -> Tuple[Dict[str, ParamState], int, int, int]:
    """Send what others need from `held`, receive what this rank needs; returns (this rank's new states,
    total bytes moved, messages, parameter copies moved) - the totals over all ranks."""
    sends: Dict[int, List[str]] = {}
    recvs: Dict[int, List[str]] = {}
    total_bytes = messages = copies = 0
    for dst, table in sorted(routes.items()):
        per_src: Dict[int, List[str]] = {}
        for name, route in table.items():
            if route.source != dst:
                per_src.setdefault(route.source, []).append(name)
        for src, names in sorted(per_src.items()):
            messages += 1
            copies += len(names)
            for name in names:
                total_bytes += sum(_nbytes(shape, dt) for k, shape, dt in specs[src][name]["tensors"]
                                   if not (is_aggregator_key(k) and not table[name].keep_aggregator))
            if src == rank:
                sends[dst] = names
            if dst == rank:
                recvs[src] = names

    def outgoing(dst: int, name: str) -> ParamState:
        st = held[name]
        return st if routes[dst][name].keep_aggregator else st.without_aggregator()

    def prepare() -> Tuple[Dict[int, torch.Tensor], Dict[int, torch.Tensor]]:
        send_bufs = {dst: _pack([t for n in names for t in outgoing(dst, n).tensors().values()], device)
                     for dst, names in sends.items()}
        recv_bufs = {}
        for src, names in recvs.items():
            size = sum(_nbytes(shape, dt) for n in names for k, shape, dt in specs[src][n]["tensors"]
                       if not (is_aggregator_key(k) and not routes[rank][n].keep_aggregator))
            recv_bufs[src] = torch.empty(size, dtype=torch.uint8, device=device)
        return send_bufs, recv_bufs

    (send_bufs, recv_bufs), _ = _agreed("transfer", prepare, hook)
    ops = [dist.P2POp(dist.isend, buf, dst) for dst, buf in sorted(send_bufs.items())]
    ops += [dist.P2POp(dist.irecv, buf, src) for src, buf in sorted(recv_bufs.items())]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    mine: Dict[str, ParamState] = {}
    for name, route in routes.get(rank, {}).items():
        if route.source == rank:
            mine[name] = held[name] if route.keep_aggregator else held[name].without_aggregator()
    for src, names in recvs.items():
        buf, o = recv_bufs[src], 0
        for name in names:
            keep = routes[rank][name].keep_aggregator
            tensors = {}
            for k, shape, dt in specs[src][name]["tensors"]:
                if is_aggregator_key(k) and not keep:
                    continue
                nb = _nbytes(shape, dt)
                tensors[k] = buf[o:o + nb].view(getattr(torch, dt)).reshape(shape).clone()
                o += nb
            scalars = {k: v for k, v in specs[src][name]["scalars"].items() if keep or not is_aggregator_key(k)}
            mine[name] = ParamState.from_parts(tensors, scalars)
    return mine, total_bytes, messages, copies


# ---------------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------------
def _model_parameters(build: Dict[str, Any], module: Any, states: Dict[str, ParamState]) -> Any:
    """What the new engine's optimizer is built from: the caller's parameter groups, each with the
    parameters of the new stage that were in it (a parameter keeps its group wherever it goes)."""
    group_of = {n: states[n].group for n, _ in module.named_parameters()}
    given = build.get("model_parameters")
    if isinstance(given, (list, tuple)) and given and all(isinstance(g, dict) for g in given):
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [p for n, p in module.named_parameters() if group_of[n] == i]} for i, g in enumerate(given)]
    return [p for n, p in module.named_parameters() if group_of[n] >= 0]


def _optimizer_for(build: Dict[str, Any], params: Any) -> Any:
    """The caller's optimizer argument for the new engine: a torch optimizer instance is rebuilt (same class
    and defaults; the hyper-parameters per group are restored with the rest of the state); a callable or
    None (the DeepSpeed config's optimizer) as given."""
    opt = build.get("optimizer")
    return type(opt)(params, **opt.defaults) if isinstance(opt, torch.optim.Optimizer) else opt


def build_engine(engine: Any, new: Any, replicas: int, params: List[Any], glue: Any = None,
                 built: Optional[List[Any]] = None) -> Any:
    """A new engine of `engine`'s class around the module `new` (its layers built, `replicas` data-parallel
    replicas), made from the arguments `engine` was made from: the one constructor call a move and an in-place
    recovery share. The shares in force follow through the pdv state the caller applies, not the config's.
    `glue` is the policy glue to carry over; the new engine is appended to `built` (a rollback's list) as soon
    as it exists."""
    build_args = runtime_of(engine).build
    cfg = _engine_config(engine, replicas)
    eng = type(engine)(args=build_args["args"], model=new, optimizer=_optimizer_for(build_args, params),
                       model_parameters=params, training_data=build_args["training_data"],
                       lr_scheduler=build_args["lr_scheduler"], mpu=new.mpu(),
                       dist_init_required=build_args["dist_init_required"],
                       collate_fn=build_args["collate_fn"], config=cfg,
                       config_class=DeepSpeedConfig(cfg, new.mpu()),
                       pdv_config=engine.pdv_config.model_copy(update={"data_shares": "equal"}),
                       validation_iter=engine.validation_iter, pdv_glue=glue)
    if built is not None:
        built.append(eng)
    internals.configure_python_gc(eng)
    runtime_of(eng).build = {**build_args, "model_parameters": params}
    return eng


def _engine_config(engine: Any, dp: int) -> Dict[str, Any]:
    cfg = copy.deepcopy(runtime_of(engine).build["config"])
    tbs, mbs = int(engine.train_batch_size()), int(engine.train_micro_batch_size_per_gpu())
    cfg.update({"train_batch_size": tbs, "train_micro_batch_size_per_gpu": mbs,
                "gradient_accumulation_steps": tbs // (mbs * dp)})
    return cfg


# ---------------------------------------------------------------------------------------------------
# The move
# ---------------------------------------------------------------------------------------------------
def move_engine(engine: Any, boundaries: Sequence[int], rank_mapping: Sequence[Sequence[int]], *,
                on_phase: Optional[Callable[[str], None]] = None) -> MoveReport:
    """Move `engine` (a PDVPipelineEngine from pdv_ext.initialize) to `boundaries` (DeepSpeed's `parts`)
    and `rank_mapping` (`[stage][replica] -> global rank`), in place; see the module docstring.

    `on_phase(name)` runs on this rank at the end of each local phase (check, collect, transfer, build,
    engine) before the agreement: a test injects failures there. Raises ConfigError (bad plan, on every
    rank, nothing moved) or MoveError (a rank failed, on every rank, nothing changed)."""
    t0 = time.perf_counter()
    phases: Dict[str, float] = {}
    mark = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        phases[name] = now - mark[0]
        mark[0] = now

    old_plan = plan_of(engine)
    plans = _gather((Layout(boundaries, rank_mapping).to_dict()
                     if boundaries is not None and rank_mapping is not None else None))
    if plans[0] is None:
        raise ConfigError(["move_engine: boundaries and rank_mapping are both required"])
    if any(p != plans[0] for p in plans):
        raise ConfigError([f"move_engine: every rank must ask for the same plan (rank 0: {plans[0]}, others differ)"])
    new_plan, _ = _agreed("check", lambda: _checked_plan(engine, plans[0]["boundaries"], plans[0]["rank_mapping"]),
                          on_phase)
    lap("check")
    if new_plan == old_plan:
        return MoveReport(False, time.perf_counter() - t0, 0, 0, 0, 0, phases, old_plan, new_plan,
                          int(engine.global_steps))
    rng = torch.get_rng_state()  # building layers re-seeds it (seed_layers): the move leaves it as it was
    try:
        move = _Move(engine, old_plan, new_plan, on_phase, lap)
        move.collect()
        move.transfer()
        move.build()
        move.construct()
        move.commit()
    finally:
        torch.set_rng_state(rng)
    timing = _gather({"seconds": time.perf_counter() - t0, "phases": phases})
    return MoveReport(True, max(t["seconds"] for t in timing), move.bytes_moved, move.bytes_gathered, move.messages,
                      move.copies, {k: max(t["phases"].get(k, 0.0) for t in timing) for k in phases}, old_plan,
                      new_plan, int(engine.global_steps))


class _Rollback:
    """What the engine phase changes outside the new objects, and how to put it back: DeepSpeed's pipeline
    globals (building an engine overwrites them), the policy glue's engine references, a half-built
    engine's optimizer. Until `commit`, the user's engine is untouched."""

    def __init__(self, engine: Any):
        self.p2p = internals.p2p_globals()
        self.glue = engine.pdv_policy
        g = self.glue
        self.glue_refs = None if g is None else (g.engine, g.applier, g.monitor.dp_size,
                                                 g.runner.applier if g.runner is not None else None)
        self.built: List[Any] = []

    def undo(self) -> None:
        internals.restore_p2p_globals(self.p2p)
        g = self.glue
        if self.glue_refs is not None:
            g.engine, g.applier, g.monitor.dp_size = self.glue_refs[:3]
            if g.runner is not None:
                g.runner.applier = self.glue_refs[3]
        if self.built and hasattr(self.built[0].optimizer, "destroy"):
            self.built[0].optimizer.destroy()


class _Move:
    """One agreed move, phase by phase (collect, transfer, build, construct, commit): each local phase ends
    in an agreement, so a failure anywhere raises the same MoveError on every rank with nothing changed."""

    def __init__(self, engine: Any, old_plan: Dict[str, Any], new_plan: Dict[str, Any],
                 on_phase: Optional[Callable[[str], None]], lap: Callable[[str], None]):
        self.engine, self.old_plan, self.new_plan, self.on_phase, self.lap = engine, old_plan, new_plan, on_phase, lap
        self.rank = dist.get_rank()
        self.dp_old = len(old_plan["rank_mapping"][0])
        self.first = old_plan["rank_mapping"][0][0]  # fed stage 0's replica 0: its data position is the global one
        self.bytes_moved = self.bytes_gathered = self.messages = self.copies = 0

    def collect(self) -> None:
        """Whole tensors on every old owner; manifests, gathered bytes and the data position."""
        engine = self.engine

        def manifest(result: Any) -> Dict[str, Any]:
            held, _ = result
            gathered = 0
            if self.dp_old > 1 and getattr(engine, "reduce_mode", "engine") in ("bf16", "zero"):  # partitions made whole
                gathered = sum(t.numel() * t.element_size() for s in held.values()
                               for k, t in s.tensors().items() if k == "master" or k.startswith("optim/"))
            data = None
            if self.rank == self.first:
                data = runtime_of(engine).pending_data  # restored by a checkpoint, not yet handed over
                if data is None and hasattr(engine.data_iterator, "state_dict"):
                    data = engine.data_iterator.state_dict()
            return {"specs": {n: _spec(s) for n, s in held.items()}, "gathered": gathered, "data": data}

        (self.held, self.pdv), shared = _agreed("collect", lambda: local_entries(engine), self.on_phase, manifest)
        self.specs = [s["specs"] for s in shared]
        self.bytes_gathered = sum(s["gathered"] for s in shared if s["gathered"]) // max(self.dp_old, 1)
        self.data_state = shared[self.first]["data"]
        self.globals_now = global_state(engine)
        self.lap("collect")

    def transfer(self) -> None:
        module = self.engine.module
        names = sorted({n for sp in self.specs for n in sp}, key=lambda n: (min(layers_of(module, n)), n))
        routes = _routes(module, names, self.old_plan, self.new_plan)
        self.mine, self.bytes_moved, self.messages, self.copies = _transfer(
            self.held, self.specs, routes, self.rank, self.engine.device, self.on_phase)
        del self.held
        self.lap("transfer")

    def build(self) -> None:
        """Groups (collective), then the new stage's layers (local, agreed) on a copy of the module."""
        new = self.new = internals.module_copy(self.engine)
        topo = MappedTopology(self.new_plan["rank_mapping"])
        internals.set_topology(new, topo)
        stage = topo.get_coord(self.rank).pipe

        def layers() -> None:
            build_stage_layers(new, self.new_plan["boundaries"], stage)
            with torch.no_grad():
                for n, t in {**dict(new.named_parameters()), **dict(new.named_buffers())}.items():
                    s = self.mine[n]
                    t.copy_(s.weight if (s.weight.dtype == t.dtype or s.master is None) else s.master)
            new._pdv_placement = Layout.from_dict(self.new_plan).to_dict()

        _agreed("build", layers, self.on_phase)
        self.lap("build")

    def construct(self) -> None:
        """A new PDVPipelineEngine in these processes, its state restored; undone on any failure."""
        engine, new, mine = self.engine, self.new, self.mine
        rollback = _Rollback(engine)

        def make() -> None:
            link_tied_layers(new)
            build_args = runtime_of(engine).build
            params = _model_parameters(build_args, new, mine)
            eng = build_engine(engine, new, len(self.new_plan["rank_mapping"][0]), params, glue=rollback.glue,
                               built=rollback.built)
            apply_params(eng, mine)
            apply_global_state(eng, self.globals_now)
            apply_state(eng, rebased_pdv_state(eng, {**self.pdv, "policy": None, "data": None},
                                               {n: s.aggregator for n, s in mine.items()},
                                               self.globals_now["train_batch_size"]))

        try:
            _agreed("engine", make, self.on_phase)
        except BaseException:
            rollback.undo()
            raise
        self.built, self.glue = rollback.built[0], rollback.glue
        self.lap("engine")

    def commit(self) -> None:
        """The user's engine and module objects take over the new state; the data position and this rank's
        new replica go to the iterator of the next train_batch (DeepSpeed keeps no iterator on middle stages:
        the one this rank will pass is not known here)."""
        engine = self.engine
        it = engine.data_iterator
        internals.swap_engine_state(engine, engine.module, self.built, self.new)
        if self.glue is not None:  # the glue drives the user's object, not the built one: a later move replaces it
            self.glue.rebind(engine)
        ends = engine.is_first_stage() or engine.is_last_stage()
        if ends:
            engine.data_iterator = it
        if self.data_state is None and ends:
            warnings.warn("the data position could not be read (the iterator that fed stage 0's replica 0 has no "
                          "state_dict): the data does not follow the move; use pdv_ext.policy.data.ElasticBatches")
        rt = runtime_of(engine)
        rt.pending_data = self.data_state
        rt.pending_replica = ((engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size())
                              if self.data_state is not None else None)
        self.lap("commit")
