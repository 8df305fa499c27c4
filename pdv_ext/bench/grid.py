"""`pdv bench grid --json`: the cost model's step time against the measured one, for every pipeline depth and
every place of a slowed device, on the emulated cluster.

Why: `replan` moves a job to the plan the cost model predicts fastest, and the move pays only as far as the
prediction holds. One move's error says little (bench adapt makes one or two per run); this grid asks the model
about every plan a re-plan may choose, at a CPU budget given (`--cpu-budget`: run it at the emulator's
default and at half of it, as if on a faster and a slower machine).

For each pipeline depth in `--depths` (the global batch of `--micro-batches` micro-batches split over the
replicas that depth leaves) it
1. plans with the `dp` solver for the calm cluster and runs that plan calm (`calm`);
2. for every stage of that plan, slows the device of its first replica by `--slow` (its CPU quota, as
   `pdv emulate`'s throughput events do: the other devices keep their cores) and runs the calm plan on it
   (`before`: the step a re-plan starts from), then the plan the solver makes for the slowed cluster at the
   same depth (`after`: the step after a move; skipped where it is the calm plan);
and predicts every run's step from one profile taken before the runs (the layers on the reference device,
scaled to its timed whole-model pass; the whole update timed as one piece; the reduction's CPU work per byte
from all-reduces over 4 and 2 ranks): the closed form the solver and `replan` use (`cost.evaluate`,
`predicted_ms`) and the replay of DeepSpeed's schedule (`replay_ms`). The devices' speeds are measured as a
re-plan measures them, on the plan in force (an `after` run is predicted from its `before` run's speeds):
`busy_speeds` from each rank's forward + backward CPU time at its quota (its speed when it is the bottleneck,
the headline `error`), `wall_speeds` from the wall time (`wall_speeds_error`; what `replan` reads today: a rank
that waits shows more than its busy speed under a CPU quota), and the cluster file's speeds with the slowed one
times `--slow` (`stated_speeds_error`); the baseline, the same prediction from the profile without the CPU's own
work (each layer's update as timed alone, the reduction as its link transfer: the model before #38's grid),
is `without_cpu_work_error`. An error is |predicted - measured| / measured; `worst_error` the
largest over the grid, also per case kind. With `--repeats N` the whole grid (its profile first) runs N times
in alternating rounds, on the plans the first round's profile chose: a case's measured step and each of its
predictions are the medians over the rounds (each round predicted from its own profile and speeds), its errors
those medians' errors, every round's own in `rounds` and the worst of any one round in `worst_round_error`
(the spread a single grid would show). Runs are the demo GPT of the `pipe*_straggler` scenarios (8 blocks,
hidden 128, micro-batch 4, 8 micro-batches a step), `--steps` timed steps after `--warmup`, each run's median
step; every run's time per pipeline instruction (slowest rank) is in `parts_ms`.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from .common import check_ranges, emit, log, median, parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CLUSTER = os.path.join(ROOT, "launch", "clusters", "emulated_4equal.yaml")
ARTIFACTS = os.path.join(ROOT, "build", "bench-grid")


def _args(argv):
    ap = parser("grid", __doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=DEFAULT_CLUSTER)
    ap.add_argument("--cpu-budget", type=float, default=None,
                    help="cores shared by all devices (default: pdv emulate's, 0.55 x the machine's cores)")
    ap.add_argument("--depths", default="1,2,4", help="comma-separated pipeline depths")
    ap.add_argument("--slow", type=float, default=0.4, help="the slowed device's speed, relative to its own")
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks of the demo GPT")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches of the whole step (all replicas)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the whole grid (profile included), alternating; medians over them")
    ap.add_argument("--quick", action="store_true", help="depths 1,2, 3 steps (smoke test)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per emulated run")
    a = ap.parse_args(argv)
    if a.quick:
        a.depths, a.steps, a.warmup = "1,2", 3, 1
    check_ranges(ap, a, {"--layers": 1, "--hidden": 1, "--micro-batch": 1, "--micro-batches": 1, "--steps": 1,
                         "--warmup": 0, "--repeats": 1}, ["--timeout", "--cpu-budget", "--slow"])
    if not a.slow < 1.0:
        ap.error(f"--slow {a.slow:g} is not a slowdown (a speed below 1)")
    if a.hidden % 4:
        ap.error(f"--hidden ({a.hidden}) must be a multiple of 4 (the demo GPT's attention heads)")
    try:
        a.depths = [int(x) for x in a.depths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--depths {a.depths!r}: comma-separated integers, e.g. 1,2,4")
    return a


def check_depths(depths: List[int], devices: int, micro_batches: int, blocks: int) -> Optional[str]:
    """One line naming the first depth the grid cannot run, or None: a depth must divide the devices (every
    rank busy), leave a whole number of micro-batches per replica and at least one layer per stage."""
    for d in depths:
        if d < 1 or devices % d:
            return f"--depths: {d} does not divide the cluster's {devices} devices"
        if micro_batches % (devices // d):
            return (f"--depths: {d} stages leave {devices // d} replicas, which do not share --micro-batches "
                    f"{micro_batches} evenly")
        if d > blocks + 2:
            return f"--depths: {d} stages for {blocks + 2} layers"
    return None


def cases(plan_for, calm, depths: List[int], slow: float) -> List[Dict[str, Any]]:
    """The grid's runs: per depth the calm plan calm, and per stage of it the device of its first replica
    slowed, under the calm plan and under the solver's plan for the slowed cluster (when that differs).
    `plan_for(cluster, depth)` -> (boundaries, rank_mapping); `calm` the calm cluster."""
    out: List[Dict[str, Any]] = []
    for d in depths:
        b, rows = plan_for(calm, d)
        out.append({"depth": d, "case": "calm", "stage": None, "slowed": None, "boundaries": b, "rank_mapping": rows})
        for s, row in enumerate(rows):
            dev = int(row[0])
            slowed = calm.with_throughputs([t.throughput * (slow if i == dev else 1.0)
                                            for i, t in enumerate(calm.devices)], source="grid")
            out.append({"depth": d, "case": "before", "stage": s, "slowed": dev, "boundaries": b,
                        "rank_mapping": rows})
            nb, nrows = plan_for(slowed, d)
            if (list(nb), [list(r) for r in nrows]) != (list(b), [list(r) for r in rows]):
                out.append({"depth": d, "case": "after", "stage": s, "slowed": dev, "boundaries": nb,
                            "rank_mapping": nrows})
    return out


def measured_speeds(profile, parts: List[int], mapping: List[List[int]], micro_batches: int,
                    breakdown: List[Dict[str, List[float]]], cores: Optional[List[float]] = None,
                    rate: float = 1.0) -> List[float]:
    """Every rank's speed relative to the profiling device: its layers' profiled forward + backward over the
    time it spent in ForwardPass + BackwardPass per micro-batch. Without `cores`, that time is the wall time
    (what `replan` measures); with them, the rank's CPU time at its quota (`cores[r]`, the profiling device's
    at `rate`: the CPU it used per second while kept busy): its speed when busy. Under a CPU quota a rank that
    waits between passes starts each on unspent quota and shows a wall speed above its busy one (1.08-1.12 of
    the profiling device's, against 0.93 once a move made it the bottleneck)."""
    fb = profile.arrays()["fwd_bwd"]
    col = 0 if cores is None else 1
    out = [0.0] * len(breakdown)
    for s, row in enumerate(mapping):
        work = float(fb[parts[s]:parts[s + 1]].sum())
        for r in row:
            spent = sum(breakdown[r].get(k, [0.0, 0.0])[col] for k in ("ForwardPass", "BackwardPass")) / 1e3 / micro_batches
            if cores is not None:
                spent /= cores[int(r)] * rate
            out[int(r)] = work / spent if spent > 0 else 0.0
    return out


def instruction_parts(breakdown: List[Dict[str, List[float]]]) -> Dict[str, float]:
    """The slowest rank's wall ms per step in each kind of instruction: where a step's time went."""
    keys = sorted({k for bd in breakdown for k in bd})
    return {k: round(max(bd.get(k, [0.0])[0] for bd in breakdown), 1) for k in keys}


def without_cpu_work(profile):
    """The profile as the cost model had it before it charged the CPU's own work (the baseline beside every
    prediction): each layer's update as timed alone, the reduction as the link's transfer only."""
    from dataclasses import replace

    k = float(profile.meta.get("update_scale", 1.0))
    engine = None if profile.engine is None else {key: v for key, v in profile.engine.items()
                                                  if key not in ("reduce_byte", "reduce_grad_byte")}
    return replace(profile, layers=[replace(l, update=l.update / k) for l in profile.layers], engine=engine)


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The worst error of each prediction and per case kind (calm / before / after)."""
    out: Dict[str, Any] = {}
    for key in ("error", "replay_error", "wall_speeds_error", "stated_speeds_error", "without_cpu_work_error"):
        vals = [r[key] for r in rows if r.get(key) is not None]
        out[f"worst_{key}"] = round(max(vals), 3) if vals else None
        for kind in ("calm", "before", "after"):
            kv = [r[key] for r in rows if r["case"] == kind and r.get(key) is not None]
            out[f"worst_{key}_{kind}"] = round(max(kv), 3) if kv else None
    return out


PREDICTIONS = ("", "wall_speeds_", "stated_speeds_", "without_cpu_work_")


def merge_rounds(rounds: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One row per case from its rows of every round (the same cases, in the same order): the median measured
    step, the median of each prediction, and their errors; speeds element-wise medians, `parts_ms` and the
    speeds' inputs from the round whose measured step is the median; each round's measured step, prediction
    and error in `rounds`. One round gives its own row back (with `rounds` of one)."""
    out: List[Dict[str, Any]] = []
    for rows in zip(*rounds):
        measured = median([r["measured_ms"] for r in rows])
        mid = min(rows, key=lambda r: abs(r["measured_ms"] - measured))
        row = dict(mid)
        row["measured_ms"] = round(measured, 1)
        for key in PREDICTIONS:
            pred = median([r[f"{key}predicted_ms"] for r in rows])
            row[f"{key}predicted_ms"], row[f"{key}error"] = round(pred, 1), round(abs(pred - measured) / measured, 3)
        rep = median([r["replay_ms"] for r in rows])
        row["replay_ms"], row["replay_error"] = round(rep, 1), round(abs(rep - measured) / measured, 3)
        for key in ("busy_speeds", "wall_speeds"):
            row[key] = [round(median(v), 3) for v in zip(*(r[key] for r in rows))]
        steals = [r["host_steal"] for r in rows if r.get("host_steal") is not None]
        row["host_steal"] = max(steals) if steals else None
        row["rounds"] = [{"measured_ms": r["measured_ms"], "predicted_ms": r["predicted_ms"], "error": r["error"]}
                         for r in rows]
        out.append(row)
    return out


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    from ..emulate import cgroup
    from ..emulate.launcher import EmulationUnavailable, check_available, default_cpu_budget
    from ..emulate.spec import from_cluster
    from ..placement.cluster import Cluster, reference_device
    from ..placement.cost import evaluate
    from ..placement.profile import Profile
    from ..placement.simulate import replay
    from ..placement.solvers import solve
    from .placement import _emulate

    try:
        cluster = Cluster.load(a.cluster)
        from_cluster(cluster)
    except Exception as exc:  # the loader's message names the file and key
        print(f"pdv bench grid: {exc}", file=sys.stderr)
        return 2
    bad = check_depths(a.depths, len(cluster), a.micro_batches, a.layers)
    if bad:
        print(f"pdv bench grid: {bad}", file=sys.stderr)
        return 2
    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"pdv bench grid: emulation unavailable: {exc}", file=sys.stderr)
        return 2
    budget = a.cpu_budget if a.cpu_budget is not None else default_cpu_budget()
    calm_cores = cgroup.shares([cluster.speed(i) for i in range(len(cluster))], budget)
    top = max(calm_cores)  # the calm fastest device's cores: a slowed device loses its own, nobody gains
    n = len(cluster)
    model = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--micro-batch", str(a.micro_batch)]
    timer = [sys.executable, "-m", "pdv_ext.emulate.train_step_timer"]
    steal: Dict[str, Optional[float]] = {}

    def emulate(cl, cmd: List[str], label: str) -> None:  # retried once, as bench placement's runs are
        _emulate(from_cluster(cl), cmd, a.timeout, label, steal, cpu_budget=budget, top_share=top)

    arts = os.path.join(ARTIFACTS, f"budget-{budget:.2f}")  # the profile and every run, kept per budget
    os.makedirs(arts, exist_ok=True)

    def run_cases(grid, profile, bare, rate: float, tmp: str, tag: str, sfx: str) -> List[Dict[str, Any]]:
        """One round: every case run on the emulated cluster and predicted from this round's profile."""
        results: List[Dict[str, Any]] = []
        for i, c in enumerate(grid):
            mb = a.micro_batches // (n // c["depth"])
            dev = c["slowed"]
            cl = cluster if dev is None else cluster.with_throughputs(
                [t.throughput * (a.slow if j == dev else 1.0) for j, t in enumerate(cluster.devices)], source="grid")
            plan_path, out = os.path.join(tmp, f"plan{i}.json"), os.path.join(arts, f"run{i}{sfx}.json")
            with open(plan_path, "w") as f:
                json.dump({"boundaries": c["boundaries"], "rank_mapping": c["rank_mapping"]}, f)
            label = f"depth {c['depth']} {c['case']}" + ("" if dev is None else f" (d{dev} of stage {c['stage']} slowed)")
            log(f"{tag}[{i + 1}/{len(grid)}] {label}: boundaries {c['boundaries']} mapping {c['rank_mapping']}")
            emulate(cl, timer + ["train", "--plan", plan_path, "--out", out, "--steps", str(a.steps), "--warmup",
                                 str(a.warmup), "--micro-batches", str(mb), "--breakdown"] + model, f"run{i}{sfx}")
            with open(out) as f:
                run = json.load(f)
            measured = float(run["median_step_ms"])
            parts, mapping = run["parts"], run["rank_mapping"]
            cores = [top * (a.slow if r == dev else 1.0) for r in range(n)]
            busy = measured_speeds(profile, parts, mapping, mb, run["breakdown_ms"], cores, rate)
            wall = measured_speeds(profile, parts, mapping, mb, run["breakdown_ms"])
            # the speeds measured on the plan in force: an `after` run's plan is the move's target, so its devices'
            # speeds come from the `before` run that measured them, as a re-plan knows them
            prior = results[-1] if c["case"] == "after" else None
            row = {**{k: c[k] for k in ("depth", "case", "stage", "slowed")}, "parts": parts, "rank_mapping": mapping,
                   "micro_batches": mb, "measured_ms": round(measured, 1)}
            seen = prior["busy_speeds"] if prior else busy
            for key, speeds, prof in (("", seen, profile), ("wall_speeds_", prior["wall_speeds"] if prior else wall, profile),
                                      ("stated_speeds_", None, profile), ("without_cpu_work_", seen, bare)):
                known = cl if speeds is None else cluster.with_throughputs([v * cluster.reference for v in speeds],
                                                                           source="measured")
                pred = evaluate(prof, known, parts, mapping, mb).step_time * 1e3
                row[f"{key}predicted_ms"] = round(pred, 1)
                row[f"{key}error"] = round(abs(pred - measured) / measured, 3)
                if not key:
                    rep = replay(profile, known, parts, mapping, mb).step_time * 1e3
                    row["replay_ms"], row["replay_error"] = round(rep, 1), round(abs(rep - measured) / measured, 3)
            row.update({"busy_speeds": [round(v, 3) for v in busy], "wall_speeds": [round(v, 3) for v in wall],
                        "parts_ms": instruction_parts(run["breakdown_ms"]),
                        "host_steal": None if steal.get(f"run{i}{sfx}") is None else round(steal[f"run{i}{sfx}"], 3)})
            log(f"  measured {measured:.1f} ms, predicted {row['predicted_ms']:.1f} ms ({row['error']:.1%} off); "
                f"from wall speeds {row['wall_speeds_predicted_ms']:.1f} ms ({row['wall_speeds_error']:.1%}), from the "
                f"stated speeds {row['stated_speeds_predicted_ms']:.1f} ms ({row['stated_speeds_error']:.1%}); busy "
                f"speeds {row['busy_speeds']}, wall {row['wall_speeds']}")
            results.append(row)
        return results

    with tempfile.TemporaryDirectory(prefix="pdv-bench-grid-") as tmp:
        ref = reference_device(cluster)
        grid: List[Dict[str, Any]] = []
        rounds: List[List[Dict[str, Any]]] = []
        profiles: List[Dict[str, Any]] = []
        for rnd in range(a.repeats):
            tag = "" if a.repeats == 1 else f"round {rnd + 1}/{a.repeats}: "
            sfx = "" if rnd == 0 else f"-r{rnd + 1}"  # round 1's files keep the names a single grid gives them
            prof_path = os.path.join(tmp, f"profile{sfx}.json")
            log(f"{tag}profiling the demo GPT on the reference device d{ref} ({budget:.2f} cores for {n} devices, "
                f"{top:.3f} each)")
            emulate(cluster, timer + ["profile", "--cluster", a.cluster, "--out", prof_path, "--workload-speeds",
                                      "--message-cpu", "--micro-batches", "1"] + model, f"profile{sfx}")
            raw = Profile.load(prof_path)
            work = raw.meta.get("workload_seconds") or []
            profile = raw.calibrated(work[ref]) if work else raw
            # the profiling device's CPU per second while kept busy, per core of its quota
            cpu_work = raw.meta.get("workload_cpu_seconds") or []
            rate = (cpu_work[ref] / work[ref] / top) if work and cpu_work else 1.0
            profile.save(os.path.join(arts, f"profile{sfx}.json"))
            profiles.append({"fwd_bwd_ms": round(float(profile.arrays()["fwd_bwd"].sum()) * 1e3, 2),
                             "engine_micro_batch_ms": round(profile.engine_micro_batch * 1e3, 3),
                             "engine_step_ms": round(profile.engine_step * 1e3, 3),
                             "workload_ms": [round(w * 1e3, 1) for w in work], "steal": steal.get(f"profile{sfx}")})
            bare = without_cpu_work(profile)

            def plan_for(cl, depth: int) -> Tuple[List[int], List[List[int]]]:
                p = solve("dp", profile, cl, depth, a.micro_batches // (n // depth))
                return [int(x) for x in p.boundaries], [[int(r) for r in row] for row in p.rank_mapping]

            if rnd == 0:  # every round runs the first round's plans, so that its cases line up
                grid = cases(plan_for, cluster, a.depths, a.slow)
            rounds.append(run_cases(grid, profile, bare, rate, tmp, tag, sfx))
    results = merge_rounds(rounds)
    per_round = [summary(r)["worst_error"] for r in rounds]
    result = {**summary(results), "worst_round_error": max(per_round), "worst_error_rounds": per_round,
              "repeats": a.repeats, "cpu_budget": round(budget, 3), "cores_per_device": round(top, 3),
              "slow": a.slow, "depths": a.depths, "micro_batches": a.micro_batches, "steps": a.steps,
              "profile_fwd_bwd_ms": profiles[0]["fwd_bwd_ms"],
              "engine_micro_batch_ms": profiles[0]["engine_micro_batch_ms"],
              "engine_step_ms": profiles[0]["engine_step_ms"],
              "workload_ms": profiles[0]["workload_ms"], "profile_steal": profiles[0]["steal"],
              "profiles": profiles, "runs": results}
    with open(os.path.join(arts, "grid.json"), "w") as f:
        json.dump(result, f, indent=1)
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
