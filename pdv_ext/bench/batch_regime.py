"""`pdv bench adaptive --scenario FILE --json`: batch size where it decides speed, on the emulated cluster.

Why (issue #36): the task of `pdv bench adaptive` without a scenario is compute-bound on 2 CPU ranks, so a
bigger batch buys almost no throughput and no batch schedule can beat the best fixed batch there. Batch
adaptation can only pay where the batch decides the speed: a pipeline whose bubble shrinks as the micro-batches
per step grow, or data parallelism whose per-step gradient exchange is a large fixed cost. A batch scenario
runs one such regime on the emulated cluster (`pdv emulate`, root) and measures, first, its *headroom*: how
much faster than the best fixed batch the best hand-written schedule reaches the target loss.

A batch scenario (`launch/scenarios/batch_*.yaml`):

    cluster: ../clusters/emulated_4equal.yaml
    run: {pipe: 2, data: 2, micro_batch: 4, model: {layers: 4, hidden: 64, seq_len: 32}, lr: 2.0e-3}
    batch:
      reference: 1            # micro-batches per replica that run.lr is tuned for
      lr_rule: sqrt           # the LR at b micro-batches: lr x rule(b / reference), also on every change
      schedule_lr_rule: none  # optional: the rule at a schedule's changes instead (none: the start's LR kept)
      fixed: [1, 2, 4, 8, 16] # micro-batches per replica of the fixed runs (global batch: b x micro_batch x data)
      fixed_lr: [0.5, 1, 2]   # optional: LR multipliers each fixed batch runs at; its best one is compared
      schedules: ["1,150:4"]  # hand-written in hindsight: start, then STEP:MICRO_BATCHES after that step
      adaptive: {...}         # optional: `pdv.policy` of an adaptive run starting at the smallest fixed batch
      target_loss: 2.0        # held-out cross-entropy (nats/byte) to reach
      max_samples: 16384      # a run that has not reached it by then did not reach it
      eval_every: 512         # samples between held-out evaluations (not timed)
      repeats: 1              # rounds; each run alternates with the others, medians are reported

`run.task: teacher` (with `run.teacher: {d_in, d_out, hidden, layers, noise}`) trains a deep linear student on
a noisy linear teacher instead of the byte-level GPT: a task with a known noise floor, whose held-out loss
(against the clean targets) is the excess loss. Trained close to that floor, its noise scale grows by orders
of magnitude, the regime where a growing batch can pay (docs/policy.md).

Every run trains the same model from the same seed on the same data order. Its time to the target is training
time only (the steps, and any batch change they apply, summed; the held-out evaluations every `eval_every`
samples are left out), read at the first evaluation at or below the target. Runs that do not reach it are
reported as such (`reached: false`) and never enter a ratio.

JSON: `fixed` and `schedules` (each: micro_batches / schedule, global batch, `reached`, `seconds_to_target`,
`samples_to_target`, `steps_to_target`, `samples_per_s`, `final_loss`, all rounds' seconds), `best_fixed`,
`best_schedule`, `best_lr_per_batch` (with a `fixed_lr` grid), `schedule_vs_best_fixed` (the best schedule's seconds over the best fixed batch's) and
`headroom` (1 - that: under 0.15 the regime is the wrong one for batch adaptation), and with `adaptive`:
`adaptive` and `ratio` (its seconds over the best fixed batch's); a run with a noise scale in its trace
(the adaptive one) has `noise_scale`: its first and last readings and `headroom_bound`, the most any batch
schedule could gain over the best fixed batch with a noise scale that spreads as this one did
(`pdv_ext.policy.gns.adaptation_headroom`). Each run's trace (step, samples, seconds,
held-out loss, micro-batches, the noise scale where a policy's Monitor measures it) goes to
`build/bench-adaptive/<scenario>.json`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import Field, field_validator

from ..config_base import ConfigError, StrictModel
from .adapt import ModelShape
from .common import emit, log, median, parser, ready_jit_ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARTIFACTS = os.path.join(ROOT, "build", "bench-adaptive")


class TeacherShape(StrictModel):
    """`run.teacher:` the noisy linear teacher and its student (`pdv_ext.models.TeacherSamples`,
    `teacher_layers`): y = W x + noise * e with x of `d_in` and y of `d_out` numbers; the student is `layers`
    linear layers of width `hidden`. Its held-out loss is against the clean targets: the excess loss."""

    d_in: int = Field(32, ge=1)
    d_out: int = Field(8, ge=1)
    hidden: int = Field(64, ge=1)
    layers: int = Field(3, ge=2)
    noise: float = Field(1.0, ge=0)
    seed: int = 7


class BatchRun(StrictModel):
    """`run:` of a batch scenario: the job's shape (the batch itself is `batch:`)."""

    pipe: int = Field(1, ge=1)
    data: int = Field(ge=1)
    micro_batch: int = Field(4, ge=1)
    #: `bytes`: the byte-level GPT on CPython's docs (cross-entropy); `teacher`: regression on a noisy linear
    #: teacher, trained close to its noise floor (held-out loss = excess mean squared error)
    task: Literal["bytes", "teacher"] = "bytes"
    model: ModelShape = ModelShape()
    teacher: TeacherShape = TeacherShape()
    #: Adam's LR at `batch.reference` micro-batches per replica
    lr: float = Field(2e-3, gt=0)
    seed: int = 1234
    #: held-out windows of each evaluation (the same fixed windows for every run)
    held_out: int = Field(256, ge=1)
    #: seconds one run may take, start-up included
    timeout: float = Field(1800.0, gt=0)
    #: cores all emulated devices share (default: `pdv emulate`'s share of this machine's)
    cpu_budget: Optional[float] = Field(None, gt=0)


