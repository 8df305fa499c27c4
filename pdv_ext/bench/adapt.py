"""`pdv bench adapt --scenario FILE --json`: what adapting to a changing cluster buys, on the emulated cluster.

A scenario file holds a cluster (a path, relative to the file, or inline `devices:`/`links:`), the run's shape
(`run:`: pipeline and data-parallel degrees, model, micro-batches, steps, the adaptive run's policies) and a
timeline of events (`events:`, the schema of `pdv emulate --events`). The shipped scenarios place them by
training step (`at_step: N`: once N timed steps have finished; `at_fraction: F`: that share of `run.steps`),
so every run, on a faster or a slower machine, meets them at the same share of its training; events `at:`
seconds count from the start of training, the first timed step, whatever its start-up took. In one job the same model (same seed, data, global batch and number of samples) is trained three
times on the emulated cluster, each a fresh set of ranks under `pdv emulate` with the same timeline:

- *static*: equal data shares, the start-up plan, no policy: leaving things alone;
- *adaptive*: the scenario's policies (default: `rebalance`, agreeing every 2 steps, the Monitor without the
  noise-scale norms, which `rebalance` does not read);
- *oracle*: the best static data shares for the cluster after the last event, known in hindsight (the split
  `rebalance` would pick for those speeds, from the start); when that is the equal split the oracle is the
  static run (`oracle_is_static`) and is not run twice.

With `repeats` (the scenario's `run.repeats` or `--repeats`) the three alternate that many rounds and each
kind's run of median wall time is reported (all walls in `wall_seconds_runs`). For each run: wall time of the
training steps (to the fixed number of samples), held-out loss at the end, the
samples/s of every phase between events (from the per-step wall times and the events' applied times in the
emulator's log), and for the adaptive run the steps from each event to its first adaptation (in steps and in
policy agreement steps). Ratios `adaptive_vs_static` and `adaptive_vs_oracle` (wall times), and
`after_event_ratio`: the adaptive run's samples/s over the static run's over the steps from the one the first
event hit to the end (each run's own `event_step`), the figure that measures the policy alone. Everything of
the job, per-step series included, goes to `build/bench-adapt/<scenario>.json`; `pdv plot adapt` draws its
samples/s over time with the events marked. Needs root (the emulated cluster); exits 2 with the reason
otherwise.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from pydantic import Field, ValidationError

from ..config_base import ConfigError, StrictModel, format_errors
from ..emulate.hoststat import StealSampler, steal_fraction
from .common import emit, log, median_item, parser, ready_jit_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(ROOT, "build", "bench-adapt")
#: the adaptive run's `pdv.policy` unless the scenario says otherwise: `rebalance` reads the per-rank compute
#: times only, so the Monitor skips the gradient-noise-scale norms (two passes over the gradients)
DEFAULT_POLICY = {"every": 2, "monitor": {"gns": False}, "plugins": [{"name": "rebalance"}]}


class ModelShape(StrictModel):
    """The demo's byte-level GPT (pdv_ext.models.gpt_layers)."""

    layers: int = Field(4, ge=1)
    hidden: int = Field(128, ge=4)
    heads: int = Field(4, ge=1)
    seq_len: int = Field(64, ge=2)


class RunShape(StrictModel):
    """`run:` of a scenario file."""

    pipe: int = Field(1, ge=1)
    data: int = Field(ge=1)
    steps: int = Field(ge=1)
    micro_batch: int = Field(8, ge=1)
    #: micro-batches per replica and step with equal shares (the global batch: micro_batches x data)
    micro_batches: int = Field(4, ge=1)
    model: ModelShape = ModelShape()
    lr: float = Field(2e-3, gt=0)
    seed: int = 1234
    #: held-out windows evaluated at the end
    held_out: int = Field(256, ge=1)
    #: untimed steps before training starts (and the event clock with it): allocator, caches, gloo warm
    warmup_steps: int = Field(2, ge=0)
    #: `pdv.policy` of the adaptive run
    policy: Dict[str, Any] = Field(default_factory=lambda: json.loads(json.dumps(DEFAULT_POLICY)))
    #: seconds each emulated run may take
    timeout: float = Field(1800.0, gt=0)
    #: rounds of the runs, alternating static / adaptive / oracle; each kind's median run is reported
    repeats: int = Field(1, ge=1)
    #: cores all emulated devices share (default: `pdv emulate`'s, 0.55 x the machine's): half of it is the
    #: same cluster on a machine half as fast
    cpu_budget: Optional[float] = Field(None, gt=0)


