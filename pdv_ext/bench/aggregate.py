"""`pdv bench aggregate`: one gradient exchange of each aggregator vs a plain torch.distributed all-reduce.

4 gloo ranks (pdv_ext.spawn) hold 64 MB of float32 gradients shaped like a GPT (h=512 blocks: qkv,
projection, MLP, layer norms, biases, plus a token-embedding slice filling the rest), seeded per rank.
Per repetition every aggregator runs once, in rotating order, each after a barrier on fresh copies of the
gradients; a step's time is the slowest rank's. Figures are medians after warm-up, in milliseconds.
`torch_allreduce_ms` is one dist.all_reduce of the already-flat 64 MB buffer (the pure collective);
every aggregator also pays for flattening the tensors. `cpu_ms` adds the CPU time of all ranks together
(medians): with more ranks than cores, wall time is mostly that CPU time over the cores. `horovod_adasum_ms` times hvd.allreduce(op=Adasum)
on the same tensors under `horovodrun --mpi` (null when Horovod or MPI is missing). An aggregator not
registered is reported as null (and named on stderr).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from ..registry import did_you_mean
from .common import check_ranges, emit, log, median, parser

AGGREGATORS = ["mean", "adasum", "zeno", "suspicion", "median", "gossip"]


def gpt_shapes(elements: int, h: int = 0) -> List[tuple]:
    """Parameter shapes of GPT blocks of width h (512, or 128 for small totals), then an embedding slice
    (rows of h) holding the remainder."""
    h = h or (512 if elements >= 8 * 2 ** 20 else 128)
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    per_block = sum(_numel(s) for s in block)
    shapes: List[tuple] = []
    while sum(_numel(s) for s in shapes) + per_block <= elements:
        shapes += block
    rest = elements - sum(_numel(s) for s in shapes)
    if rest >= h:
        shapes.append((rest // h, h))
    elif rest > 0:
        shapes.append((rest,))
    return shapes


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensors(shapes, rank: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(*s, generator=g) * 1e-2 for s in shapes]


def _spec(name: str, size: int) -> Dict[str, Any]:
    if name == "gossip":
        return {"type": "gossip", "peers": min(2, size - 1)}
    if name == "zeno":
        return {"type": "zeno", "b": 1}
    if name == "suspicion":
        return {"type": "suspicion"}
    return {"type": name}


# ---- gloo ranks -----------------------------------------------------------------------------------
def _rank(elements: int, reps: int, warmup: int, names: List[str]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..aggregation import AGGREGATORS as REG, build_aggregator
    from ..comm import TorchComm
    from ..spawn import init_torch_distributed

    init_torch_distributed("gloo")
    comm = TorchComm()
    shapes = gpt_shapes(elements)
    base = _tensors(shapes, comm.rank)
    flat = torch.cat([t.reshape(-1) for t in base])
    aggs: Dict[str, Any] = {}
    missing: Dict[str, str] = {}
    for name in names:
        if name not in REG:
            missing[name] = "not registered"
            continue
        try:
            agg = build_aggregator(_spec(name, comm.size))
            if getattr(agg, "needs_validation", False):
                agg.set_validation_grads(_tensors(shapes, comm.rank, seed=99))
            aggs[name] = agg
        except Exception as e:  # noqa: BLE001 - reported, the rest still runs
            missing[name] = f"{type(e).__name__}: {e}"

    def allreduce():
        dist.all_reduce(work_flat)

    order = ["torch_allreduce"] + list(aggs)
    times: Dict[str, List[float]] = {n: [] for n in order}
    cpu: Dict[str, List[float]] = {n: [] for n in order}  # CPU seconds of the 4 ranks together
    for it in range(warmup + reps):
        rot = order[it % len(order):] + order[: it % len(order)]  # nobody always goes first
        for name in rot:
            grads = [t.clone() for t in base]
            work_flat = flat.clone()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                if name == "torch_allreduce":
                    allreduce()
                else:
                    aggs[name](grads, comm)
                ok = 1.0
            except Exception as e:  # noqa: BLE001
                missing[name] = f"{type(e).__name__}: {e}"
                ok = 0.0
            dt = torch.tensor([time.perf_counter() - t0, -ok], dtype=torch.float64)
            dc = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time; any failure wins
            dist.all_reduce(dc)  # the CPU time of all ranks (all threads) together
            if dt[1].item() >= 0:  # failed somewhere: every rank drops it (collectives must match)
                missing.setdefault(name, "failed on another rank")
            elif it >= warmup:
                times[name].append(dt[0].item())
                cpu[name].append(dc.item())
        order = [n for n in order if n not in missing]
        if comm.rank == 0:  # progress, in the rank's log
            print(f"iteration {it + 1}/{warmup + reps}: " + ", ".join(
                f"{n} {times[n][-1] * 1e3:.0f} ms" for n in order if times[n]), file=sys.stderr, flush=True)
    return {"times": times, "cpu": cpu, "missing": missing, "tensors": len(shapes)}


# ---- Horovod (MPI) ranks --------------------------------------------------------------------------
def _horovod_worker(out: str, elements: int, reps: int, warmup: int) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    shapes = gpt_shapes(elements)
    base = _tensors(shapes, hvd.rank())
    times: List[float] = []
    for it in range(warmup + reps):
        grads = [t.clone() for t in base]
        hvd.barrier()
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(g, op=hvd.Adasum, name=f"bench.adasum.{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
        dt = torch.tensor([time.perf_counter() - t0])
        dt = hvd.allreduce(dt, op=hvd.Max, name=f"bench.t.{it}")
        if it >= warmup:
            times.append(float(dt))
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    hvd.barrier()
    hvd.shutdown()


def horovod_adasum(ranks: int, elements: int, reps: int, warmup: int, timeout: float) -> Optional[float]:
    """Median seconds of Horovod's MPI Adasum, or None (with the reason on stderr)."""
    hvdrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    try:
        from horovod.common.util import mpi_built

        if not mpi_built():
            log("horovod_adasum_ms: null (Horovod built without MPI)")
            return None
    except Exception as e:  # noqa: BLE001
        log(f"horovod_adasum_ms: null (horovod not importable: {e})")
        return None
    if not os.path.exists(hvdrun):
        log("horovod_adasum_ms: null (horovodrun not found)")
        return None
    if ranks & (ranks - 1):
        log(f"horovod_adasum_ms: null (Horovod's CPU Adasum needs a power-of-two rank count, not {ranks})")
        return None
    with tempfile.TemporaryDirectory(prefix="pdv-bench-hvd-") as tmp:
        out = os.path.join(tmp, "times.json")
        code = (f"from pdv_ext.bench.aggregate import _horovod_worker; "
                f"_horovod_worker({out!r}, {elements}, {reps}, {warmup})")
        cmd = [hvdrun, "-np", str(ranks), "-H", f"localhost:{ranks}", "--mpi", "--network-interface", "lo",
               sys.executable, "-c", code]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        from ..spawn import run_command

        rc, tail = run_command(cmd, env=env, timeout=timeout, tail_lines=15)
        if rc != 0 or not os.path.exists(out):
            log(f"horovod_adasum_ms: null (horovodrun {'timed out' if rc is None else f'exit {rc}'})\n{tail}")
            return None
        with open(out) as f:
            return median(json.load(f))


