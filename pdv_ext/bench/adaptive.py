"""`pdv bench adaptive`: time to a target held-out loss, best of three fixed batch sizes vs `gns_batch_size`.

Same model, data and seed for every run, all in one job (the ranks build a fresh PDVPipelineEngine per
run): an MLP classifier on scikit-learn's digits, data-parallel over the ranks. Fixed runs use global
batches B in `--batches` with the LR scaled from (B0, lr) by the sqrt rule (Adam); the adaptive run starts
at B0 and lets `gns_batch_size` grow the micro-batch size (the same sqrt rule on each change). Time is
training time only (held-out evaluation every `--eval-every` samples is excluded). `monitor_overhead`:
step time with the Monitor + runner on vs off, same engine, alternating blocks, medians — with metrics
gathered and decisions agreed every `interval` steps as in the adaptive run (`pdv.policy.every`), and
every step (`monitor_overhead_every_step`).

JSON: {"fixed": [{"batch", "seconds_to_target", "steps_to_target"}, ...], "adaptive_seconds_to_target",
"adaptive_steps_to_target", "adaptive_batches", "ratio", "monitor_overhead", "target_loss", ...}
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Dict, List, Optional

from .common import emit, log, median, parser


def _config(mbs: int, lr: float, dp: int, plugins: Optional[list], monitor: bool, every: int = 1) -> dict:
    pol: Dict[str, Any] = {"monitor": {"enabled": monitor, "tensorboard": False}, "every": every}
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
    from pdv_ext.models import mlp_layers, seed_layer

    torch.manual_seed(args["seed"])
    model = PipelineModule(layers=mlp_layers(args["layers"], args["hidden"], 64, 10), num_stages=1,
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True, seed_fn=seed_layer,
                           base_seed=args["seed"])
    cfg = _config(mbs, lr, dist.get_world_size(), plugins, monitor, every)
    eng, _, _, _ = pdv_ext.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    return eng


def _held_out(eng: Any, x: Any, y: Any) -> float:
    import torch

    with torch.no_grad():
        eng.module.eval()
        loss = float(torch.nn.functional.cross_entropy(eng.module(x), y))
        eng.module.train()
    return loss


def _to_target(args: Dict[str, Any], eng: Any, data: Any, xt: Any, yt: Any) -> Dict[str, Any]:
    """Train until the held-out loss reaches the target; training seconds (barrier-synchronised)."""
    import torch.distributed as dist

    train_s, steps, next_eval, loss = 0.0, 0, args["eval_every"], math.inf
    batches: List[int] = []
    while eng.global_samples < args["max_samples"]:
        dist.barrier()
        t = time.perf_counter()
        eng.train_batch(data_iter=data)
        dist.barrier()
        train_s += time.perf_counter() - t
        steps += 1
        if not batches or batches[-1] != eng.train_batch_size():
            batches.append(eng.train_batch_size())
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

    glue = eng.pdv_policy
    hooks = list(eng.grad_hooks)
    imap = eng.__dict__.get("_INSTRUCTION_MAP")
    while eng.global_steps % block:  # start at a window boundary
        eng.train_batch(data_iter=data)
    wall: List[float] = []
    cpu: List[float] = []
    for pair in range(args["overhead_blocks"]):
        means = {}
        for on in ((False, True) if pair % 2 == 0 else (True, False)):
            eng.pdv_policy = glue if on else None
            eng.grad_hooks[:] = hooks if on else [h for h in hooks if h.__class__.__name__ != "_MonitorHook"]
            if on:
                eng._INSTRUCTION_MAP = imap
            else:
                eng.__dict__.pop("_INSTRUCTION_MAP", None)
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(block):
                eng.train_batch(data_iter=data)
            means[on] = ((time.perf_counter() - t) / block, (time.process_time() - c) / block)
        wall.append(means[True][0] / means[False][0])
        cpu.append(means[True][1] / means[False][1])
    eng.pdv_policy, eng._INSTRUCTION_MAP = glue, imap
    eng.grad_hooks[:] = hooks
    return {"wall": median(wall) - 1.0, "cpu": median(cpu) - 1.0}


def rank_main(**args: Any) -> Dict[str, Any]:
    import deepspeed
    import torch
    import torch.distributed as dist

    from pdv_ext.models import digits_data
    from pdv_ext.policy.data import ElasticBatches

    deepspeed.init_distributed(dist_backend="gloo")
    dp = dist.get_world_size()
    x, y, xt, yt = digits_data(seed=args["seed"])
    b0 = args["batches"][0]
    out: Dict[str, Any] = {"fixed": []}

    def data_for(eng: Any) -> ElasticBatches:
        return ElasticBatches.for_engine(eng, (x, y), seed=args["seed"])

    warm = _engine(args, b0 // dp, args["lr"])  # process-level warm-up (allocator, gloo), not timed
    warm_data = data_for(warm)
    for _ in range(5):
        warm.train_batch(data_iter=warm_data)
    del warm
    runs = [("fixed", b) for b in args["batches"]]
    runs.insert(1, ("adaptive", b0))  # interleave: contention drifts over the run
    if args.get("overhead_only"):
        runs = []
    for kind, batch in runs:
        lr = args["lr"] * math.sqrt(batch / b0)
        if kind == "fixed":
            eng = _engine(args, batch // dp, lr)
        else:
            plugins = [{"name": "gns_batch_size", "max_batch_size": args["batches"][-1], "grow": "micro_batch_size",
                        "interval": args["interval"], "warmup_steps": args["warmup"], "lr_rule": "sqrt"}]
            eng = _engine(args, batch // dp, lr, plugins, monitor=True, every=args["interval"])
        res = _to_target(args, eng, data_for(eng), xt, yt)
        if dist.get_rank() == 0:
            log(f"{kind} B={batch}: {json.dumps(res)}")
        if kind == "fixed":
            out["fixed"].append({"batch": batch, "seconds_to_target": res["seconds"], "steps_to_target": res["steps"],
                                 "final_loss": res["loss"]})
        else:
            out["adaptive_seconds_to_target"] = res["seconds"]
            out["adaptive_steps_to_target"] = res["steps"]
            out["adaptive_batches"] = res["batches"]
            gns = [r.get("gns") for r in eng.pdv_policy.monitor.rows if r.get("gns") is not None]
            out["adaptive_gns_first_last"] = [gns[0], gns[-1]] if gns else None
        if eng.pdv_policy is not None:
            eng.pdv_policy.close()
        del eng
    # monitor overhead at the middle batch, with the policy layer as the adaptive run has it (Monitor,
    # runner, gns_batch_size unable to act: max batch = current batch), agreeing every `interval` steps
    # (`monitor_overhead`) and every step (`monitor_overhead_every_step`)
    bm = args["batches"][1]
    plugins = [{"name": "gns_batch_size", "max_batch_size": bm, "warmup_steps": 0, "interval": args["interval"]}]
    for key, every in (("monitor_overhead", args["interval"]), ("monitor_overhead_every_step", 1)):
        eng = _engine(args, bm // dp, args["lr"], plugins, monitor=True, every=every)
        data = data_for(eng)
        for _ in range(5):  # warm up
            eng.train_batch(data_iter=data)
        oh = _overhead(args, eng, data, max(every, args["overhead_steps"] // every * every))
        out[key], out[key + "_cpu"] = oh["wall"], oh["cpu"]
        if dist.get_rank() == 0:
            log(f"{key}: wall {oh['wall']:+.3f} cpu {oh['cpu']:+.3f}")
        del eng
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("adaptive", __doc__)
    ap.add_argument("--quick", action="store_true", help="small budget (smoke test)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs=3, default=[16, 64, 256], help="fixed global batch sizes")
    ap.add_argument("--target", type=float, default=0.12, help="held-out cross-entropy to reach")
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam LR at the smallest batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=512, help="samples between held-out evaluations")
    ap.add_argument("--max-samples", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--overhead-only", action="store_true", help="only measure the monitor overhead")
    a = ap.parse_args(argv)
    args = {"batches": sorted(a.batches), "target": a.target, "lr": a.lr, "hidden": a.hidden, "layers": a.layers,
            "eval_every": a.eval_every, "max_samples": a.max_samples, "seed": a.seed, "interval": 10, "warmup": 10,
            "overhead_blocks": 12, "overhead_steps": 10, "overhead_only": a.overhead_only}
    if a.quick:
        args.update(target=max(a.target, 0.5), max_samples=20_000, hidden=64, layers=4, overhead_blocks=2,
                    overhead_steps=5, warmup=5, interval=5)
    if any(b % a.ranks for b in args["batches"]):
        ap.error(f"--batches must be multiples of --ranks ({a.ranks})")
    from ..spawn import run_ranks

    log(f"pdv bench adaptive: {a.ranks} ranks, batches {args['batches']}, target held-out loss {args['target']}")
    res = run_ranks("pdv_ext.bench.adaptive:rank_main", a.ranks, args, timeout=a.timeout)[0]
    best = min((f for f in res["fixed"] if f["seconds_to_target"] is not None),
               key=lambda f: f["seconds_to_target"], default=None)
    ada = res.get("adaptive_seconds_to_target")
    result = {"fixed": [{k: f[k] for k in ("batch", "seconds_to_target", "steps_to_target")} for f in res["fixed"]],
              "adaptive_seconds_to_target": ada,
              "ratio": (ada / best["seconds_to_target"]) if (best and ada) else None,
              "monitor_overhead": res["monitor_overhead"],
              "monitor_overhead_cpu": res["monitor_overhead_cpu"],
              "monitor_overhead_every_step": res["monitor_overhead_every_step"],
              "monitor_overhead_every_step_cpu": res["monitor_overhead_every_step_cpu"],
              "adaptive_steps_to_target": res.get("adaptive_steps_to_target"),
              "adaptive_batches": res.get("adaptive_batches"),
              "adaptive_gns_first_last": res.get("adaptive_gns_first_last"),
              "best_fixed_batch": best["batch"] if best else None,
              "target_loss": args["target"], "ranks": a.ranks}
    emit(result, a.json)
    return 0
