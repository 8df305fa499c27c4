"""`pdv bench adaptive`: time to a target held-out loss, best of three fixed batch sizes vs `gns_batch_size`.

Same model, data and seed for every run, all in one job (the ranks build a fresh PDVPipelineEngine per
run), data-parallel over the ranks (one pipeline stage).

Task (why this one): the byte-level GPT of the demo (pdv_ext.models.gpt_layers: 2 blocks, hidden 64, 4
heads, 32-byte windows) on CPython's `pydoc_data.topics` text, every window of the first 90% as training
data (one epoch is ~420k windows; the runs stay inside it), 1024 fixed windows of the last 10% held out.
It was chosen as the regime the policy is designed for (McCandlish et al. 2018): the gradient noise scale
grows as the loss falls (measured ~5-30 samples at the start, ~150 at 1.40 nats), and the step is
compute-bound (T(B) ~ 8.5 ms + 0.26 ms x B on this 2-core machine, 2 ranks), so a big batch should be
wasted early and needed late. Hand-written schedules (`--schedule`) say otherwise here: starting at 16
and switching to 256 after 150 steps needs as many samples as 256 throughout (2026-11-23: ~100k either
way), so no schedule within [16, 256] tried beat fixed 256 (docs/benchmarks.md). The previous task (an
MLP on digits) reached its target within ~5 epochs, before the noise scale mattered, and over-fitted soon
after (the noise-scale estimate there is mostly undefined).

Runs: fixed global batches B in `--batches` (default 16, 64, 256: the adaptive run's start and maximum
and their geometric middle) with Adam at lr x rule(B / B_min) (`--lr-rule`, default sqrt, the rule
the policy applies on each change); the adaptive run starts at B_min and lets `gns_batch_size` (its
default options, only `max_batch_size` = the largest fixed batch) grow the micro-batch size. Time is
training time only (held-out evaluation every `--eval-every` samples is excluded). `monitor_overhead`:
step time with the Monitor + runner on vs off, same engine, alternating blocks, medians — with metrics
gathered and decisions agreed every `interval` steps as in the adaptive run (`pdv.policy.every`), and
every step (`monitor_overhead_every_step`).

What it shows (docs/benchmarks.md): the noise-scale rule is sample-efficient (the adaptive run reaches
the target with as few samples as fixed 16) but picks batches too small for time (16 -> 26 -> 42 -> 66),
because the measured noise scale under-predicts how well big batches do here (256 needs 1.6x the samples
of 16, the noise scale predicts ~3x): ratio ~1.0, target 0.8 missed. Adam-preconditioned noise scale
(Pollux) was tried and dropped: heavy-tailed (10^4-10^5 within 100 steps, from rarely seen embedding rows).
`--policy goodput`, whose efficiency under this task's sqrt LR rule is the square root of that formula
(`gns.adam_sqrt_efficiency`: fixed 256 needs 1.58x the samples of 16, an efficiency of 0.63, which the square
root gives from noise scales of 100-150), grew 16 -> 32 -> 64 -> 128 with probes of 256 and reached the
target in 0.85x the best fixed batch's time (2026-11-29, medians of 3 rounds; docs/policy.md).

`--schedule 16,150:256` (repeatable) adds a run that follows a fixed batch schedule with the same LR
rule: what a schedule chosen in hindsight achieves, the yardstick for the policy's ratio.

JSON: {"fixed": [{"batch", "seconds_to_target", "steps_to_target", "samples_to_target", "final_loss",
"seconds_rounds"}, ...], "adaptive_seconds_to_target", "adaptive_final_loss", "held_out_vs_best_fixed" (the held-out
loss where the adaptive run stopped over the best fixed run's, less 1), "ratio", "monitor_overhead", "adaptive_steps_to_target", "adaptive_batches"
([step, batch] at each change), "adaptive_samples_to_target", "adaptive_trace" ([step, batch, gns, step ms,
slowest rank's forward + backward ms] every 50 steps), "schedules" ([{"schedule", "seconds_to_target",
"steps_to_target", "samples_to_target", "ratio"}]; empty without --schedule), "target_loss", ...}
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Dict, List, Optional, Tuple

from .common import check_ranges, emit, log, median, median_item, parser


def _config(mbs: int, lr: float, dp: int, plugins: Optional[list], monitor: bool, every: int = 1,
            preconditioned: bool = False) -> dict:
    pol: Dict[str, Any] = {"monitor": {"enabled": monitor, "tensorboard": False,
                                       "gns_preconditioned": preconditioned}, "every": every}
    if plugins:
        pol["plugins"] = plugins
        pol["lr_scaling"] = "sqrt"
    return {"train_batch_size": mbs * dp, "train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
            "steps_per_print": 10 ** 9, "pdv": {"policy": pol}}


def _engine(args: Dict[str, Any], mbs: int, lr: float, plugins: Optional[list] = None, monitor: bool = False,
            every: int = 1):
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from pdv_ext.models import gpt_layers, lm_loss, seed_layer

    torch.manual_seed(args["seed"])
    model = PipelineModule(layers=gpt_layers(args["layers"], args["hidden"], args["heads"], args["seq_len"]),
                           num_stages=1, loss_fn=lm_loss, seed_layers=True, seed_fn=seed_layer,
                           base_seed=args["seed"])
    cfg = _config(mbs, lr, dist.get_world_size(), plugins, monitor, every, args.get("gns_preconditioned", False))
    eng, _, _, _ = pdv_ext.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return eng


def _held_out(eng: Any, x: Any, y: Any) -> float:
    import torch

    from pdv_ext.models import lm_loss

    with torch.no_grad():
        eng.module.eval()
        loss = sum(float(lm_loss(eng.module(xb), yb)) * len(xb) for xb, yb in zip(x.split(256), y.split(256)))
        eng.module.train()
    return loss / len(x)


def _to_target(args: Dict[str, Any], eng: Any, data: Any, xt: Any, yt: Any) -> Dict[str, Any]:
    """Train until the held-out loss reaches the target; training seconds (barrier-synchronised)."""
    import torch.distributed as dist

    train_s, steps, next_eval, loss = 0.0, 0, args["eval_every"], math.inf
    batches: List[List[int]] = []
    while eng.global_samples < args["max_samples"]:
        dist.barrier()
        t = time.perf_counter()
        eng.train_batch(data_iter=data)
        dist.barrier()
        train_s += time.perf_counter() - t
        steps += 1
        if not batches or batches[-1][1] != eng.train_batch_size():
            batches.append([steps, eng.train_batch_size()])  # [first step at that batch - 1, batch]
        if eng.global_samples >= next_eval:
            next_eval += args["eval_every"]
            loss = _held_out(eng, xt, yt)
            if loss <= args["target"]:
                return {"seconds": train_s, "steps": steps, "samples": eng.global_samples, "loss": loss,
                        "batches": batches}
    return {"seconds": None, "steps": None, "samples": eng.global_samples, "loss": loss, "batches": batches}


def _overhead(args: Dict[str, Any], eng: Any, data: Any, block: int) -> Dict[str, float]:
    """Step-time increase with the policy layer on vs off on one engine: adjacent off/on blocks of
    `block` steps (aligned with the agreement windows), the median over pairs of mean(on)/mean(off) - 1
    (paired, so the machine's load drift cancels). Wall time (the contract) and this process's CPU time
    (robust when the machine is oversubscribed, where wall time mostly measures waiting for a core)."""
    import torch.distributed as dist

    from ..integrations.deepspeed.internals import instance_instructions, set_instance_instructions

    glue = eng.pdv_policy
    hooks = list(eng.grad_hooks)
    imap = instance_instructions(eng)
    while eng.global_steps % block:  # start at a window boundary
        eng.train_batch(data_iter=data)
    wall: List[float] = []
    cpu: List[float] = []
    for pair in range(args["overhead_blocks"]):
        means = {}
        for on in ((False, True) if pair % 2 == 0 else (True, False)):
            eng.pdv_policy = glue if on else None
            eng.grad_hooks[:] = hooks if on else [h for h in hooks if h.__class__.__name__ != "_MonitorHook"]
            set_instance_instructions(eng, imap if on else None)
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(block):
                eng.train_batch(data_iter=data)
            means[on] = ((time.perf_counter() - t) / block, (time.process_time() - c) / block)
        wall.append(means[True][0] / means[False][0])
        cpu.append(means[True][1] / means[False][1])
    eng.pdv_policy = glue
    set_instance_instructions(eng, imap)
    eng.grad_hooks[:] = hooks
    return {"wall": median(wall) - 1.0, "cpu": median(cpu) - 1.0}


def rank_main(**args: Any) -> Dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    from pdv_ext.models import ByteWindows, TextWindows, text_splits
    from pdv_ext.policy.data import ElasticBatches
    from pdv_ext.policy.gns import lr_factor

    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size()
    train_text, held_text = text_splits()
    train = TextWindows(train_text, args["seq_len"])  # every window; the runs stay in epoch 0
    xt, yt = ByteWindows(held_text, args["seq_len"], 1, seed=999).batch(0, args["held_out"])  # fixed windows
    b0 = args["batches"][0]
    out: Dict[str, Any] = {"fixed": []}

    def data_for(eng: Any) -> ElasticBatches:
        return ElasticBatches.for_engine(eng, train, seed=args["seed"])

    warm = _engine(args, b0 // dp, args["lr"])  # process-level warm-up (allocator, gloo), not timed
    warm_data = data_for(warm)
    for _ in range(5):
        warm.train_batch(data_iter=warm_data)
    del warm
    runs: List[Any] = [("fixed", b) for b in args["batches"]]
    runs.insert(1, ("adaptive", b0))  # interleave: contention drifts over the run
    runs += [("schedule", sch) for sch in args.get("schedules", [])]
    if args.get("overhead_only"):
        runs = []
    if args.get("only"):  # e.g. "adaptive" or "16,adaptive": a subset of the runs (no ratio without the fixed ones)
        keep = args["only"].split(",")
        runs = [r for r in runs if r[0] == "schedule" or (r[0] if r[0] == "adaptive" else str(r[1])) in keep]
    out["schedules"] = []
    out["adaptive_rounds"] = []
    for rnd, (kind, batch) in ((r, run) for r in range(int(args.get("repeats", 1))) for run in runs):
        sched = None
        if kind == "schedule":  # [(first step, global batch), ...]: the same rule applied at fixed steps
            sched, batch = batch, batch[0][1]
        lr = args["lr"] * lr_factor(args["lr_rule"], b0, batch)  # the adaptive run's rule, from (b0, lr)
        if kind == "fixed":
            eng = _engine(args, batch // dp, lr)
        elif kind == "schedule":
            changes = [{"step": step, "micro_batch_size": b // dp, "lr_rule": args["lr_rule"]} for step, b in sched[1:]]
            eng = _engine(args, batch // dp, lr, [{"name": "schedule", "changes": changes}], monitor=False,
                          every=args["interval"])
        else:  # the policy's defaults, but for the limits of this run
            name = args.get("policy_name", "gns_batch_size")
            bounds = {"min_batch_size": args["batches"][0]} if name == "goodput" else {}
            plugins = [{"name": name, "max_batch_size": args["batches"][-1], "grow": "micro_batch_size",
                        "lr_rule": args["lr_rule"], **bounds, **args["policy"]}]
            eng = _engine(args, batch // dp, lr, plugins, monitor=True, every=args["interval"])
        res = _to_target(args, eng, data_for(eng), xt, yt)
        if dist.get_rank() == 0:
            log(f"{kind} B={batch}" + (f", round {rnd + 1}" if args.get("repeats", 1) > 1 else "") +
                f": {json.dumps(res)}")
        if kind == "fixed":
            out["fixed"].append({"batch": batch, "seconds_to_target": res["seconds"], "steps_to_target": res["steps"],
                                 "samples_to_target": res["samples"], "final_loss": res["loss"], "round": rnd})
        elif kind == "schedule":
            out["schedules"].append({"schedule": [list(x) for x in sched], "seconds_to_target": res["seconds"],
                                     "steps_to_target": res["steps"], "samples_to_target": res["samples"],
                                     "round": rnd})
        else:
            runner = eng.pdv_policy.runner
            rows = eng.pdv_policy.monitor.rows
            gns = [r.get("gns") for r in rows if r.get("gns") is not None]
            out["adaptive_rounds"].append({
                "round": rnd, "adaptive_seconds_to_target": res["seconds"], "adaptive_steps_to_target": res["steps"],
                "adaptive_batches": res["batches"], "adaptive_samples_to_target": res["samples"],
                "adaptive_final_loss": res["loss"],
                # each decision with its reason (the throughputs, efficiencies or plateau that decided it)
                "adaptive_decisions": runner.applied("SetBatchSize") if runner is not None else [],
                "adaptive_gns_first_last": [gns[0], gns[-1]] if gns else None,
                # (step, batch, gns, step time in ms) every 50 steps: what the policy saw
                "adaptive_trace": [[r["step"], r["batch_size"], round(r["gns"]), round(1000 * r["step_time"], 1),
                                    round(1000 * r["compute_max"], 1)]
                                   for r in rows if r.get("gns") is not None and r["step"] % 50 == 0]})
        if eng.pdv_policy is not None:
            eng.pdv_policy.close()
        del eng
    # monitor overhead at the middle batch, with the policy layer as the adaptive run has it (Monitor,
    # runner, gns_batch_size unable to act: max batch = current batch), agreeing every `interval` steps
    # (`monitor_overhead`) and every step (`monitor_overhead_every_step`)
    if args.get("only"):
        return out
    bm = args["batches"][1]
    plugins = [{"name": "gns_batch_size", "max_batch_size": bm, "warmup_steps": 0, "interval": args["interval"]}]
    oh_lr = args["lr"] * lr_factor(args["lr_rule"], b0, bm)
    for key, every in (("monitor_overhead", args["interval"]), ("monitor_overhead_every_step", 1)):
        eng = _engine(args, bm // dp, oh_lr, plugins, monitor=True, every=every)
        data = data_for(eng)
        for _ in range(5):  # warm up
            eng.train_batch(data_iter=data)
        oh = _overhead(args, eng, data, max(every, args["overhead_steps"] // every * every))
        out[key], out[key + "_cpu"] = oh["wall"], oh["cpu"]
        if dist.get_rank() == 0:
            log(f"{key}: wall {oh['wall']:+.3f} cpu {oh['cpu']:+.3f}")
        del eng
    return out


def combine_rounds(res: Dict[str, Any]) -> Dict[str, Any]:
    """The ranks' per-round runs as one result: each fixed batch (and schedule) its median seconds over the
    rounds (None when any round did not reach the target: never a median of runs that did not) with every
    round's under `seconds_rounds`; the adaptive run's figures from its median round (the lower median of an
    even count), its seconds the median, every round's under `adaptive_seconds_rounds`."""
    def med(xs: List[Optional[float]]) -> Optional[float]:
        return None if not xs or any(x is None for x in xs) else median(xs)

    out = dict(res)
    for key, ident in (("fixed", "batch"), ("schedules", "schedule")):
        groups: Dict[str, List[Dict[str, Any]]] = {}
        for row in res.get(key, []):
            groups.setdefault(json.dumps(row[ident]), []).append(row)
        out[key] = []
        for rows in groups.values():
            secs = [r["seconds_to_target"] for r in rows]
            mid = median_item(rows, lambda r: r["seconds_to_target"])
            out[key].append({**{k: v for k, v in mid.items() if k != "round"}, "seconds_to_target": med(secs),
                             "seconds_rounds": secs})
    rounds = res.get("adaptive_rounds") or []
    if rounds:
        secs = [r["adaptive_seconds_to_target"] for r in rounds]
        mid = median_item(rounds, lambda r: r["adaptive_seconds_to_target"])
        out.update({k: v for k, v in mid.items() if k != "round"})
        out["adaptive_seconds_to_target"] = med(secs)
        out["adaptive_seconds_rounds"] = secs
    out.pop("adaptive_rounds", None)
    return out


def parse_schedule(text: str, ranks: int) -> List[Tuple[int, int]]:
    """'16,150:256' -> [(0, 16), (150, 256)]: (first step after which the batch applies, global batch)."""
    try:
        first, *rest = text.split(",")
        sch = [(0, int(first))]
        for part in rest:
            step, batch = part.split(":")
            sch.append((int(step), int(batch)))
    except ValueError:
        raise ValueError(f"--schedule {text!r}: expected B0,STEP:B1,... (e.g. 16,150:256)") from None
    if any(b <= 0 or b % ranks for _, b in sch):
        raise ValueError(f"--schedule {text!r}: every batch must be a positive multiple of --ranks ({ranks})")
    if any(s2 <= s1 for (s1, _), (s2, _) in zip(sch, sch[1:])):
        raise ValueError(f"--schedule {text!r}: the steps must increase")
    return sch


def parse_policy_options(policy: str, items: List[str]) -> Dict[str, Any]:
    """['plateau_steps=20'] -> {'plateau_steps': 20}, checked against the policy's options before any rank starts
    (the bench sets the batch bounds, geometry and LR rule itself)."""
    import yaml
    from pydantic import ValidationError

    from ..config_base import format_errors
    from ..policy.base import POLICIES  # the package's import registered the built-ins

    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--policy-option {item!r}: expected KEY=VALUE (e.g. plateau_steps=20)")
        out[key.strip()] = yaml.safe_load(value)
    reserved = sorted(set(out) & {"name", "max_batch_size", "min_batch_size", "grow", "lr_rule"})
    if reserved:
        raise ValueError(f"--policy-option {reserved[0]}: set by the bench (the fixed batches and --lr-rule)")
    cls = POLICIES.get(policy)
    try:
        cls.Options(**out)
    except ValidationError as exc:  # one line naming the key
        raise ValueError("; ".join(format_errors(exc, cls.Options, f"--policy-option {policy}"))) from None
    return out


def main(argv: Optional[List[str]] = None) -> int:
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if any(x == "--scenario" or x.startswith("--scenario=") for x in args) or args[:1] == ["--rank"]:
        from .batch_regime import main as regime  # a regime on the emulated cluster (batch_regime.py)

        return regime(args)
    ap = parser("adaptive", __doc__ + "\nWith --scenario FILE: a batch regime on the emulated cluster "
                "(pdv_ext/bench/batch_regime.py; `pdv bench adaptive --scenario FILE --help`).")
    ap.add_argument("--quick", action="store_true", help="small budget (smoke test)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs=3, default=[16, 64, 256], help="fixed global batch sizes")
    ap.add_argument("--target", type=float, default=1.40, help="held-out cross-entropy (nats/byte) to reach")
    ap.add_argument("--lr", type=float, default=2e-3, help="Adam LR at the smallest batch")
    ap.add_argument("--lr-rule", default="sqrt", choices=["none", "linear", "sqrt"],
                    help="LR of batch B: lr x rule(B / smallest batch), for the fixed runs and the policy's changes")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--held-out", type=int, default=1024, help="held-out windows (fixed) of the evaluation")
    ap.add_argument("--eval-every", type=int, default=2048, help="samples between held-out evaluations")
    ap.add_argument("--max-samples", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--overhead-only", action="store_true", help="only measure the monitor overhead")
    ap.add_argument("--only", default="", help="comma-separated subset of the runs, e.g. 'adaptive' or '64,adaptive'")
    ap.add_argument("--policy", default="gns_batch_size", choices=["gns_batch_size", "goodput"],
                    help="the batch policy of the adaptive run (its defaults, bounded by the fixed batches)")
    ap.add_argument("--gns-preconditioned", action="store_true",
                    help="the adaptive run's noise scale of Adam-preconditioned gradients (monitor.gns_preconditioned)")
    ap.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the adaptive run's policy, VALUE as YAML (repeatable), e.g. plateau_steps=20")
    ap.add_argument("--schedule", action="append", default=[], metavar="B0,STEP:B1,...",
                    help="also run a hand-written batch schedule, e.g. '16,150:256' (16, then 256 after step 150; "
                         "LR by --lr-rule at each change): what a schedule chosen in hindsight achieves (repeatable)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of every run (fixed batches, adaptive, schedules, interleaved as in one round); "
                         "each reports the median of its rounds, every round beside it")
    a = ap.parse_args(argv)
    # before any rank starts: --ranks 0 divides by zero below, --batches 0 would start training
    check_ranges(ap, a, {"--repeats": 1, "--ranks": 1, "--hidden": 1, "--layers": 1, "--heads": 1, "--seq-len": 1, "--held-out": 1,
                         "--eval-every": 1, "--max-samples": 1}, ["--target", "--lr", "--timeout"])
    if a.hidden % a.heads:
        ap.error(f"--hidden ({a.hidden}) must be a multiple of --heads ({a.heads})")
    if any(b <= 0 or b % a.ranks for b in a.batches):  # each rank gets batch / ranks samples per step
        ap.error(f"--batches must be positive multiples of --ranks ({a.ranks}) (got {' '.join(map(str, a.batches))})")
    runs = ["adaptive"] + [str(b) for b in sorted(a.batches)]
    for run in filter(None, a.only.split(",")):
        if run not in runs:
            ap.error(f"--only: unknown run '{run}'; known: {', '.join(runs)}")
    try:
        schedules = [parse_schedule(text, a.ranks) for text in a.schedule]
        options = parse_policy_options(a.policy, a.policy_option)
    except ValueError as exc:
        ap.error(str(exc))
    args = {"batches": sorted(a.batches), "target": a.target, "lr": a.lr, "lr_rule": a.lr_rule, "hidden": a.hidden,
            "layers": a.layers, "heads": a.heads, "seq_len": a.seq_len, "held_out": a.held_out,
            "eval_every": a.eval_every, "max_samples": a.max_samples, "seed": a.seed,
            "policy": options,  # the policy's defaults (interval 10, warmup 20, ...) but for --policy-option
            "policy_name": a.policy, "gns_preconditioned": a.gns_preconditioned,
            "interval": 10, "overhead_blocks": 12, "overhead_steps": 10, "overhead_only": a.overhead_only,
            "only": a.only, "schedules": schedules, "repeats": a.repeats}
    if a.quick:
        args.update(target=max(a.target, 2.2), max_samples=16_384, held_out=256, overhead_blocks=2, overhead_steps=5,
                    interval=5, policy={"interval": 5, "warmup_steps": 5, **options})
    from ..spawn import run_ranks

    log(f"pdv bench adaptive: {a.ranks} ranks, batches {args['batches']}, target held-out loss {args['target']}")
    res = run_ranks("pdv_ext.bench.adaptive:rank_main", a.ranks, args, timeout=a.timeout)[0]
    res = combine_rounds(res)
    if a.only:
        emit(res, a.json)
        return 0
    best = min((f for f in res["fixed"] if f["seconds_to_target"] is not None),
               key=lambda f: f["seconds_to_target"], default=None)
    ada = res.get("adaptive_seconds_to_target")
    ada_loss = res.get("adaptive_final_loss")
    result = {"fixed": [{k: f[k] for k in ("batch", "seconds_to_target", "steps_to_target", "samples_to_target",
                                           "seconds_rounds", "final_loss")} for f in res["fixed"]],
              "adaptive_seconds_to_target": ada,
              "adaptive_final_loss": ada_loss,
              # the held-out loss where each stopped (the first evaluation at or under the target)
              "held_out_vs_best_fixed": (ada_loss / best["final_loss"] - 1.0) if (best and ada and ada_loss) else None,
              "adaptive_seconds_rounds": res.get("adaptive_seconds_rounds"),
              "ratio": (ada / best["seconds_to_target"]) if (best and ada) else None,
              "ratio_rounds": [(r / best["seconds_to_target"]) if (best and r) else None
                               for r in res.get("adaptive_seconds_rounds", [])],
              "repeats": a.repeats,
              "monitor_overhead": res["monitor_overhead"],
              "monitor_overhead_cpu": res["monitor_overhead_cpu"],
              "monitor_overhead_every_step": res["monitor_overhead_every_step"],
              "monitor_overhead_every_step_cpu": res["monitor_overhead_every_step_cpu"],
              "adaptive_steps_to_target": res.get("adaptive_steps_to_target"),
              "adaptive_batches": res.get("adaptive_batches"),
              "adaptive_samples_to_target": res.get("adaptive_samples_to_target"),
              "adaptive_gns_first_last": res.get("adaptive_gns_first_last"),
              "adaptive_trace": res.get("adaptive_trace"),
              "adaptive_decisions": res.get("adaptive_decisions"),
              "best_fixed_batch": best["batch"] if best else None,
              "schedules": [{**x, "ratio": (x["seconds_to_target"] / best["seconds_to_target"])
                             if (best and x["seconds_to_target"]) else None} for x in res.get("schedules", [])],
              "target_loss": args["target"], "ranks": a.ranks, "policy": a.policy}
    emit(result, a.json)
    return 0
