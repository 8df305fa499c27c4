"""`pdv plan`, `pdv predict fit|eval`, `pdv profile`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..cli_args import check_out, check_ranges
from ..config_base import ConfigError


def _fail(msg: str) -> int:
    print(msg, file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------
# pdv plan
# ---------------------------------------------------------------------------------------------------
def plan_main(argv: Optional[List[str]] = None) -> int:
    from .cluster import Cluster
    from .profile import Profile
    from .solvers import SOLVERS, solve

    ap = argparse.ArgumentParser(prog="pdv plan", description="choose stage boundaries and rank placement")
    ap.add_argument("--cluster", required=True, help="cluster YAML (see docs/placement.md)")
    ap.add_argument("--profile", required=True, help="layer profile JSON (pdv profile)")
    ap.add_argument("--stages", type=int, default=None, help="number of stages (default: the solver chooses)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--solver", default="dp", help=f"one of {', '.join(SOLVERS.names())} or module:function")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--aggregator", default="mean", help="reduction pattern the cost model assumes (an aggregator "
                    "name; a registered one without a known pattern is costed as a ring all-reduce)")
    ap.add_argument("--out", default=None, help="write the plan JSON here")
    ap.add_argument("--plot", default=None, help="draw the step as the schedule replay sees it (PNG): devices' "
                    "passes, link transfers, reduction and update; the title's predicted step is where it ends")
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON line")
    args = ap.parse_args(argv)
    check_ranges(ap, args, {"--stages": 1, "--micro-batches": 1})
    check_out(ap, "--out", args.out)
    check_out(ap, "--plot", args.plot)
    try:
        cluster = Cluster.load(args.cluster)
        prof = Profile.load(args.profile)
    except ConfigError as exc:
        return _fail("\n".join(exc.errors))
    except (OSError, ValueError) as exc:
        return _fail(f"pdv plan: {exc}")
    try:
        plan = solve(args.solver, prof, cluster, args.stages, args.micro_batches, schedule=args.schedule,
                     aggregator=args.aggregator)
    except (ValueError, KeyError) as exc:
        return _fail(f"pdv plan: {exc}")
    if args.out:
        plan.save(args.out)
    replayed = None
    if args.plot:
        from .gantt import plot_plan

        replayed = plot_plan(plan, prof, cluster, args.plot)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(plan.table())
        if args.out:
            print(f"plan written to {args.out}")
        if replayed is not None:
            print(f"plot written to {args.plot}: replay of the {plan.schedule} schedule, step "
                  f"{replayed.step_time * 1e3:.3f} ms (sends and receives in the schedule's order; the closed "
                  "form above overlaps link transfers with the devices' work)")
    return 0


# ---------------------------------------------------------------------------------------------------
# pdv predict
# ---------------------------------------------------------------------------------------------------
def predict_main(argv: Optional[List[str]] = None) -> int:
    from . import predictor as P

    ap = argparse.ArgumentParser(prog="pdv predict", description="fit / evaluate the latency predictor")
    sub = ap.add_subparsers(dest="cmd", required=True)
    fit = sub.add_parser("fit", help="fit on every mesh of the database (or all but the --hold-out ones)")
    fit.add_argument("--db", default=P.DEFAULT_DB, help="profiling database JSON (default: the packaged Alpa data)")
    fit.add_argument("-o", "--out", required=True)
    fit.add_argument("--hold-out", nargs="*", default=None, metavar="MESH",
                     help="mesh names (e.g. 2x8) not to fit on, for a held-out test with `eval`; with no name: "
                          "the largest mesh (default: nothing held out, every mesh is fitted on)")
    fit.add_argument("--all", action="store_true", help="fit on every mesh (the default; kept for old scripts)")
    fit.add_argument("--cluster", default=None, help="cluster YAML whose inter_host link the model should use")
    ev = sub.add_parser("eval", help="relative error on the meshes the model was not fitted on (held out); on "
                                     "every mesh, flagged in-sample, when it was fitted on all of them")
    ev.add_argument("--model", required=True)
    ev.add_argument("--db", default=P.DEFAULT_DB)
    ev.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "fit":
        check_out(ap, "--out", args.out)
    try:
        db = P.load_db(args.db)
    except (OSError, ValueError) as exc:
        return _fail(f"pdv predict: cannot read database '{args.db}': {exc}")
    if args.cmd == "fit":
        if args.all and args.hold_out is not None:
            return _fail("pdv predict fit: --all and --hold-out contradict each other (every mesh is fitted on "
                         "by default; --hold-out keeps some out)")
        try:
            train, test = P.split_meshes(db, args.hold_out)
        except ValueError as exc:
            return _fail(f"pdv predict fit: {exc}")
        link = None
        if args.cluster:
            from .cluster import Cluster

            try:
                ln = Cluster.load(args.cluster).spec.links.inter_host
            except ConfigError as exc:
                return _fail("\n".join(exc.errors))
            link = {"bandwidth": ln.bandwidth, "latency": ln.latency}
        pred = P.Predictor.fit(train, inter_host=link)
        pred.model["trained_on"] = [P.mesh_name(m) for m in train]
        pred.model["held_out"] = [P.mesh_name(m) for m in test]
        pred.save(args.out)
        held = (", ".join(pred.model["held_out"]) if test else
                "none (every mesh; `pdv predict eval` on this database is then in-sample: --hold-out [MESH ...] "
                "keeps meshes out for a held-out test)")
        print(f"fitted on meshes {', '.join(pred.model['trained_on'])}; held out: {held}; inter-host link: "
              f"{pred.model['inter_host']} ({pred.model['inter_host_source']}) -> {args.out}")
        return 0
    try:
        pred = P.Predictor.load(args.model)
    except (OSError, ValueError) as exc:
        return _fail(f"pdv predict eval: cannot read model '{args.model}': {exc}")
    trained = set(pred.model.get("trained_on", []))
    test = [m for m in db["meshes"] if P.mesh_name(m) not in trained]
    in_sample = not test  # fitted on every mesh of this database: the error on its own training data
    if in_sample:
        test = list(db["meshes"])
    try:
        res = P.evaluate(pred, test)
    except ValueError as exc:  # e.g. a model fitted without matmul data, evaluated on meshes with some
        return _fail(f"pdv predict eval: {exc}")
    res["meshes"] = [P.mesh_name(m) for m in test]
    res["in_sample"] = in_sample
    res["evaluated_on"] = "every mesh, in-sample (the model was fitted on all of them)" if in_sample else "held-out meshes"
    if args.json:
        print(json.dumps(res))
    else:
        if in_sample:
            print(f"in-sample: the model was fitted on every mesh of this database ({', '.join(res['meshes'])}); "
                  "the error below is on its own training data, not a test on unseen meshes (fit with "
                  "--hold-out MESH for one)")
        print(f"{'in-sample' if in_sample else 'held-out'} meshes: {', '.join(res['meshes'])}  points: {res['points']}")
        print(f"median relative error: {res['median_rel_error']:.4f}   p90: {res['p90_rel_error']:.4f}")
        for k, v in res["by_kind"].items():
            print(f"  {k:<22} median {v['median']:.4f}  p90 {v['p90']:.4f}  ({v['points']} points)")
    return 0


# ---------------------------------------------------------------------------------------------------
# pdv profile
# ---------------------------------------------------------------------------------------------------
def _user_model(spec: str, args: argparse.Namespace, ap: argparse.ArgumentParser):
    """(layers, sample input, loss_fn, labels) of `--model module:function`: the function (called with no
    arguments) returns the layer list you give `PipelineModule(layers=...)` (LayerSpecs, modules or callables),
    a built PipelineModule, or a dict {"layers", optionally "input", "labels", "loss_fn"}. Without "input" the
    micro-batch comes from --input-shape / --input-dtype / --input-high, as `pdv.placement` profiles at start-up."""
    import torch

    from ..registry import RegistryError, load_object

    try:
        fn = load_object(spec)
    except RegistryError as exc:
        ap.error(f"--model: {exc}")
    if not callable(fn):
        ap.error(f"--model: '{spec}' names a {type(fn).__name__}, not a function returning the model's layers")
    built = fn()
    sample = labels = loss_fn = None
    if isinstance(built, dict):
        if "layers" not in built:
            ap.error(f"--model: '{spec}' returned a dict without 'layers'")
        layers, sample, labels, loss_fn = built["layers"], built.get("input"), built.get("labels"), built.get("loss_fn")
    elif isinstance(built, (list, tuple)):
        layers = list(built)
    else:
        ap.error(f"--model: '{spec}' returned a {type(built).__name__}; return the list of layers you give "
                 "PipelineModule(layers=...) or a dict with 'layers' (a built PipelineModule: profile it in your "
                 "script with pdv_ext.integrations.deepspeed.profile_pipeline)")
    if not layers:
        ap.error(f"--model: '{spec}' returned no layers")
    if sample is None:
        if not args.input_shape:
            ap.error("--input-shape: needed with --model module:function (the shape of one micro-batch's input, "
                     "e.g. 8,64), unless the function returns a dict with 'input'")
        shape = tuple(args.input_shape)
        sample = (torch.randint(0, args.input_high, shape) if args.input_dtype == "int64" else torch.randn(*shape))
    if labels is None:
        loss_fn = None  # no labels to compute it on: the last layer is timed without the loss (as at start-up)
    return list(layers), sample, loss_fn, labels


def _shape(text: str) -> List[int]:
    try:
        dims = [int(x) for x in text.replace("x", ",").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape such as 8,64") from None
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape such as 8,64 (whole numbers >= 1)")
    return dims


def profile_main(argv: Optional[List[str]] = None) -> int:
    import torch

    from ..models import gpt_layers, lm_loss, mlp_layers
    from .profile import ProfileMemoryError, profile_layers

    ap = argparse.ArgumentParser(
        prog="pdv profile", description="profile the layers of a model: a demo model (gpt, mlp) or yours "
        "(--model module:function, the function returning the layer list you give PipelineModule)")
    ap.add_argument("--model", default="gpt", metavar="gpt|mlp|module:function",
                    help="gpt or mlp (the demo models), or module:function returning your model's layers (the list "
                         "given to PipelineModule(layers=...)) or a dict with 'layers' and "
                         "optionally 'input', 'labels', 'loss_fn'; the module is looked up on sys.path, then in the "
                         "working directory")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (gpt) or hidden layers (mlp)")
    ap.add_argument("--hidden", type=int, default=128, help="(gpt, mlp)")
    ap.add_argument("--heads", type=int, default=4, help="(gpt)")
    ap.add_argument("--seq-len", type=int, default=64, help="(gpt)")
    ap.add_argument("--micro-batch", type=int, default=8, help="(gpt, mlp)")
    ap.add_argument("--input-shape", type=_shape, default=None, metavar="SHAPE",
                    help="with module:function: one micro-batch's input shape, e.g. 8,64 (pdv.placement.input_shape)")
    ap.add_argument("--input-dtype", choices=["float32", "int64"], default="float32",
                    help="with module:function: random normal floats or random integers (pdv.placement.input_dtype)")
    ap.add_argument("--input-high", type=int, default=256,
                    help="with module:function and int64: the integers' exclusive upper bound, e.g. the vocabulary")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", action="store_true",
                    help="also measure DeepSpeed's own per-micro-batch / per-step work (one-stage engines, ~30 s)")
    ap.add_argument("--calibrate", choices=["auto", "on", "off"], default="auto",
                    help="scale the layers' forward + backward to sum to the whole model's timed pass (auto: on a "
                         "GPU, where layers timed alone miss the overlap of launches with the device's work)")
    ap.add_argument("--no-tie-identical", action="store_true",
                    help="give every layer its own median cost (default: identical layers, e.g. the transformer "
                         "blocks, share the median of all their samples: their true costs are equal)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    check_ranges(ap, args, {"--layers": 1, "--hidden": 1, "--heads": 1, "--seq-len": 1, "--micro-batch": 1, "--reps": 1,
                            "--input-high": 1})
    user = ":" in args.model
    if not user and args.model not in ("gpt", "mlp"):
        from ..registry import did_you_mean

        ap.error(f"--model: '{args.model}' is not gpt, mlp or module:function{did_you_mean(args.model, ['gpt', 'mlp'])}")
    if args.model == "gpt" and args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    check_out(ap, "--out", args.out)
    torch.manual_seed(0)
    if user:
        specs, sample, loss_fn, labels = _user_model(args.model, args, ap)
    elif args.model == "gpt":
        specs = gpt_layers(args.layers, args.hidden, args.heads, args.seq_len)
        sample, labels = (torch.randint(0, 256, (args.micro_batch, args.seq_len)) for _ in range(2))
        loss_fn = lm_loss
    else:
        specs = mlp_layers(args.layers, args.hidden, 16, 4)
        sample, labels = torch.randn(args.micro_batch, 16), torch.randint(0, 4, (args.micro_batch,))
        loss_fn = torch.nn.functional.cross_entropy
    try:
        prof = profile_layers(specs, sample, reps=args.reps, progress=sys.stderr.isatty(), loss_fn=loss_fn,
                              labels=labels, calibrate={"auto": None, "on": True, "off": False}[args.calibrate],
                              tie_identical=not args.no_tie_identical)
    except ProfileMemoryError as exc:
        print(f"pdv profile: {exc}", file=sys.stderr)
        return 2
    prof.meta.update({"model": args.model} if user else {"model": args.model, "layers": args.layers,
                                                          "hidden": args.hidden})
    if args.engine:
        from .profile import engine_overhead

        prof.engine = engine_overhead(len(prof))
    prof.save(args.out)
    total = sum(l.fwd_bwd for l in prof.layers)
    cal = (f" (calibrated to the whole pass: layers alone summed to {prof.meta['layer_sum_seconds'] * 1e3:.2f} ms)"
           if "whole_pass_seconds" in prof.meta else "")
    size = int(sample.shape[0]) if hasattr(sample, "shape") and len(sample.shape) else args.micro_batch
    print(f"{len(prof)} layers on {prof.device}, fwd+bwd {total * 1e3:.2f} ms per micro-batch of {size}"
          f"{cal}, {sum(l.param_bytes for l in prof.layers) / 2 ** 20:.2f} MiB parameters -> {args.out}")
    return 0