def main(argv=None) -> int:
    from ..spawn import run_ranks

    ap = parser("aggregate", __doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=float, default=64.0, help="MB of float32 gradients per rank (default 64)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--horovod", dest="horovod", action="store_true", default=None,
                    help="also time Horovod's MPI Adasum (default: on, off with --quick)")
    ap.add_argument("--no-horovod", dest="horovod", action="store_false")
    ap.add_argument("--only", default="", help="comma-separated aggregators to time (default: all); the rest are null")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--quick", action="store_true", help="2 ranks, 4 MB, 3 repetitions, no Horovod (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.mb, args.reps, args.warmup = 2, 4.0, 3, 1
        args.horovod = bool(args.horovod)
    elif args.horovod is None:
        args.horovod = True
    # an exchange needs two ranks (gossip a peer); nan/negative --mb would fail in or after the ranks
    check_ranges(ap, args, {"--ranks": 2, "--reps": 1, "--warmup": 0}, ["--mb", "--timeout"])
    elements = int(args.mb * 2 ** 20 / 4)
    if elements < 1:
        ap.error(f"--mb {args.mb:g} is less than one float32")
    names = [n for n in args.only.split(",") if n] or AGGREGATORS
    for n in names:
        if n not in AGGREGATORS:
            ap.error(f"--only: unknown aggregator '{n}'{did_you_mean(n, AGGREGATORS)}; known: {', '.join(AGGREGATORS)}")
    for n in AGGREGATORS:
        if n not in names:
            log(f"{n}_ms: null (skipped: not in --only)")
    log(f"aggregate: {args.ranks} ranks, {args.mb:g} MB float32 in {len(gpt_shapes(elements))} tensors, "
        f"{args.reps} reps after {args.warmup} warm-up")
    res = run_ranks("pdv_ext.bench.aggregate:_rank", args.ranks,
                    {"elements": elements, "reps": args.reps, "warmup": args.warmup, "names": names},
                    timeout=args.timeout)[0]
    for name, why in res["missing"].items():
        log(f"{name}_ms: null ({why})")
    result: Dict[str, Any] = {}
    for name in ["torch_allreduce"] + AGGREGATORS:
        ts = res["times"].get(name) or []
        ok = ts and name not in res["missing"] and (name == "torch_allreduce" or name in names)
        result[f"{name}_ms"] = round(median(ts) * 1e3, 2) if ok else None
    hvd = None
    if args.horovod:
        log("timing Horovod's MPI Adasum under horovodrun ...")
        hvd = horovod_adasum(args.ranks, elements, args.reps, args.warmup, args.timeout)
    else:
        log("horovod_adasum_ms: null (skipped: --quick / --no-horovod)")
    result["horovod_adasum_ms"] = round(hvd * 1e3, 2) if hvd is not None else None
    hm: Dict[str, Any] = {}
    if args.horovod:  # our mean through HorovodComm vs plain hvd allreduce (pdv_ext.bench._horovod_timing)
        from ._horovod_timing import horovod_mean_timing

        log("timing mean through HorovodComm vs hvd.allreduce(op=Average) under horovodrun --gloo ...")
        try:
            hm = horovod_mean_timing([_numel(s) for s in gpt_shapes(elements)], args.ranks, args.reps,
                                     args.warmup, args.timeout)
        except Exception as e:  # noqa: BLE001 - reported, the rest of the result stands
            log(f"horovod_mean_ms: null ({e})")
    else:
        log("horovod_mean_ms: null (skipped: --quick / --no-horovod)")
    result["horovod_mean_ms"] = hm.get("horovod_mean_ms")
    result["hvd_allreduce_ms"] = hm.get("hvd_allreduce_ms")
    # CPU seconds of all ranks together per exchange (medians): with more ranks than cores the wall time is
    # mostly this divided by the cores, so it is the cost that carries over to a machine with a core per rank
    result["cpu_ms"] = {n: round(median(ts) * 1e3, 1) for n, ts in res.get("cpu", {}).items()
                        if ts and n not in res["missing"]}
    result["ranks"] = args.ranks
    result["mb"] = args.mb
    if result["adasum_ms"] and result["torch_allreduce_ms"]:
        result["adasum_vs_allreduce"] = round(result["adasum_ms"] / result["torch_allreduce_ms"], 3)
    if result["adasum_ms"] and result["horovod_adasum_ms"]:
        result["adasum_vs_horovod"] = round(result["adasum_ms"] / result["horovod_adasum_ms"], 3)
    emit(result, args.json)
    return 0