class BatchPlan(StrictModel):
    """`batch:` of a batch scenario: the runs and the target."""

    reference: int = Field(1, ge=1)
    lr_rule: Literal["none", "linear", "sqrt"] = "sqrt"
    #: the LR rule at a schedule's changes (default: `lr_rule`). `none` keeps the start's LR while the batch
    #: grows: with Adam that lowers the noise as a decaying LR would (Seesaw's equivalence), an effect a
    #: fixed batch at a constant LR does not get
    schedule_lr_rule: Optional[Literal["none", "linear", "sqrt"]] = None
    fixed: List[int] = Field(min_length=1)
    #: LR multipliers each fixed batch is run at (on top of `lr_rule`): its best LR from this grid is the one
    #: compared, so a fixed batch is not judged at an LR that suits another batch
    fixed_lr: List[float] = Field([1.0], min_length=1)
    schedules: List[str] = []
    adaptive: Optional[Dict[str, Any]] = None
    target_loss: float = Field(gt=0)
    max_samples: int = Field(ge=1)
    eval_every: int = Field(512, ge=1)
    repeats: int = Field(1, ge=1)

    @field_validator("fixed")
    @classmethod
    def _fixed(cls, v: List[int]) -> List[int]:
        bad = [b for b in v if b < 1]
        if bad:
            raise ValueError(f"micro-batches per replica must be >= 1 (got {bad[0]})")
        if len(set(v)) != len(v):
            raise ValueError(f"each batch once (got {v})")
        return v

    @field_validator("fixed_lr")
    @classmethod
    def _fixed_lr(cls, v: List[float]) -> List[float]:
        bad = [x for x in v if not x > 0]
        if bad:
            raise ValueError(f"LR multipliers must be > 0 (got {bad[0]})")
        if len(set(v)) != len(v):
            raise ValueError(f"each multiplier once (got {v})")
        return v


class BatchScenario(StrictModel):
    cluster: Any
    run: BatchRun
    batch: BatchPlan