class Scenario(StrictModel):
    cluster: Any
    run: RunShape
    events: List[Any] = []


def read_scenario(path: str, model: Any, keys: str) -> tuple:
    """(the file validated by `model`, Cluster, the cluster's path): a scenario's YAML read, its `cluster:`
    (a path relative to the file, or a mapping) loaded; ConfigError with one line per problem. `keys` names
    the file's sections for the error on a file that is not a mapping."""
    import yaml

    from ..placement.cluster import Cluster

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping with {keys}"])
    try:
        sc = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([f"{path}: {line}" for line in format_errors(exc, model, "")]) from None
    if isinstance(sc.cluster, str):
        cluster_path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), sc.cluster))
        return sc, Cluster.load(cluster_path), cluster_path
    if isinstance(sc.cluster, dict):
        return sc, Cluster.from_dict(sc.cluster, source=f"{path}: cluster"), path
    raise ConfigError([f"{path}: cluster: a cluster YAML path (relative to the scenario) or a mapping"])


def load_scenario(path: str, faults_ok: bool = False):
    """(Scenario, Cluster, cluster path, EmuSpec, timeline); ConfigError with one line per problem (a fault
    scenario is one unless `faults_ok`: `pdv bench faults` runs those)."""
    from ..emulate.events import load_timeline
    from ..emulate.spec import from_cluster

    sc, cluster, cluster_path = read_scenario(path, Scenario, "cluster:, run: and events:")
    run = sc.run
    if run.pipe * run.data != len(cluster):
        raise ConfigError([f"{path}: run: pipe x data = {run.pipe * run.data} ranks, but the cluster has "
                           f"{len(cluster)} devices (one rank per device)"])
    if run.model.hidden % run.model.heads:
        raise ConfigError([f"{path}: run.model.hidden: {run.model.hidden} is not a multiple of heads "
                           f"({run.model.heads})"])
    from ..config import validate_pdv

    _, errors = validate_pdv({"policy": run.policy}, prefix="run")
    if errors:
        raise ConfigError([f"{path}: {e}" for e in errors])
    spec = from_cluster(cluster)
    events = load_timeline(cluster.spec.events, cluster_path, path, spec, total_steps=run.steps)
    from ..emulate.events import faults

    if faults(events) and not faults_ok:
        raise ConfigError([f"{path}: events: a host or a device goes down: that is a fault scenario, which "
                           "`pdv bench adapt` (slowdowns) does not run; run its events under `pdv emulate` "
                           "(docs/recovery.md)"])
    return sc, cluster, cluster_path, spec, events


# ---------------------------------------------------------------------------------------------------
# what the oracle knows: the devices' speeds after the last event
# ---------------------------------------------------------------------------------------------------
def final_throughputs(cluster, events) -> List[float]:
    """Each device's throughput once every event has happened."""
    from ..emulate.events import DeviceEvent

    speeds = [float(d.throughput) for d in cluster.devices]
    names = [d.name for d in cluster.devices]
    for e in events:
        if isinstance(e, DeviceEvent) and e.throughput is not None:  # a fault changes no speed
            speeds[names.index(e.device)] = float(e.throughput)
    return speeds


def replica_ranks(pipe: int, data: int) -> List[List[int]]:
    """Ranks of each data-parallel replica under DeepSpeed's row-major placement (stage s: ranks s*D..)."""
    return [[s * data + d for s in range(pipe)] for d in range(data)]


def oracle_shares(cluster, events, run: RunShape) -> Optional[List[int]]:
    """The best static split for the cluster after the last event (None: the equal split)."""
    from ..policy.shares import shares_by_throughput

    speeds = final_throughputs(cluster, events)
    thr = [min(speeds[r] for r in ranks) for ranks in replica_ranks(run.pipe, run.data)]
    shares = shares_by_throughput(thr, run.micro_batches * run.data, run.pipe)
    return None if len(set(shares)) == 1 else shares


