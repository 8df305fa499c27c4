"""`pdv bench placement --json`: DeepSpeed's default placement vs the `dp` plan on an emulated cluster.

On the emulated cluster (`pdv emulate`: one namespace per device behind its host's bridge, tc-shaped links,
CPU quotas by device speed; root only) it
0. measures the cluster as launched: `pdv probe` on every emulated device (matmul throughput under each
   device's quota, link bandwidth/latency per pair); the plan and the predictions use the probed cluster
   (the YAML's names, hosts and memory; throughputs and links as probed, `cluster_source: probed`), or the
   YAML when the probe fails (`cluster_source: yaml`, logged),
1. has every device in turn time the demo GPT's forward + backward under its quota, kept busy (its speed on
   the model's own operations); a device's speed is the geometric mean of that and the probe's matmul
   throughput, both relative to the reference device (`--speeds combined`, the default: two independent
   timings with noise of the same size; `workload` or `matmul` takes one), then profiles the layers on the
   cluster's reference device (under that device's quota), and DeepSpeed's own work per micro-batch and
   per step there (one-stage engines over trivially cheap layers); the layers' times are scaled to sum to
   the reference device's timed whole-model pass (`profile_scale`; `--uncalibrated` keeps them as timed),
2. plans with the `dp` solver (pdv_ext.placement) from that profile and the cluster,
3. trains the same model with (a) DeepSpeed's default `parameters` partition + row-major placement and
   (b) the plan, alternating (a), (b) `--repeats` times in the same run, each reporting the median step time,
4. predicts both step times by replaying DeepSpeed's 1F1B schedule (`placement.simulate.replay`, on the
   parts/mapping the runs really used) from the profile the plan was made from: a prediction made before
   the runs, as a user's planner makes it. The closed form the `dp` solver optimises (`cost.evaluate`) is
   reported beside it (`analytic_default_ms`, `analytic_planned_ms`). The profile's per-message work (`p2p`)
   is the reference device's CPU for a send and a receive over the emulated link (`profile_p2p_ms`).
   `--reprofile` profiles again before every repeat and predicts from all profiles at once
   (`Profile.combined`: per-layer medians, every device's timings pooled), sampling the same stretch of
   the shared machine's load as the runs; `first_profile_prediction_error` is then the error of the
   first profile alone. (2026-11-24, two runs: 0.163 and 0.247 from all profiles, 0.128 and 0.162 from
   the first: the machine's drift showed in the training runs, not in the profiles.)

With the YAML fallback, planning and predictions use the cluster as emulated: where the kernel has no
sch_netem the links carry no added latency (`pdv emulate` says so), so their latencies are taken as 0
(`latency_emulated: false`); the probe measures whatever latency there is.

Output: {"default_ms", "planned_ms", "speedup", "predicted_default_ms", "predicted_planned_ms",
"prediction_error"} (|predicted - measured| / measured, the worse of the two) plus what was compared and
`host_steal`, the hypervisor's share of the CPU during each emulated run (where it is high the devices did
not get their quotas).
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
import tempfile
from typing import Any, Dict, List, Optional

from ..placement.cluster import reference_device
from .common import check_ranges, emit, log, median, parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CLUSTER = os.path.join(ROOT, "launch", "clusters", "emulated_4dev.yaml")
ARTIFACTS = os.path.join(ROOT, "build", "bench-placement")


def _args(argv):
    ap = parser("placement", __doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=DEFAULT_CLUSTER)
    ap.add_argument("--quick", action="store_true", help="few steps, one repeat (smoke test)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="alternating (default, planned) runs; each plan's median is reported")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--default-stages", type=int, default=2, help="pipeline stages of the DeepSpeed default")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks of the demo GPT")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0, help="per emulated run")
    ap.add_argument("--no-probe", action="store_true", help="plan and predict on the YAML, not a probed cluster")
    ap.add_argument("--speeds", choices=["combined", "workload", "matmul"], default="combined",
                    help="device speeds from the model timed on every device (workload), the probe's matmul, or "
                         "the geometric mean of both (combined, the default)")
    ap.add_argument("--matmul-speeds", action="store_true", help="the same as --speeds matmul")
    ap.add_argument("--reprofile", action="store_true",
                    help="profile again before every repeat and predict from all profiles (default: the plan's profile)")
    ap.add_argument("--cpu-budget", type=float, default=None,
                    help="cores all emulated devices share (default: pdv emulate's, 0.55 x the machine's)")
    ap.add_argument("--uncalibrated", action="store_true",
                    help="keep the per-layer times as profiled, not scaled to the whole model's timed pass")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.warmup = 1, 3, 1
    if a.matmul_speeds:
        a.speeds = "matmul"
    check_ranges(ap, a, {"--repeats": 1, "--steps": 1, "--warmup": 0, "--default-stages": 1, "--layers": 1,
                         "--hidden": 1, "--micro-batch": 1, "--micro-batches": 1}, ["--timeout", "--cpu-budget"])
    if a.hidden % 4:  # the demo GPT of train_step_timer has 4 attention heads
        ap.error(f"--hidden ({a.hidden}) must be a multiple of 4 (the demo GPT's attention heads)")
    return a


def _emulate(spec, cmd: List[str], timeout: float, label: str, steal: Dict[str, Optional[float]],
             attempts: int = 2, cpu_budget: Optional[float] = None, top_share: Optional[float] = None) -> bool:
    """Run `cmd` on the emulated cluster; True when link latencies were emulated (sch_netem present).
    Records the hypervisor's steal share during the run as `steal[label]` (quotas are not delivered under
    steal).
    A failed run is retried (`attempts` in all), loudly: a rank of a finished measurement has been seen
    aborting in gloo's teardown ("terminate called without an active exception"), which should not cost
    the whole benchmark; a second failure is an error."""
    from ..emulate.hoststat import StealMeter
    from ..emulate.launcher import Emulation

    for attempt in range(1, attempts + 1):
        emu = Emulation(spec, cmd, timeout=timeout, out=sys.stderr.buffer, cpu_budget=cpu_budget, top_share=top_share)
        meter = StealMeter()
        code = emu.run()
        steal[label] = meter.fraction()
        if code == 0:
            return bool(emu.net and emu.net.netem)
        log(f"{label}: emulated run failed with exit code {code} (attempt {attempt}/{attempts})")
    raise RuntimeError(f"emulated run failed with exit code {code}: {' '.join(cmd)}")


def _without_latency(cluster):
    """The cluster as emulated without sch_netem: same devices and bandwidths, no link latency."""
    from ..placement.cluster import Cluster

    d = cluster.to_dict()
    links = d.get("links", {})
    for ln in [links.get("intra_host"), links.get("inter_host"), *links.get("pairs", [])]:
        if ln:
            ln["latency"] = 0.0
    return Cluster.from_dict(d)


def _probed_cluster(yaml_cluster, probed_path: str, reference: int, profile=None, combine: bool = False):
    """The YAML's devices (names, hosts, memory: the emulated limits, not the machine's RAM the probe
    sees) with the probed links and throughputs. When the profile carries every device's time for the
    model's own forward + backward (`meta.workload_seconds`, measured one device at a time right before
    profiling), the throughputs are the reference device's time / that time: each device's speed on the
    model's operations (a CPU-quota device loses more of its share to descheduling on short operations
    than a long matmul shows); else the probe's matmul throughputs. With `combine`, the geometric mean of the two relative
    speeds: two independent timings of each device, in turns, whose noise on this machine was of the same
    size (the 0.1-core device: 0.214-0.263 of the reference from its workload, 0.23-0.254 from the matmul,
    four benchmark runs of 2026-11-25). Speeds are relative to the profiling device (`reference`)."""
    from ..placement.cluster import Cluster

    probed = Cluster.load(probed_path)
    if [d.name for d in probed.devices] != [d.name for d in yaml_cluster.devices]:
        raise ValueError(f"probed devices {[d.name for d in probed.devices]} do not match the YAML's "
                         f"{[d.name for d in yaml_cluster.devices]}")
    thr = [float(p.throughput) for p in probed.devices]
    work = (profile.meta.get("workload_seconds") if profile is not None else None) or None
    if work is not None and len(work) == len(thr) and all(w and w > 0 for w in work):
        timed = [float(work[reference]) / float(w) for w in work]
        thr = [math.sqrt(t * m / thr[reference]) for t, m in zip(timed, thr)] if combine else timed
    devices = []
    for y, t in zip(yaml_cluster.devices, thr):
        d = {"name": y.name, "host": y.host, "throughput": t}
        if y.memory is not None:
            d["memory"] = float(y.memory)
        devices.append(d)
    links = probed.to_dict()["links"]
    return Cluster.from_dict({"devices": devices, "links": links, "reference_throughput": thr[reference]})


def stage_comparison(cb, breakdowns: List[Any], micro_batches: int) -> List[Dict[str, Any]]:
    """Per stage: the cost model's forward + backward compute per micro-batch (`predicted_compute_ms`) and
    its whole work per micro-batch (`predicted_ms`: compute + send/recv work + engine), beside what the
    stage's slowest rank spent in ForwardPass + BackwardPass per micro-batch in each run (wall, and CPU).
    Where a step's error comes from: a stage's speed, or the schedule around it."""
    out = []
    for st in cb.stages:
        row: Dict[str, Any] = {"stage": st.stage, "layers": st.layers, "devices": st.devices,
                               "predicted_compute_ms": round(st.compute * 1e3, 1),
                               "predicted_ms": round(st.time * 1e3, 1), "measured_fwd_bwd_ms": [],
                               "measured_fwd_bwd_cpu_ms": []}
        for bd in filter(None, breakdowns):
            for col, key in ((0, "measured_fwd_bwd_ms"), (1, "measured_fwd_bwd_cpu_ms")):  # [wall, cpu]
                slowest = max(sum(bd[r].get(i, [0.0, 0.0])[col] for i in ("ForwardPass", "BackwardPass"))
                              for r in st.devices)
                row[key].append(round(slowest / micro_batches, 1))
        out.append(row)
    return out


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    from ..emulate.launcher import EmulationUnavailable, check_available, default_cpu_budget
    from ..emulate.spec import from_cluster
    from ..placement.cluster import Cluster
    from ..placement.cost import evaluate
    from ..placement.simulate import replay
    from ..placement.profile import Profile
    from ..placement.solvers import solve

    try:  # the cluster first: a bad one is the same error with or without root
        cluster = Cluster.load(a.cluster)
        spec = from_cluster(cluster)  # checks the cluster fits the emulated network
    except Exception as exc:  # the loader's message names the file and key
        print(f"pdv bench placement: {exc}", file=sys.stderr)
        return 2
    if len(cluster) % a.default_stages:  # DeepSpeed's pipeline grid: stages x data-parallel replicas
        print(f"pdv bench placement: --default-stages {a.default_stages} must divide the cluster's {len(cluster)} "
              "devices", file=sys.stderr)
        return 2
    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"pdv bench placement: emulation unavailable: {exc}", file=sys.stderr)
        return 2
    model = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--micro-batch", str(a.micro_batch),
             "--micro-batches", str(a.micro_batches)]
    timer = [sys.executable, "-m", "pdv_ext.emulate.train_step_timer"]
    steal: Dict[str, Optional[float]] = {}  # the VM's steal share during each emulated run, by run label
    with tempfile.TemporaryDirectory(prefix="pdv-bench-placement-") as tmp:
        prof_path, plan_path = os.path.join(tmp, "profile.json"), os.path.join(tmp, "plan.json")
        yaml_cluster, source, probed = cluster, "yaml", None
        ref = reference_device(yaml_cluster)  # the device train_step_timer profiles on
        if not a.no_probe:
            probed_path = os.path.join(tmp, "probed.yaml")
            log(f"probing the emulated cluster {a.cluster} (pdv probe)")
            try:
                _emulate(spec, [sys.executable, "-m", "pdv_ext.cli", "probe", "--out", probed_path,
                                "--sizes", "2097152", "4194304", "8388608", "--reps", "3", "--matmul-size", "1024"],
                         a.timeout, "probe", steal, cpu_budget=a.cpu_budget)
                cluster, source = _probed_cluster(yaml_cluster, probed_path, ref), "probed"
                probed = [round(cluster.speed(i), 3) for i in range(len(cluster))]
                log(f"probed speeds {probed} (YAML {[round(yaml_cluster.speed(i), 3) for i in range(len(cluster))]}), "
                    f"intra-host {cluster.spec.links.intra_host.bandwidth * 8 / 1e6:.0f} Mbit/s, inter-host "
                    f"{cluster.spec.links.inter_host.bandwidth * 8 / 1e6:.0f} Mbit/s")
            except Exception as exc:  # noqa: BLE001 - any failure: fall back to the YAML, loudly
                log(f"pdv probe failed ({exc}); FALLING BACK to the cluster YAML as written (cluster_source: yaml)")
                cluster, source = yaml_cluster, "yaml"

        def run_profile(i: int):
            """Profile on the reference device (every device times the whole model too); the raw profile."""
            path = os.path.join(tmp, f"profile{i}.json")
            log(f"profiling the demo GPT on the reference device of {a.cluster} ({i + 1}/{n_profiles})")
            emulated = _emulate(spec, timer + ["profile", "--cluster", a.cluster, "--out", path,
                                               "--workload-speeds", "--message-cpu"] + model, a.timeout,
                                f"profile{i}", steal, cpu_budget=a.cpu_budget)
            raw = Profile.load(path)
            log(f"  engine work on the reference device: micro-batch {raw.engine_micro_batch * 1e3:.2f} ms, "
                f"step {raw.engine_step * 1e3:.2f} ms; whole model per device "
                f"{[round(w * 1e3, 1) for w in raw.meta.get('workload_seconds') or []]} ms")
            return raw, emulated

        def prepared(raws, cluster_in):
            """(profile, cluster, speed source) the cost model uses, from one or more raw profiles: device
            speeds from the devices' timed forward + backward of the whole model (all rounds pooled), each
            profile's layer times scaled to its own reference-device whole pass, then their median."""
            if not a.uncalibrated and all(r.meta.get("workload_seconds") for r in raws):
                raws = [r.calibrated(r.meta["workload_seconds"][ref]) for r in raws]  # keeps the device timings
            pooled = Profile.combined(raws)
            cl, how = cluster_in, "matmul (probe)" if source == "probed" else "yaml"
            if source == "probed" and pooled.meta.get("workload_seconds") and a.speeds != "matmul":
                combine = a.speeds == "combined"
                cl = _probed_cluster(yaml_cluster, probed_path, ref, pooled, combine=combine)
                how = "workload x matmul (geometric mean)" if combine else "workload"
            return pooled, cl, how

        n_profiles = a.repeats if a.reprofile else 1
        raw, latency_emulated = run_profile(0)
        raws = [raw]
        if not latency_emulated and source == "yaml":
            cluster = _without_latency(cluster)
        base = cluster  # as probed (or the YAML): the device speeds of `prepared` replace its throughputs
        profile, plan_cluster, speed_source = prepared(raws, base)
        log(f"device speeds ({speed_source}): {[round(plan_cluster.speed(i), 3) for i in range(len(plan_cluster))]}; "
            f"layer times scaled by {profile.meta.get('fwd_bwd_scale', 1.0):.3f}")
        os.makedirs(ARTIFACTS, exist_ok=True)  # what the predictions were made from, and the runs, for inspection
        for old in glob.glob(os.path.join(ARTIFACTS, "*[0-9].json")):  # an earlier benchmark's runs
            os.remove(old)
        plan = solve("dp", profile, plan_cluster, None, a.micro_batches)
        plan.save(plan_path)
        log(f"dp plan: boundaries {plan.boundaries} mapping {plan.rank_mapping} "
            f"predicted {plan.predicted_step_time * 1e3:.1f} ms")
        runs: Dict[str, List[Dict[str, Any]]] = {"default": [], "planned": []}
        for rep in range(a.repeats):
            if 0 < rep < n_profiles:  # profile again before each pair: the same stretch of load as the runs
                raws.append(run_profile(rep)[0])
            for which in ("default", "planned"):
                out = os.path.join(ARTIFACTS, f"{which}{rep}.json")  # kept: per-rank instruction times
                extra = ["--plan", plan_path] if which == "planned" else ["--stages", str(a.default_stages)]
                log(f"run {rep + 1}/{a.repeats}: {which}")
                _emulate(spec, timer + ["train", "--out", out, "--steps", str(a.steps), "--warmup", str(a.warmup),
                                        "--breakdown"] + model + extra, a.timeout, f"{which}{rep}", steal,
                         cpu_budget=a.cpu_budget)
                with open(out) as f:
                    runs[which].append(json.load(f))
                log(f"  {which}: median step {runs[which][-1]['median_step_ms']:.1f} ms")
        first_profile = (profile, plan_cluster)  # what the plan was made from
        cluster = plan_cluster
        if len(raws) > 1:  # --reprofile: predictions from every profile taken
            profile, cluster, speed_source = prepared(raws, base)
        profile.save(os.path.join(ARTIFACTS, "profile.json"))
        cluster.save(os.path.join(ARTIFACTS, "cluster.yaml"))
    measured = {k: median([r["median_step_ms"] for r in v]) for k, v in runs.items()}

    def predict(prof, cl):  # on the parts / mapping the runs really used: the replay of DeepSpeed's schedule
        return {k: replay(prof, cl, v[-1]["parts"], v[-1]["rank_mapping"], a.micro_batches).step_time * 1e3
                for k, v in runs.items()}

    cbs = {k: evaluate(profile, cluster, v[-1]["parts"], v[-1]["rank_mapping"], a.micro_batches) for k, v in runs.items()}
    predicted = predict(profile, cluster)
    tails = {k: cb.tail_time * 1e3 for k, cb in cbs.items()}
    stages = {k: stage_comparison(cbs[k], [r.get("breakdown_ms") for r in runs[k]], a.micro_batches) for k in runs}
    first = predict(*first_profile) if len(raws) > 1 else None
    err = max(abs(predicted[k] - measured[k]) / measured[k] for k in measured)
    result = {
        "default_ms": round(measured["default"], 2),
        "planned_ms": round(measured["planned"], 2),
        "speedup": round(measured["default"] / measured["planned"], 3),
        "predicted_default_ms": round(predicted["default"], 2),
        "predicted_planned_ms": round(predicted["planned"], 2),
        "prediction_error": round(err, 3),
        # the closed form the dp solver optimises (cost.evaluate), beside the replay the predictions come from
        "analytic_default_ms": round(cbs["default"].step_time * 1e3, 2),
        "analytic_planned_ms": round(cbs["planned"].step_time * 1e3, 2),
        "profiles": len(raws),
        # with --reprofile: the same predictions from the first profile alone (the one the plan was made from)
        **({"first_profile_prediction_error": round(max(abs(first[k] - measured[k]) / measured[k] for k in measured),
                                                    3)} if first else {}),
        **{k: {"parts": v[-1]["parts"], "rank_mapping": v[-1]["rank_mapping"],
               "runs_ms": [round(r["median_step_ms"], 1) for r in v],
               "predicted_tail_ms": round(tails[k], 2), "stages": stages[k]} for k, v in runs.items()},
        "profile_fwd_bwd_ms": round(float(profile.arrays()["fwd_bwd"].sum()) * 1e3, 2),
        "profile_update_ms": round(float(profile.arrays()["update"].sum()) * 1e3, 2),
        "profile_p2p_ms": [round(l.p2p * 1e3, 3) for l in profile.layers],
        "profile_scale": round(float(profile.meta.get("fwd_bwd_scale", 1.0)), 3),
        "latency_emulated": latency_emulated,
        "cluster_source": source,
        "speed_source": speed_source,
        "speeds": [round(cluster.speed(i), 3) for i in range(len(cluster))],
        "probe_matmul_speeds": probed,
        "engine_micro_batch_ms": round(profile.engine_micro_batch * 1e3, 3),
        "engine_step_ms": round(profile.engine_step * 1e3, 3),
        "cluster": os.path.relpath(a.cluster, ROOT) if a.cluster.startswith(ROOT) else a.cluster,
        "micro_batches": a.micro_batches, "steps": a.steps, "repeats": a.repeats,
        "cpu_budget": round(a.cpu_budget if a.cpu_budget is not None else default_cpu_budget(), 3),
        # the hypervisor's share of the CPU during probe, profile and each training run: where it is high the
        # devices did not get their quotas and the emulated speeds drifted (docs/placement.md)
        "host_steal": {k: None if f is None else round(f, 3) for k, f in steal.items()},
    }
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