def parse_schedule(text: str) -> Tuple[int, List[Tuple[int, int]]]:
    """'1,150:4,400:16' -> (1, [(150, 4), (400, 16)]): start with 1 micro-batch per replica, 4 after step 150,
    16 after step 400. ValueError naming the bad part."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"schedule '{text}': empty (expected START,STEP:MICRO_BATCHES,...)")
    try:
        start = int(parts[0])
    except ValueError:
        raise ValueError(f"schedule '{text}': the start '{parts[0]}' is not a whole number of micro-batches") from None
    if start < 1:
        raise ValueError(f"schedule '{text}': the start must be >= 1 micro-batch (got {start})")
    changes: List[Tuple[int, int]] = []
    for p in parts[1:]:
        step, sep, mb = p.partition(":")
        try:
            s, m = int(step), int(mb)
        except ValueError:
            raise ValueError(f"schedule '{text}': '{p}' is not STEP:MICRO_BATCHES") from None
        if not sep or s < 1 or m < 1:
            raise ValueError(f"schedule '{text}': '{p}' needs a step >= 1 and micro-batches >= 1")
        if changes and s <= changes[-1][0]:
            raise ValueError(f"schedule '{text}': steps must increase ('{p}' after step {changes[-1][0]})")
        changes.append((s, m))
    return start, changes


def lr_factor(rule: str, ratio: float) -> float:
    """The LR multiplier for a batch `ratio` times the reference (the policy runner's rules)."""
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def load(path: str):
    """(BatchScenario, EmuSpec); ConfigError with one line per problem, before anything runs."""
    from ..emulate.spec import from_cluster
    from .adapt import read_scenario

    sc, cluster, _ = read_scenario(path, BatchScenario, "cluster:, run: and batch:")
    errors: List[str] = []
    run, plan = sc.run, sc.batch
    if run.pipe * run.data != len(cluster):
        errors.append(f"{path}: run: pipe x data = {run.pipe * run.data} ranks, but the cluster has {len(cluster)} "
                      "devices (one rank per device)")
    if run.task == "teacher" and run.pipe > run.teacher.layers:
        errors.append(f"{path}: run.pipe: {run.pipe} stages, but run.teacher.layers is {run.teacher.layers} "
                      "(a stage needs a layer)")
    if run.task == "bytes" and run.model.hidden % run.model.heads:
        errors.append(f"{path}: run.model.hidden: {run.model.hidden} is not a multiple of heads ({run.model.heads})")
    for i, text in enumerate(plan.schedules):
        try:
            parse_schedule(text)
        except ValueError as exc:
            errors.append(f"{path}: batch.schedules.{i}: {exc}")
    smallest = min(plan.fixed)
    if plan.max_samples < smallest * run.micro_batch * run.data:
        errors.append(f"{path}: batch.max_samples: {plan.max_samples} is less than one step of the smallest fixed "
                      f"batch ({smallest * run.micro_batch * run.data} samples)")
    if plan.adaptive is not None:
        from ..config import validate_pdv

        _, errs = validate_pdv({"policy": plan.adaptive}, prefix="batch.adaptive")
        errors += [f"{path}: {e}" for e in errs]
    if errors:
        raise ConfigError(errors)
    return sc, from_cluster(cluster)


def runs_of(sc: BatchScenario) -> List[Dict[str, Any]]:
    """Each run of a round: label, starting micro-batches, the schedule's changes and the adaptive policy."""
    plan = sc.batch
    grid = len(plan.fixed_lr) > 1
    out = [{"label": f"fixed-{b}@{x:g}" if grid else f"fixed-{b}", "kind": "fixed", "micro_batches": b,
            "lr_scale": x, "changes": [], "policy": None}
           for b in plan.fixed for x in plan.fixed_lr]
    for text in plan.schedules:
        start, changes = parse_schedule(text)
        out.append({"label": f"schedule-{text}", "kind": "schedule", "schedule": text, "micro_batches": start,
                    "changes": changes, "policy": None})
    if plan.adaptive is not None:
        out.append({"label": "adaptive", "kind": "adaptive", "micro_batches": min(plan.fixed), "changes": [],
                    "policy": plan.adaptive})
    return out


def _policy(spec: Dict[str, Any], rule: str) -> Optional[Dict[str, Any]]:
    """`pdv.policy` of a run: a schedule as the built-in `schedule` policy (agreed every step, so a change lands
    after the step it names), the adaptive run's own section, or none for a fixed batch."""
    if spec["policy"] is not None:
        return spec["policy"]
    if not spec["changes"]:
        return None
    return {"every": 1, "lr_scaling": rule, "monitor": {"gns": False},
            "plugins": [{"name": "schedule",
                         "changes": [{"step": s, "micro_batches": m, "lr_rule": rule} for s, m in spec["changes"]]}]}


# ---------------------------------------------------------------------------------------------------
# rank side (python -m pdv_ext.bench.batch_regime --rank ARGS.json, one process per emulated device)
# ---------------------------------------------------------------------------------------------------
def build_teacher_engine(run: BatchRun, pdv: Dict[str, Any], micro_batches: int, lr: float, max_samples: int):
    """The teacher task's pipeline on this rank (gloo; Adam; mean squared error): (engine, the data iterator,
    the held-out (x, clean y)). Training samples are stream positions 0 .. max_samples (each drawn once, in
    order: they are i.i.d. already); the held-out ones are the `run.held_out` indices after them."""
    import torch

    from ..models import TeacherSamples, mse_loss, teacher_layers
    from ..policy.data import ElasticBatches
    from .adapt import build_pipeline_engine

    t = run.teacher
    engine = build_pipeline_engine(run, teacher_layers(t.d_in, t.d_out, t.hidden, t.layers), mse_loss, "uniform",
                                   pdv, micro_batches, lr)
    size = int(max_samples) + 1024  # a step may pass max_samples by less than a batch
    train = TeacherSamples(t.d_in, t.d_out, t.noise, size, seed=t.seed)
    data = ElasticBatches.for_engine(engine, train, seed=run.seed, shuffle=False)
    held = TeacherSamples(t.d_in, t.d_out, t.noise, size + run.held_out, seed=t.seed, clean=True)
    return engine, data, held.fetch(torch.arange(size, size + run.held_out))


def rank_main(args: Dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    run = BatchRun.model_validate(args["run"])
    pdv: Dict[str, Any] = {"aggregation": {"type": "mean"}}
    if args.get("policy"):
        pdv["policy"] = args["policy"]
    if run.task == "teacher":
        engine, data, (xs, ys) = build_teacher_engine(run, pdv, int(args["micro_batches"]), float(args["lr"]),
                                                      int(args["max_samples"]))
    else:
        from ..models import ByteWindows
        from .adapt import build_gpt_engine

        engine, data, held_text = build_gpt_engine(run, pdv, int(args["micro_batches"]), float(args["lr"]))
        xs, ys = ByteWindows(held_text, run.model.seq_len, 1, seed=999).batch(0, run.held_out)
    mbs = run.micro_batch
    held = [(xs[i:i + mbs], ys[i:i + mbs]) for i in range(0, len(xs) - mbs + 1, mbs)]

    def held_out_loss() -> float:
        loss = torch.tensor([float(engine.eval_batch(data_iter=iter(held), num_micro_batches=len(held)))])
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)  # every rank stops on the same evaluation
        return float(loss.item())

    target, max_samples, every = float(args["target_loss"]), int(args["max_samples"]), int(args["eval_every"])
    samples, seconds, step, next_eval = 0, 0.0, 0, every
    trace: List[List[float]] = []
    reached: Optional[List[float]] = None
    while samples < max_samples:
        batch = int(engine.train_batch_size())  # this step's; a policy may change it as the step ends
        t0 = time.perf_counter()
        engine.train_batch(data_iter=data)
        seconds += time.perf_counter() - t0
        step += 1
        samples += batch
        if samples >= next_eval or samples >= max_samples:
            while next_eval <= samples:
                next_eval += every
            loss = held_out_loss()
            monitor = getattr(engine.pdv_policy, "monitor", None)  # the noise scale, where a policy measures it
            gns = monitor.gns.gns if monitor is not None else None
            trace.append([step, samples, round(seconds, 4), round(loss, 5), batch // (mbs * run.data),
                          None if gns is None else round(float(gns), 2)])
            if loss <= target:
                reached = trace[-1]
                break
    glue = engine.pdv_policy
    decisions = glue.runner.applied("SetBatchSize") if glue is not None and glue.runner is not None else []
    if dist.get_rank() == 0:
        out = {"trace": trace, "reached": reached is not None, "steps": step, "samples": samples,
               "train_seconds": seconds, "final_loss": trace[-1][3] if trace else None, "decisions": decisions,
               "steps_to_target": reached[0] if reached else None,
               "samples_to_target": reached[1] if reached else None,
               "seconds_to_target": reached[2] if reached else None}
        with open(args["out"], "w", encoding="utf-8") as f:
            json.dump(out, f)
    dist.barrier()
    return 0


# ---------------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------------
def _run(sc: BatchScenario, spec, run: Dict[str, Any], workdir: str) -> Dict[str, Any]:
    from ..emulate.launcher import Emulation

    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, "rank0.json")
    if os.path.exists(out):
        os.remove(out)
    plan = sc.batch
    lr = sc.run.lr * lr_factor(plan.lr_rule, run["micro_batches"] / plan.reference) * run.get("lr_scale", 1.0)
    args = {"run": sc.run.model_dump(), "micro_batches": run["micro_batches"], "lr": lr,
            "policy": _policy(run, plan.schedule_lr_rule or plan.lr_rule), "target_loss": plan.target_loss,
            "max_samples": plan.max_samples,
            "eval_every": plan.eval_every, "out": out}
    args_path = os.path.join(workdir, "args.json")
    with open(args_path, "w", encoding="utf-8") as f:
        json.dump(args, f)
    log(f"adaptive: {run['label']} (lr {lr:.3g})")
    emu = Emulation(spec, [sys.executable, "-m", "pdv_ext.bench.batch_regime", "--rank", args_path],
                    timeout=sc.run.timeout, out=sys.stderr.buffer, cpu_budget=sc.run.cpu_budget)
    code = emu.run()
    if code != 0 or not os.path.exists(out):
        raise RuntimeError(f"the {run['label']} run failed (exit code {code}); its output is above")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def summarize(run: Dict[str, Any], rounds: List[Dict[str, Any]], sc: BatchScenario) -> Dict[str, Any]:
    """One run's figures over the rounds: medians where every round reached the target, else `reached: false`."""
    reached = all(r["reached"] for r in rounds)
    out: Dict[str, Any] = {}
    if run["kind"] == "schedule":
        out["schedule"] = run["schedule"]
    else:
        out["micro_batches"] = run["micro_batches"]
        out["global_batch"] = run["micro_batches"] * sc.run.micro_batch * sc.run.data
    if run["kind"] == "fixed":
        out["lr_scale"] = run.get("lr_scale", 1.0)
    out["reached"] = reached
    for key in ("seconds_to_target", "samples_to_target", "steps_to_target"):
        out[key] = round(median([r[key] for r in rounds]), 3) if reached else None
    out["samples_per_s"] = round(median([r["samples"] / r["train_seconds"] for r in rounds if r["train_seconds"]]), 2)
    out["final_loss"] = round(median([r["final_loss"] for r in rounds if r["final_loss"] is not None]), 4)
    out["seconds_runs"] = [r["seconds_to_target"] for r in rounds]
    if not reached:
        out["note"] = (f"did not reach {sc.batch.target_loss} within {sc.batch.max_samples} samples in "
                       f"{sum(not r['reached'] for r in rounds)} of {len(rounds)} rounds")
    if run["kind"] == "adaptive":
        out["decisions"] = rounds[len(rounds) // 2]["decisions"]
    noise = noise_scale_figures(rounds[len(rounds) // 2].get("trace") or [])
    if noise:
        out["noise_scale"] = noise
    return out


def noise_scale_figures(trace: List[List[Any]]) -> Optional[Dict[str, Any]]:
    """From a trace whose rows carry the noise scale (a run with a policy's Monitor): its first and last
    readings and the most any batch schedule could gain over the best fixed batch with a noise scale that
    spreads as this one did (`pdv_ext.policy.gns.adaptation_headroom`: a regime is worth adapting in only if
    that reaches the 15% the issue asks of the headroom)."""
    from ..policy.gns import adaptation_headroom

    rows = [(r[1], r[5]) for r in trace if len(r) > 5]
    pts, prev = [], 0
    for samples, gns in rows:
        if gns is not None and gns > 0:
            pts.append((gns, samples - prev))
        prev = samples
    if not pts:
        return None
    bound = adaptation_headroom([g for g, _ in pts], [w for _, w in pts])
    return {"first": pts[0][0], "last": pts[-1][0], "headroom_bound": round(bound["max_headroom"], 4),
            "knee_samples": round(bound["knee"], 1)}


def figures(sc: BatchScenario, runs: List[Dict[str, Any]], results: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """The JSON report: every run, the best fixed batch, the best schedule, the headroom and the ratio."""
    rows = {r["label"]: summarize(r, results[r["label"]], sc) for r in runs}
    fixed = [rows[r["label"]] for r in runs if r["kind"] == "fixed"]
    scheds = [rows[r["label"]] for r in runs if r["kind"] == "schedule"]
    out: Dict[str, Any] = {"task": sc.run.task, "target_loss": sc.batch.target_loss, "max_samples": sc.batch.max_samples,
                           "lr_rule": sc.batch.lr_rule,
                           "schedule_lr_rule": sc.batch.schedule_lr_rule or sc.batch.lr_rule, "repeats": sc.batch.repeats, "fixed": fixed,
                           "schedules": scheds}
    ok = [f for f in fixed if f["reached"]]
    if not fixed:  # `--only` left the fixed runs out: nothing to compare with
        out["note"] = "no fixed batch was run in this job (--only): no best fixed batch, headroom or ratio"
        if "adaptive" in rows:
            out["adaptive"] = rows["adaptive"]
        return out
    if not ok:
        out["error"] = (f"no fixed batch reached the target loss {sc.batch.target_loss} within "
                        f"{sc.batch.max_samples} samples: raise batch.max_samples or the target")
        return out
    best = min(ok, key=lambda f: f["seconds_to_target"])
    out["best_fixed"] = {"micro_batches": best["micro_batches"], "seconds_to_target": best["seconds_to_target"]}
    if len(sc.batch.fixed_lr) > 1:  # the LR grid: which of its LRs won, and each batch's best
        out["best_fixed"]["lr_scale"] = best["lr_scale"]
        per: Dict[int, Dict[str, Any]] = {}
        for f in ok:
            b = f["micro_batches"]
            if b not in per or f["seconds_to_target"] < per[b]["seconds_to_target"]:
                per[b] = {"lr_scale": f["lr_scale"], "seconds_to_target": f["seconds_to_target"]}
        out["best_lr_per_batch"] = {str(b): per[b] for b in sorted(per)}
    sched_ok = [s for s in scheds if s["reached"]]
    if sched_ok:
        bs = min(sched_ok, key=lambda s: s["seconds_to_target"])
        ratio = bs["seconds_to_target"] / best["seconds_to_target"]
        out["best_schedule"] = {"schedule": bs["schedule"], "seconds_to_target": bs["seconds_to_target"]}
        out["schedule_vs_best_fixed"] = round(ratio, 4)
        out["headroom"] = round(1.0 - ratio, 4)
    if "adaptive" in rows:
        ad = rows["adaptive"]
        out["adaptive"] = ad
        out["ratio"] = round(ad["seconds_to_target"] / best["seconds_to_target"], 4) if ad["reached"] else None
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--rank"]:
        with open(argv[1], encoding="utf-8") as f:
            return rank_main(json.load(f))
    ap = parser("adaptive", __doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True, help="batch scenario YAML (launch/scenarios/batch_*.yaml)")
    ap.add_argument("--repeats", type=int, default=None, help="override batch.repeats (rounds; medians reported)")
    ap.add_argument("--only", action="append", default=None, metavar="LABEL",
                    help="run only these (repeatable; labels fixed-B, schedule-TEXT, adaptive; 'fixed-1,fixed-4' "
                         "names several)")
    ap.add_argument("--cpu-budget", type=float, default=None, help="override run.cpu_budget (cores all devices share)")
    ap.add_argument("--out", default=None, help="where the full result goes (default build/bench-adaptive/<name>.json)")
    a = ap.parse_args(argv)
    if a.repeats is not None and a.repeats < 1:
        ap.error(f"--repeats must be >= 1 (got {a.repeats})")
    if a.cpu_budget is not None and not a.cpu_budget > 0:
        ap.error(f"--cpu-budget must be > 0 cores (got {a.cpu_budget:g})")
    try:
        sc, spec = load(a.scenario)
    except (ConfigError, ValueError) as exc:
        for line in getattr(exc, "errors", [str(exc)]):
            print(f"pdv bench adaptive: {line}", file=sys.stderr)
        return 2
    if a.repeats is not None:
        sc.batch.repeats = a.repeats
    if a.cpu_budget is not None:
        sc.run.cpu_budget = a.cpu_budget
    runs = runs_of(sc)
    if a.only is not None:
        labels = [r["label"] for r in runs]
        want = [k for v in a.only for k in ([v] if v in labels else [x.strip() for x in v.split(",") if x.strip()])]
        bad = [k for k in want if k not in labels]
        if bad:
            ap.error(f"--only: unknown run(s) {', '.join(bad)}; this scenario's: {', '.join(labels)}")
        runs = [r for r in runs if r["label"] in want]
    from ..emulate.launcher import EmulationUnavailable, check_available, default_cpu_budget

    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"pdv bench adaptive: {exc}", file=sys.stderr)
        return 2
    ready_jit_ops()  # not inside the first run's start-up
    name = os.path.splitext(os.path.basename(a.scenario))[0]
    results: Dict[str, List[Dict[str, Any]]] = {r["label"]: [] for r in runs}
    for rnd in range(sc.batch.repeats):
        for r in runs:  # alternating: a drift of the machine's speed falls on every run alike
            workdir = os.path.join(ARTIFACTS, name, f"{r['label'].replace(',', '_').replace(':', '-')}-r{rnd}")
            results[r["label"]].append(_run(sc, spec, r, workdir))
    report = figures(sc, runs, results)
    report["scenario"] = name
    report["cpu_budget"] = round(sc.run.cpu_budget if sc.run.cpu_budget is not None else default_cpu_budget(), 3)
    full = dict(report, traces={k: [x["trace"] for x in v] for k, v in results.items()})
    path = a.out or os.path.join(ARTIFACTS, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(full, f, indent=1)
    log(f"adaptive: the full result (every run's trace) is in {path}")
    emit(report, a.json)
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