# ---------------------------------------------------------------------------------------------------
# rank side (python -m pdv_ext.bench.adapt --rank ARGS.json, one process per emulated device)
# ---------------------------------------------------------------------------------------------------
def build_pipeline_engine(run: Any, layers: list, loss_fn: Any, partition: str, pdv: Dict[str, Any],
                          micro_batches: int, lr: float) -> Any:
    """A benchmark's pipeline engine on this rank: gloo, per-layer seeds, Adam at `lr`, the `pdv` section
    given, `micro_batches` of `run.micro_batch` per replica and step (`run` has pipe, data, micro_batch, seed)."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from ..models import seed_layer

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(run.seed)
    model = PipelineModule(layers=layers, num_stages=run.pipe, loss_fn=loss_fn, seed_layers=True,
                           seed_fn=seed_layer, base_seed=run.seed, partition_method=partition)
    cfg = {"train_micro_batch_size_per_gpu": run.micro_batch, "gradient_accumulation_steps": micro_batches,
           "train_batch_size": run.micro_batch * micro_batches * run.data,
           "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
           "steps_per_print": 10 ** 9, "pdv": pdv}
    engine, _, _, _ = pdv_ext.initialize(model=model, config=cfg,
                                         model_parameters=(p for p in model.parameters() if p.requires_grad))
    return engine


def build_gpt_engine(run: Any, pdv: Dict[str, Any], micro_batches: int, lr: float) -> Tuple[Any, Any, Any]:
    """The benchmarks' GPT pipeline on this rank (gloo; Adam; the `pdv` section given) and its training data:
    (engine, the data iterator, the held-out text). `run` has pipe, data, micro_batch, seed and `model`."""
    from ..models import TextWindows, gpt_layers, lm_loss, text_splits
    from ..policy.data import ElasticBatches

    m = run.model
    engine = build_pipeline_engine(run, gpt_layers(m.layers, m.hidden, m.heads, m.seq_len), lm_loss, "parameters",
                                   pdv, micro_batches, lr)
    train_text, held_text = text_splits()
    data = ElasticBatches.for_engine(engine, TextWindows(train_text, m.seq_len), seed=run.seed)
    return engine, data, held_text


def rank_main(args: Dict[str, Any]) -> int:
    import torch.distributed as dist

    from ..emulate.events import mark_start, mark_step
    from ..integrations.deepspeed.topology import current_mapping
    from ..models import ByteWindows

    run = RunShape.model_validate(args["run"])
    m = run.model
    pdv: Dict[str, Any] = {"aggregation": {"type": "mean"}}
    if args.get("placement"):  # pipelines: the start-up plan (cluster + profile), or the oracle's plan file
        pdv["placement"] = args["placement"]
    if args.get("shares"):
        pdv["data_shares"] = list(args["shares"])
    if args.get("policy"):
        pdv["policy"] = args["policy"]
    engine, data, held_text = build_gpt_engine(run, pdv, run.micro_batches, run.lr)
    rank0 = dist.get_rank() == 0
    for _ in range(run.warmup_steps):
        engine.train_batch(data_iter=data)
    dist.barrier()
    if rank0:
        mark_start()  # the events' clock starts with the first timed step
        mark_step(0)  # and the step count of events placed by step (at_step: N applies once N steps finished)
    start = time.time()
    ends, durations, shares, moves, plans = [], [], [], [], []
    runner = engine.pdv_policy.runner if engine.pdv_policy is not None else None
    last = None
    for i in range(run.steps):
        t0 = time.perf_counter()
        engine.train_batch(data_iter=data)
        durations.append(time.perf_counter() - t0)
        ends.append(time.time())
        if rank0:
            mark_step(i + 1)
        shares.append(list(engine.data_shares) if engine.data_shares is not None else None)
        if runner is not None and runner.last_move is not last:  # a Replan moved the pipeline in this step
            last = runner.last_move
            moves.append({"step": i + 1, **{k: last[k] for k in ("seconds", "bytes_moved", "phases", "new_plan")}})
        plan = [list(map(int, engine.module.parts)), current_mapping(engine.module)]
        if not plans or plans[-1][1:] != plan:
            plans.append([i + 1] + plan)
    train_s = time.time() - start
    # held-out loss: the same fixed windows for every run (each replica evaluates them; they agree)
    xs, ys = ByteWindows(held_text, m.seq_len, 1, seed=999).batch(0, run.held_out)
    mbs = run.micro_batch
    batches = [(xs[i:i + mbs], ys[i:i + mbs]) for i in range(0, len(xs) - mbs + 1, mbs)]
    held = float(engine.eval_batch(data_iter=iter(batches), num_micro_batches=len(batches)))
    glue = engine.pdv_policy
    decisions: List[Dict[str, Any]] = []
    predictions: List[Dict[str, Any]] = []
    if glue is not None and glue.runner is not None:
        for step, action in glue.runner.action_log:
            if action.get("action") == "SetDataShares":
                decisions.append({"step": int(step) - run.warmup_steps, "shares": action.get("shares"),
                                  "source": action.get("source")})
            elif action.get("action") == "Replan":
                decisions.append({"step": int(step) - run.warmup_steps, "replan": True,
                                  "boundaries": list(action["boundaries"]),
                                  "rank_mapping": [list(r) for r in action["rank_mapping"]],
                                  "reason": action.get("reason"), "source": action.get("source")})
        for pol in glue.runner.policies:  # what the replan policy predicted for each choice (seconds)
            for d in getattr(pol, "decisions", []):
                if "predicted_before" in d:
                    predictions.append({k: v for k, v in d.items() if k != "throughputs"}
                                       | {"step": int(d["step"]) - run.warmup_steps})
    if rank0:
        out = {"start": start, "ends": ends, "durations": durations, "shares": shares, "train_seconds": train_s,
               "held_out_loss": held, "decisions": decisions, "global_batch": int(engine.train_batch_size()),
               "moves": [dict(m, step=m["step"]) for m in moves], "plans": plans, "predictions": predictions,
               "samples": int(engine.train_batch_size()) * run.steps}
        with open(args["out"], "w", encoding="utf-8") as f:
            json.dump(out, f)
    dist.barrier()
    return 0


# ---------------------------------------------------------------------------------------------------
# parent side: three emulated runs, then the figures
# ---------------------------------------------------------------------------------------------------
def read_events_log(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def phases(result: Dict[str, Any], applied: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Samples/s of each stretch between events (steps are assigned to the stretch they ended in)."""
    bounds = [e["wall"] for e in applied if e.get("applied") and e.get("wall") is not None]
    batch = result["global_batch"]
    out = []
    edges = [-math.inf] + bounds + [math.inf]
    for k in range(len(edges) - 1):
        idx = [i for i, t in enumerate(result["ends"]) if edges[k] <= t < edges[k + 1]]
        secs = sum(result["durations"][i] for i in idx)
        out.append({"after_event": None if k == 0 else k - 1, "steps": len(idx),
                    "first_step": idx[0] + 1 if idx else None,
                    "samples_per_s": (batch * len(idx) / secs) if secs > 0 else None})
    return out


def event_steps(result: Dict[str, Any], applied: List[Dict[str, Any]]) -> List[Optional[int]]:
    """The (1-based) step during which each applied event hit the run (None: after the last step)."""
    out = []
    for e in applied:
        if not e.get("applied") or e.get("wall") is None:
            out.append(None)
            continue
        out.append(next((i + 1 for i, t in enumerate(result["ends"]) if t >= e["wall"]), None))
    return out


def after_event_rate(result: Dict[str, Any], step: Optional[int]) -> Optional[float]:
    """Samples/s over the steps from `step` (1-based: the step the first event hit; for `at_step: N` that is
    step N+1) to the end (None: no event hit the run)."""
    if step is None or step < 1 or step > len(result["durations"]):
        return None
    durations = result["durations"][step - 1:]
    secs = sum(durations)
    return result["global_batch"] * len(durations) / secs if secs > 0 else None


def after_event_ratio(summary: Dict[str, Any]) -> Optional[float]:
    """The adaptive run's samples/s after the first event over the static run's (> 1: the adaptive run is
    faster; each over its own steps from its `event_step`); None without both or without an event."""
    ad, st = (summary.get(k, {}).get("after_event_samples_per_s") for k in ("adaptive", "static"))
    return ad / st if ad and st else None


def adaptation_delays(result: Dict[str, Any], steps_hit: List[Optional[int]], every: int) -> List[Dict[str, Any]]:
    """For each event: the first share change decided at or after the step it hit, and how long after."""
    out = []
    for s in steps_hit:
        first = next((d for d in result["decisions"] if s is not None and d["step"] >= s), None)
        if s is None or first is None:
            out.append({"event_step": s, "adapted_at_step": None, "steps": None, "agreement_steps": None})
            continue
        steps = first["step"] - s + 1
        out.append({"event_step": s, "adapted_at_step": first["step"], "steps": steps,
                    "agreement_steps": math.ceil(steps / every),
                    **({"replan": {"boundaries": first["boundaries"], "rank_mapping": first["rank_mapping"]}}
                       if first.get("replan") else {"shares": first.get("shares")})})
    return out


def _saved(workdir: str) -> Dict[str, Any]:
    """A run's rank-0 record and the emulator's events log, as the run left them in `workdir`."""
    with open(os.path.join(workdir, "rank0.json"), encoding="utf-8") as f:
        result = json.load(f)
    result["events_log"] = read_events_log(os.path.join(workdir, "events.jsonl"))
    host = os.path.join(workdir, "host_cpu.json")
    if os.path.exists(host):  # the host's steal ticks sampled while the run trained (see _run)
        with open(host, encoding="utf-8") as f:
            result["host_cpu"] = json.load(f)
    return result


def _run(kind: str, sc, spec, events, workdir: str, shares: Optional[List[int]], policy: Optional[dict],
         placement: Optional[dict] = None, reuse: bool = False) -> Dict[str, Any]:
    from ..emulate.launcher import Emulation

    if reuse:  # the figures again from what the last job of this scenario measured (nothing is run)
        log(f"adapt: {kind} run: reusing the record in {workdir}")
        return _saved(workdir)
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "rank0.json")
    events_log = os.path.join(workdir, "events.jsonl")
    host = os.path.join(workdir, "host_cpu.json")
    for p in (out, events_log, host):
        if os.path.exists(p):
            os.remove(p)
    args_path = os.path.join(workdir, "args.json")
    with open(args_path, "w", encoding="utf-8") as f:
        json.dump({"run": sc.run.model_dump(), "shares": shares, "policy": policy, "placement": placement,
                   "out": out}, f)
    cmd = [sys.executable, "-m", "pdv_ext.bench.adapt", "--rank", args_path]
    log(f"adapt: {kind} run ({'shares ' + str(shares) if shares else 'equal shares'}"
        f"{', policies ' + json.dumps(policy) if policy else ''}"
        f"{', plan ' + placement['plan'] if placement and placement.get('plan') else ''})")
    emu = Emulation(spec, cmd, timeout=sc.run.timeout, out=sys.stderr.buffer, events=events, events_log=events_log,
                    events_clock="mark", total_steps=sc.run.steps, cpu_budget=sc.run.cpu_budget)
    with StealSampler() as steal:  # what the hypervisor took while it ran: a drift of the emulated speeds
        code = emu.run()
    with open(host, "w", encoding="utf-8") as f:
        json.dump(steal.samples, f)
    if code != 0 or not os.path.exists(out):
        raise RuntimeError(f"the {kind} run failed (exit code {code}); its output is above")
    return _saved(workdir)


def _with_total_steps(policy: Dict[str, Any], total: int) -> Dict[str, Any]:
    """The adaptive run's policy section with `total_steps` filled in for `replan` plugins that lack it (the
    run's length is known here: warm-up plus timed steps)."""
    out = json.loads(json.dumps(policy))
    for p in out.get("plugins", []):
        if p.get("name") == "replan":
            p.setdefault("total_steps", total)
    return out


def pipeline_placement(sc, cluster, workroot: str, keep_profile: bool = False) -> Dict[str, Any]:
    """`pdv.placement` of the static and adaptive pipeline runs: plan at start-up with the `dp` solver for the
    cluster as it starts (events left out), from a layer profile that the first run measures on rank 0's
    device (under its quota) and the others reuse."""
    os.makedirs(workroot, exist_ok=True)
    cpath, ppath = os.path.join(workroot, "cluster.yaml"), os.path.join(workroot, "profile.json")
    with open(cpath, "w", encoding="utf-8") as f:
        yaml_dump(cluster.with_throughputs([d.throughput for d in cluster.devices]).to_dict(), f)
    if os.path.exists(ppath) and not keep_profile:
        os.remove(ppath)  # profiled afresh by this job's first run
    m, run = sc.run.model, sc.run
    return {"cluster": cpath, "profile": ppath, "solver": "dp", "num_stages": run.pipe,
            "micro_batches": run.micro_batches, "input_shape": [run.micro_batch, m.seq_len],
            "input_dtype": "int64", "input_high": 256}


def _budget(cores: Optional[float]) -> float:
    """The cores the emulated devices shared: the scenario's, or `pdv emulate`'s default on this machine."""
    from ..emulate.launcher import default_cpu_budget

    return round(cores if cores is not None else default_cpu_budget(), 3)


def yaml_dump(data: Any, f: Any) -> None:
    import yaml

    yaml.safe_dump(data, f, sort_keys=False)


def oracle_pipeline_plan(sc, cluster, events, placement: Dict[str, Any], workroot: str) -> Dict[str, Any]:
    """The plan the mapper makes for the cluster after the last event (the profile the runs measured, the
    same solver), written where the oracle run reads it; and the start-up plan for comparison."""
    from ..placement.profile import Profile
    from ..placement.solvers import solve

    if not os.path.exists(placement["profile"]):
        raise RuntimeError("the oracle's plan needs the layer profile the static or adaptive run measures first")
    prof = Profile.load(placement["profile"])
    start = solve("dp", prof, cluster.with_throughputs([d.throughput for d in cluster.devices]), sc.run.pipe,
                  sc.run.micro_batches)
    end = solve("dp", prof, cluster.with_throughputs(final_throughputs(cluster, events)), sc.run.pipe,
                sc.run.micro_batches)
    path = os.path.join(workroot, "oracle_plan.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(end.to_dict(), f)
    same = end.boundaries == start.boundaries and end.rank_mapping == start.rank_mapping
    return {"path": path, "boundaries": end.boundaries, "rank_mapping": end.rank_mapping,
            "predicted_step_time": end.predicted_step_time, "same_as_start": same,
            "start": {"boundaries": start.boundaries, "rank_mapping": start.rank_mapping,
                      "predicted_step_time": start.predicted_step_time}}


def replan_figures(result: Dict[str, Any], event_steps: List[Optional[int]], window: int = 8) -> List[Dict[str, Any]]:
    """Per move of the adaptive run: its measured cost (seconds, bytes, in step times), and the step time the
    replan policy predicted before and after it against the median measured on each side. Before: the
    `window` steps up to the move (after the last event before it; the step that moved excluded). After: every
    step the new plan ran (up to the next move or event, or the end): the prediction is for the plan's steady
    step, and on the emulated cluster a few steps drift by 10-20% with no change at all (`measured_step_after_
    first` keeps the median of the first `window` steps after the move, for comparison). `host_steal_before`
    and `_after`: the share of the machine's CPU the hypervisor took during each stretch (None unknown): the
    emulated devices' speeds drift with it."""
    import statistics

    out = []
    dur = result["durations"]
    preds = [p for p in result.get("predictions", []) if p.get("kind") == "replan"]
    changes = sorted({int(m["step"]) for m in result["moves"]} | {e for e in event_steps if e is not None})
    for mv in result["moves"]:
        k = mv["step"]  # 1-based: the step whose end moved the pipeline
        hit = max([e for e in event_steps if e is not None and e <= k] or [1])
        end = min([c for c in changes if c > k] or [len(dur) + 1])  # the next change's step (it ran the old plan)
        span = range(max(hit, k - window) - 1, k - 1) or range(k - 1, k)
        before, after = [dur[i] for i in span], dur[k:end - 1]
        pred = next((p for p in reversed(preds) if p["step"] <= k), None)
        mb, ma = statistics.median(before), (statistics.median(after) if after else None)
        fig = {"step": k, "move_seconds": mv["seconds"], "bytes_moved": mv["bytes_moved"],
               "move_in_steps": mv["seconds"] / mb, "measured_step_before": mb, "measured_step_after": ma,
               "steps_after": len(after),
               "measured_step_after_first": statistics.median(after[:window]) if after else None,
               "new_plan": mv.get("new_plan"),
               "host_steal_before": _steal(result, span), "host_steal_after": _steal(result, range(k, end - 1))}
        if pred is not None:
            fig.update(predicted_step_before=pred["predicted_before"], predicted_step_after=pred["predicted_after"],
                       calibration=pred.get("calib"))
            if ma:
                fig["prediction_error_after"] = abs(pred["predicted_after"] - ma) / ma
        out.append(fig)
    return out


def every_round_errors(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every round's moves, not only the median round's: the post-move step must meet its prediction in each.
    `prediction_errors_after_runs` (per round, per move) and their `max_prediction_error_after`."""
    errors = [[f.get("prediction_error_after") for f in replan_figures(r, event_steps(r, r["events_log"]))]
              if r.get("moves") else [] for r in rounds]
    known = [e for row in errors for e in row if e is not None]
    return {"prediction_errors_after_runs": errors, "max_prediction_error_after": max(known) if known else None}


def _steal(result: Dict[str, Any], steps: range) -> Optional[float]:
    """The hypervisor's share of the machine's CPU while these steps (0-based) ran (None unknown)."""
    host, dur, ends = result.get("host_cpu"), result["durations"], result["ends"]
    return steal_fraction(host, ends[steps[0]] - dur[steps[0]], ends[steps[-1]]) if host and len(steps) else None


def summarize(kind: str, result: Dict[str, Any], every: int) -> Dict[str, Any]:
    applied = [e for e in result["events_log"]]
    hit = event_steps(result, applied)
    s = {"wall_seconds": sum(result["durations"]), "held_out_loss": result["held_out_loss"],
         "samples": result["samples"], "samples_per_s": result["samples"] / sum(result["durations"]),
         "phases": phases(result, applied), "event_steps": hit,
         "host_steal": _steal(result, range(len(result["durations"])))}
    first = next((h for h in hit if h is not None), None)
    s["event_step"] = first  # the (1-based) step the first applied event hit
    s["after_event_samples_per_s"] = after_event_rate(result, first)
    if kind == "adaptive":
        s["adaptations"] = adaptation_delays(result, hit, every)
        s["decisions"] = result["decisions"]
    return s


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank"]:  # one emulated device's process
        with open(argv[1], encoding="utf-8") as f:
            return rank_main(json.load(f))
    ap = parser("adapt", __doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True,
                    help="scenario YAML (`pdv example scenarios DIR` copies the shipped ones; in a checkout: "
                         "launch/scenarios/*.yaml)")
    ap.add_argument("--steps", type=int, default=None, help="override run.steps (e.g. a short smoke run)")
    ap.add_argument("--only", default=None, help="comma-separated subset of static,adaptive,oracle")
    ap.add_argument("--out", default=None, help="where the full result goes (default build/bench-adapt/<name>.json)")
    ap.add_argument("--plot", default=None, help="also draw samples/s over time to this PNG (as `pdv plot adapt`)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="rounds of alternating runs (default: the scenario's run.repeats, 1); medians are reported")
    ap.add_argument("--reuse-runs", action="store_true",
                    help="run nothing: compute the figures again from the runs the last job of this scenario saved "
                         "in build/bench-adapt/<scenario>/ (e.g. after a change to the report)")
    ap.add_argument("--cpu-budget", type=float, default=None,
                    help="override run.cpu_budget: cores all emulated devices share (default 0.55 x the machine's; "
                         "half of it is the same cluster on a machine half as fast)")
    a = ap.parse_args(argv)
    if a.steps is not None and a.steps < 1:
        ap.error(f"--steps must be >= 1 (got {a.steps})")
    if a.cpu_budget is not None and not a.cpu_budget > 0:
        ap.error(f"--cpu-budget must be > 0 cores (got {a.cpu_budget:g})")
    if a.repeats is not None and a.repeats < 1:
        ap.error(f"--repeats must be >= 1 (got {a.repeats})")
    kinds = ["static", "adaptive", "oracle"]
    only = kinds if a.only is None else [k.strip() for k in a.only.split(",") if k.strip()]
    bad = [k for k in only if k not in kinds]
    if bad:
        ap.error(f"--only: unknown run(s) {', '.join(bad)}; choose from {', '.join(kinds)}")
    try:
        sc, cluster, cluster_path, spec, events = load_scenario(a.scenario)
    except (ConfigError, ValueError) as exc:
        for line in getattr(exc, "errors", [str(exc)]):
            print(f"pdv bench adapt: {line}", file=sys.stderr)
        return 2
    if a.cpu_budget is not None:
        sc.run.cpu_budget = a.cpu_budget
    from ..emulate.events import resolve_steps

    if a.steps is not None:
        sc.run.steps = a.steps
        events = resolve_steps(events, sc.run.steps)  # at_fraction: a share of the steps run
    for i, e in enumerate(events):
        if e.at_step is not None and e.at_step >= sc.run.steps:
            log(f"adapt: event {i} ({e.origin}) at step {e.at_step} is not within the run's {sc.run.steps} steps: "
                "it will not happen")
    from ..emulate.launcher import EmulationUnavailable, check_available

    try:
        if not a.reuse_runs:
            check_available()
            ready_jit_ops()  # not inside the first run's start-up
    except EmulationUnavailable as exc:
        print(f"pdv bench adapt: {exc}", file=sys.stderr)
        return 2
    name = os.path.splitext(os.path.basename(a.scenario))[0]
    oracle = oracle_shares(cluster, events, sc.run)
    every = int(sc.run.policy.get("every", 1))
    workroot = os.path.join(ARTIFACTS, name)
    results: Dict[str, Dict[str, Any]] = {}
    placement, oracle_plan = None, None
    policy = _with_total_steps(sc.run.policy, sc.run.warmup_steps + sc.run.steps)
    if sc.run.pipe > 1:  # pipelines: the mapper plans at start-up; the oracle runs its plan for the end state
        placement = pipeline_placement(sc, cluster, workroot, keep_profile=a.reuse_runs)
    repeats = a.repeats or sc.run.repeats
    runs: Dict[str, List[Dict[str, Any]]] = {}
    for rep in range(repeats):  # the kinds alternate, so the machine's drift hits each of them alike
        for kind in kinds:
            if kind not in only:
                continue
            if kind == "oracle" and placement is not None:
                if oracle_plan is None:
                    oracle_plan = oracle_pipeline_plan(sc, cluster, events, placement, workroot)
                if oracle_plan["same_as_start"]:
                    continue
            elif kind == "oracle" and oracle is None:
                continue
            where = {"plan": oracle_plan["path"]} if kind == "oracle" and oracle_plan else placement
            workdir = os.path.join(workroot, kind) if repeats == 1 else os.path.join(workroot, kind, f"run{rep}")
            runs.setdefault(kind, []).append(
                _run(kind, sc, spec, events, workdir, oracle if kind == "oracle" and placement is None else None,
                     policy if kind == "adaptive" else None, where, reuse=a.reuse_runs))
    # each kind's run of median wall time stands for it (its series are plotted); all walls are reported
    walls = {k: [sum(r["durations"]) for r in rs] for k, rs in runs.items()}
    for kind, rs in runs.items():
        results[kind] = median_item(rs, lambda r: sum(r["durations"]))
    if placement is not None:
        oracle = None  # a pipeline's oracle is the mapper's plan, not a data split
    oracle_is_static = (oracle_plan or {}).get("same_as_start", True) if placement is not None else oracle is None
    summary: Dict[str, Any] = {"scenario": name, "events": [e.model_dump() for e in events],
                               "global_batch": sc.run.micro_batch * sc.run.micro_batches * sc.run.data,
                               "steps": sc.run.steps, "oracle_shares": oracle, "oracle_is_static": oracle_is_static,
                               "policy": policy, "cpu_budget": _budget(sc.run.cpu_budget)}
    if oracle_plan is not None:
        summary["oracle_plan"] = {k: oracle_plan[k] for k in ("boundaries", "rank_mapping", "predicted_step_time")}
        summary["start_plan"] = oracle_plan["start"]
    for kind, res in results.items():
        summary[kind] = summarize(kind, res, every)
        if repeats > 1:
            summary[kind]["wall_seconds_runs"] = walls[kind]
    if oracle_is_static and "static" in summary:
        summary["oracle"] = summary["static"]
    if "adaptive" in results and results["adaptive"].get("moves"):
        summary["adaptive"]["replans"] = replan_figures(results["adaptive"], summary["adaptive"]["event_steps"])
    if repeats > 1 and any(r.get("moves") for r in runs.get("adaptive", [])):
        summary["adaptive"].update(every_round_errors(runs["adaptive"]))
    if "adaptive" in summary:
        ad = summary["adaptive"]["wall_seconds"]
        for base in ("static", "oracle"):
            if base in summary:
                summary[f"adaptive_vs_{base}"] = ad / summary[base]["wall_seconds"]
        if "static" in summary:
            summary["after_event_ratio"] = after_event_ratio(summary)
            st = summary["static"]["held_out_loss"]
            summary["held_out_loss_vs_static"] = summary["adaptive"]["held_out_loss"] / st - 1.0
        delays = [d["agreement_steps"] for d in summary["adaptive"].get("adaptations", []) if d["agreement_steps"]]
        summary["max_agreement_steps_to_adapt"] = max(delays) if delays else None
    full = dict(summary, series={k: {kk: v.get(kk) for kk in ("start", "ends", "durations", "shares", "decisions",
                                                              "global_batch", "events_log", "moves", "plans")}
                                 for k, v in results.items()})
    path = a.out or os.path.join(ARTIFACTS, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(full, f, indent=1)
    log(f"adapt: full result in {path}")
    if a.plot:
        from ..plot import plot_adapt

        plot_adapt(path, a.plot)
        log(f"adapt: plot in {a.plot}")
    summary["result_file"] = path
    emit(summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
