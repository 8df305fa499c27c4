"""`pdv bench faults --json`: a host lost for good in the middle of a run, on this machine, under torchrun.

Two torchrun agents stand for two hosts (`PDV_HOST` hostA and hostB, `--nnodes 1:2`, c10d rendezvous, two
workers each: pipe 2 x data 2 of `faults_job.py`). At `--lose-at` (default a third of the run) host B's agent
and workers are killed and its memory (its snapshot folder) wiped; agent A restarts its workers in a world of
two (pipe 2 x data 1). Three ways, one job:

- `reference`: no failure, but the same switch of plan at the same step (the step the recovered run resumed
  from, so both compute every later step under the same plan): 4 workers to the step, a disk
  checkpoint, 2 workers from it (what recovery should equal);
- `recovered`: pdv's in-memory snapshots (every step, in the background), the host lost;
- `disk_restart`: what a user has without them: a disk checkpoint every `--ckpt-every` steps, the host lost,
  the survivors restarted from the newest checkpoint (the same torchrun restart).

Figures: `completed`, `steps_lost` (steps trained twice), `recovery_s` (the kill to the first step finished
after it) with its parts (`restart_s`: the kill to the new workers' start, detection and rendezvous included;
`startup_s`: their imports and engine; `state_load_s`: the resume; `first_step_s`), `held_out_vs_reference`
(relative difference of the held-out loss at the end), `recovered_vs_disk_restart` (wall time, the first
agent's start to the end), `snapshot_overhead` (mean step with snapshots before the loss, after the first 4,
over the disk run's, less 1: a snapshot that holds a later step up counts; `snapshot_overhead_median` the
same of the medians; `snapshot_setup_s` what the first 4 steps took more: the snapshots' one-time set-up;
`snapshot_overhead_after` the same of the median steps after the loss, the first 4 apart: the survivors' steps;
`startup_extra_s` how much later the recovered run's first step ended after its workers started: what the
snapshots' and in-place recovery's set-up cost at the start; per way `step_s_after`, `first_step_at_s`). A CPU machine's figures; the same job on GPUs is not measured.

`--scenario FILE` (root): a fault scenario (`launch/scenarios/host_loss.yaml`, `device_loss.yaml`: a cluster, a
run shape, one fault at a training step) on the emulated cluster instead: each way is a `pdv emulate --elastic`
run of the same job (a torchrun agent per device; `reference` is two runs, the second on the survivors'
cluster from the first's disk checkpoint), and the figures are read from a device that survives.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from ..spawn import default_env, free_port, kill_matching, remove_deepspeed_shm
from .common import check_ranges, emit, log, median_item, parser, ready_jit_ops

RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2"
WARMUP = 4  # the first steps of a run, apart in the step-time figures (start-up, the first snapshots' set-up)


def _env() -> Dict[str, str]:
    return {**os.environ, **default_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _torchrun(nnodes: str, nproc: int, port: int, run_id: str, job: List[str]) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
            "--monitor-interval=0.5", f"--rdzv-conf={RDZV_CONF}", "-m", "pdv_ext.bench.faults_job", *job]


def _read(out: str) -> Dict[str, List[Dict[str, Any]]]:
    logs = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".jsonl"):
            with open(os.path.join(out, name), encoding="utf-8") as f:
                logs[name[:-6]] = [json.loads(line) for line in f if line.strip()]
    return logs


def _lost_host(work: str, name: str, mode: str, steps: int, lose_at: int, ckpt_every: int, hidden: int,
               sleep: float, timeout: float, every: str = "1") -> Dict[str, Any]:
    """Two agents, host B lost after step `lose_at`; returns the logs, the kill time and the wall time."""
    out, root = os.path.join(work, name), os.path.join(work, f"{name}-root")
    os.makedirs(out)
    port = free_port()
    job = ["--out", out, "--root", root, "--mode", mode, "--steps", str(steps), "--ckpt-every", str(ckpt_every),
           "--hidden", str(hidden), "--sleep", str(sleep), "--every", every]
    env, agents, t_kill = _env(), {}, None
    t0 = time.time()
    try:
        for host in ("hostA", "hostB"):  # A first: its agent hosts the rendezvous store
            agents[host] = subprocess.Popen(_torchrun("1:2", 2, port, name, job + ["--host-tag", f"{name}-{host}"]),
                                            env={**env, "PDV_HOST": host}, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True, start_new_session=True)
            time.sleep(2)
        deadline = time.time() + timeout
        while time.time() < deadline and t_kill is None:
            for lines in _read(out).values():
                if any(e.get("step") == lose_at for e in lines if e.get("attempt") == 0):
                    kill_matching(f"--host-tag {name}-hostB")  # its agent, its workers ...
                    t_kill = time.time()
                    shutil.rmtree(os.path.join(root, "bench-faults", "hostB"), ignore_errors=True)  # ... its memory
                    break
            time.sleep(0.02)
        if t_kill is None:
            raise RuntimeError(f"{name}: host B never reached step {lose_at}")
        _, err = agents["hostA"].communicate(timeout=max(deadline - time.time(), 1))
        if agents["hostA"].returncode != 0:
            raise RuntimeError(f"{name}: host A's agent exited with {agents['hostA'].returncode}: {err[-2000:]}")
    finally:
        kill_matching(out)
        for p in agents.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    return {"logs": _read(out), "t_kill": t_kill, "wall_s": time.time() - t0}


def _reference(work: str, steps: int, lose_at: int, hidden: int, sleep: float, timeout: float) -> Dict[str, Any]:
    """4 workers to step `lose_at`, a disk checkpoint, then 2 workers from it: the same switch of plan without a
    failure."""
    out, root = os.path.join(work, "reference"), os.path.join(work, "reference-root")
    os.makedirs(out)
    env = {**_env(), "PDV_HOST": "hostA"}
    base = ["--out", out, "--root", root, "--mode", "none", "--steps", str(steps), "--hidden", str(hidden),
            "--sleep", str(sleep), "--host-tag", "reference"]
    t0 = time.time()
    try:
        for nproc, extra in ((4, ["--save-at", str(lose_at)]), (2, ["--load", root])):
            p = subprocess.run(_torchrun("1", nproc, free_port(), f"reference{nproc}", base + extra), env=env,
                               capture_output=True, text=True, timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"reference on {nproc} workers exited with {p.returncode}: {p.stderr[-2000:]}")
    finally:
        kill_matching(out)
    return {"logs": _read(out), "wall_s": time.time() - t0}


def _summary(run: Dict[str, Any], steps: int) -> Dict[str, Any]:
    """One lost-host run's figures (from host A's rank-0 log)."""
    lines = run["logs"]["hostA-rank0"]
    starts = [e for e in lines if "start" in e]
    last_attempt = starts[-1]["attempt"]
    trained = [e["step"] for e in lines if "step" in e]
    after = [e for e in lines if "step" in e and e["attempt"] == last_attempt]
    done_before = max([e["step"] for e in lines if "step" in e and e["attempt"] < last_attempt], default=0)
    resumed_at = starts[-1]["start"]
    held = [e["held_out"] for e in lines if "held_out" in e]
    t_kill, first = run["t_kill"], after[0]["t"] if after else None
    out = {"completed": bool(trained) and max(trained) == steps and bool(held), "world_after": starts[-1]["world"],
           "resumed_at": resumed_at, "steps_lost": max(done_before - resumed_at, 0),
           "held_out": held[-1] if held else None, "wall_s": round(run["wall_s"], 2)}
    if first is not None and t_kill is not None:
        s = starts[-1]
        out["recovery_s"] = round(first - t_kill, 2)
        if s.get("in_place"):  # the survivors went on in their processes: no restart, no start-up
            out["in_place"] = True
            out["recovery_parts_s"] = {"detection": round(s["t_process"] - t_kill, 2),
                                       "agreement": round(s["parts"]["agree_s"], 2),
                                       "group_and_engine": round(s["parts"]["group_s"] + s["parts"]["engine_s"], 2),
                                       "state_load": round(s["resume_s"], 2),
                                       "first_step": round(first - s["t_ready"] - s["resume_s"], 2)}
        else:
            out["recovery_parts_s"] = {"restart": round(s["t_process"] - t_kill, 2),
                                       "startup": round(s["t_ready"] - s["t_process"], 2),
                                       "state_load": round(s["resume_s"], 2),
                                       "first_step": round(first - s["t_ready"] - s["resume_s"], 2)}
    intervals = [e["snapshot"]["interval"] for e in lines if "snapshot" in e and e["attempt"] == 0]
    if intervals:  # the snapshots' spacing before the loss (every: auto chooses it)
        out["snapshot_interval"] = statistics.median(intervals)
    before = [e["t"] for e in lines if "step" in e and e["attempt"] == 0]
    gaps = [b - a for a, b in zip(before, before[1:])]
    out["step_s_before"] = statistics.median(gaps) if len(before) > 2 else None
    # the mean as well (a snapshot that makes a later step wait shows there, not in the median), after the
    # first WARMUP steps; those apart: what they took (the snapshots' one-time set-up shows there)
    out["mean_step_s_before"] = statistics.fmean(gaps[WARMUP:]) if len(gaps) > WARMUP + 1 else None
    out["warmup_s"] = sum(gaps[:WARMUP]) if len(gaps) > WARMUP + 1 else None
    # after the loss, from the WARMUP-th step of the last attempt: what the snapshots cost on the survivors
    # (a recovered run keeps snapshotting; a disk run does not), and when the first step ended after the start
    done = [e["t"] for e in after]
    gaps_after = [b - a for a, b in zip(done, done[1:])][WARMUP:]
    out["step_s_after"] = statistics.median(gaps_after) if len(gaps_after) > 2 else None
    first_try = [e["t"] for e in lines if "step" in e and e["attempt"] == starts[0]["attempt"]]
    out["first_step_at_s"] = round(first_try[0] - starts[0]["t_process"], 2) if first_try else None
    return out


# ---------------------------------------------------------------------------------------------------
# on the emulated cluster (`--scenario`): the scenario's fault events played by `pdv emulate`
# ---------------------------------------------------------------------------------------------------
def _scenario(path: str):
    """The scenario's cluster, run shape and fault events (one clear error for anything else)."""
    from ..config_base import ConfigError
    from ..emulate.events import HostEvent, faults
    from .adapt import load_scenario

    sc, cluster, cluster_path, _, events = load_scenario(path, faults_ok=True)
    downs = [e for e in events if getattr(e, "fault", False) and e.down]
    if not faults(events) or len(downs) != 1 or len([e for e in events if getattr(e, "fault", False)]) != 1 \
            or not downs[0].by_step:
        raise ConfigError([f"{path}: events: a fault scenario has exactly one fault, a host or a device going down "
                           "at a training step (at_step / at_fraction)"])
    lost = downs[0]
    gone = {d.name for d in cluster.devices if isinstance(lost, HostEvent) and d.host == lost.host}
    gone |= {lost.device} if not isinstance(lost, HostEvent) else set()
    left = [i for i, d in enumerate(cluster.devices) if d.name not in gone]
    if sc.run.pipe * sc.run.data != len(cluster) or len(left) % sc.run.pipe or 12 % (len(left) // sc.run.pipe) \
            or 12 % sc.run.data:
        raise ConfigError([f"{path}: run: pipe {sc.run.pipe} x data {sc.run.data} on {len(cluster)} devices, "
                           f"{len(left)} left: the bench's job needs pipe x data = the devices, and the pipe "
                           "depth to divide the devices left, with 12 micro-batches a step over the replicas"])
    return sc, cluster_path, cluster, lost, left


def stacks_of(text: str, limit: int = 20000) -> str:
    """The ranks' stacks in a run's output (`pdv emulate` asks for them when the run times out), for the
    error: where each rank waited. Empty when there are none."""
    keep = [ln for ln in text.splitlines() if "Thread 0x" in ln or "Current thread" in ln or 'File "' in ln]
    return "\n--- the ranks' stacks (run timed out) ---\n" + "\n".join(keep)[-limit:] if keep else ""


def _emulate(work: str, name: str, cluster_path: str, events: Optional[str], job: List[str],
             timeout: float, startup_on_host: bool = True) -> Dict[str, Any]:
    """One `pdv emulate` run of faults_job.py; its logs, the fault's wall time and the run's wall time."""
    out = os.path.join(work, name)
    os.makedirs(out)
    ev_log = os.path.join(work, f"{name}-events.jsonl")
    cmd = [sys.executable, "-m", "pdv_ext.cli", "emulate", "--cluster", cluster_path, "--timeout", str(timeout),
           "--events-log", ev_log, "--elastic"] + (["--events", events] if events else []) + \
        (["--startup-on-host"] if startup_on_host else []) + \
        ["--", sys.executable, "-m", "pdv_ext.bench.faults_job", "--out", out, *job]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    wall = time.time() - t0
    if p.returncode != 0:
        text = p.stdout + p.stderr
        kept = _keep_output(name, text)
        raise RuntimeError(f"{name}: pdv emulate exited with {p.returncode} (its whole output: {kept}): "
                           f"{text[-3000:]}{stacks_of(text)}")
    rows = []
    if os.path.exists(ev_log):
        with open(ev_log, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    t_kill = next((r["wall"] for r in rows if r.get("applied") and r.get("after") == {"down": True}), None)
    return {"logs": _read(out), "t_kill": t_kill, "wall_s": wall, "text": p.stdout + p.stderr}


def _keep_output(name: str, text: str) -> str:
    """The whole of a run's output (every rank's lines) in a file that outlives the bench's work folder."""
    kept = os.path.join(tempfile.gettempdir(), f"pdv-bench-faults-{name}-{os.getpid()}.log")
    with open(kept, "w", encoding="utf-8") as f:
        f.write(text)
    return kept


def _survivor_summary(run: Dict[str, Any], steps: int, device: str) -> Dict[str, Any]:
    """`_summary` from a device that was never lost (its log holds every attempt)."""
    return _summary({**run, "logs": {"hostA-rank0": run["logs"][device]}}, steps)


def run_scenario(path: str, steps: Optional[int], timeout: float, only: List[str], hidden: int,
                 out: Optional[str] = None, every: str = "1", startup_on_host: bool = True,
                 in_place_timeout: Optional[float] = None, layout: str = "stages", repeats: int = 1) -> Dict[str, Any]:
    """Every way of the scenario in one job. `startup_on_host`: the workers' start-up (imports, rendezvous,
    the model) runs on their host's CPU, as on real hosts, not under a slow device's quota (`pdv emulate
    --startup-on-host`), in every way alike. `in_place_timeout`: the recovered way recovers in place, and
    every way's process groups time out after that many seconds. `layout`: faults_job.py's `--layout`, where a
    stage's replicas run (a snapshot crosses the link between hosts only for a stage all of whose replicas
    share a host). `repeats`: the recovered and disk ways alternate that many rounds (this machine's speed
    drifts between runs by as much as the targets allow) and the headline figures are the rounds' medians
    (`_median_rounds`); the reference runs once per step the rounds resumed from."""
    sc, cluster_path, cluster, lost, left = _scenario(path)
    steps = steps or sc.run.steps
    lose_at = lost.at_step
    if not 0 < lose_at < steps:
        from ..config_base import ConfigError

        raise ConfigError([f"{path}: the fault at step {lose_at} is not inside a run of {steps} steps"])
    watch = cluster.devices[left[0]].name
    work = tempfile.mkdtemp(prefix="pdv-bench-faults-")
    res: Dict[str, Any] = {"scenario": os.path.basename(path), "steps": steps, "lose_at": lose_at,
                           "lost": lost.target, "devices_left": len(left), "pipe": sc.run.pipe,
                           "snapshot_every": every, "startup_on_host": startup_on_host,
                           "in_place": in_place_timeout is not None, "layout": layout,
                           "rank_mapping": layout_names(cluster, sc.run.pipe, layout), "repeats": repeats}
    base = ["--steps", str(steps), "--pipe", str(sc.run.pipe), "--hidden", str(hidden), "--layout", layout] + \
        (["--pg-timeout", str(in_place_timeout)] if in_place_timeout is not None else [])
    rounds: List[Dict[str, Any]] = []
    series: List[Dict[str, Any]] = []
    try:
        ev = os.path.join(work, "events.yaml")
        with open(ev, "w", encoding="utf-8") as f:
            kind = "host" if hasattr(lost, "host") else "device"
            f.write(f"- {{at_step: {lose_at}, {kind}: {lost.target}, down: true}}\n")
        for r in range(repeats):
            rnd: Dict[str, Any] = {}
            series.append({})
            for kind, mode in (("recovered", "snapshots"), ("disk_restart", "disk")):
                if kind in only:
                    name = kind if r == 0 else f"{kind}-{r + 1}"
                    log(f"[bench faults] {kind}" + (f", round {r + 1} of {repeats}" if repeats > 1 else "") +
                        f": {lost.target} lost after step {lose_at}")
                    run = _emulate(work, name, cluster_path, ev,
                                   base + ["--root", os.path.join(work, f"{name}-root"), "--mode", mode,
                                           "--every", every]
                                   + (["--in-place"] if kind == "recovered" and in_place_timeout is not None else []),
                                   timeout, startup_on_host)
                    rnd[kind] = _survivor_summary(run, steps, watch)
                    if kind == "recovered" and in_place_timeout is not None and not rnd[kind].get("in_place"):
                        rnd[kind]["output"] = _keep_output(name, run["text"])  # restarted instead: why is in there
                        log(f"[bench faults] recovered: not in place (restarted); its whole output: "
                            f"{rnd[kind]['output']}")
                    series[r][kind] = _series(run["logs"][watch], run["t_kill"])
            rounds.append(rnd)
        if "reference" in only:
            refs: Dict[int, Dict[str, Any]] = {}
            for at in sorted({_switch_step(rnd, lose_at) for rnd in rounds}):
                log(f"[bench faults] reference: {len(cluster)} devices to step {at}, a disk checkpoint, "
                    f"{len(left)} devices from it")
                ckpt = os.path.join(work, f"reference-ckpt-{at}")
                first = _emulate(work, f"reference-{at}", cluster_path, None,
                                 base + ["--root", ckpt, "--mode", "none", "--save-at", str(at)], timeout,
                                 startup_on_host)
                sub = os.path.join(work, "survivors.yaml")
                cluster.subset(left, source="survivors").save(sub)
                second = _emulate(work, f"reference2-{at}", sub, None,
                                  base + ["--root", ckpt, "--mode", "none", "--load", ckpt], timeout, startup_on_host)
                held = [e["held_out"] for e in second["logs"][watch] if "held_out" in e]
                refs[at] = {"held_out": held[-1] if held else None, "switch_at": at,
                            "wall_s": round(first["wall_s"] + second["wall_s"], 2)}
            for rnd in rounds:
                rnd["reference"] = refs[_switch_step(rnd, lose_at)]
        for rnd in rounds:
            _combine(rnd)
        median = _median_rounds(res, rounds)
        _write_out(res, series[median], out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


#: the rounds' figures that `--repeats` reports as their medians
ROUND_FIGURES = ("recovered_vs_disk_restart", "snapshot_overhead", "snapshot_overhead_median",
                 "snapshot_overhead_after", "snapshot_setup_s", "startup_extra_s", "recovery_s")


def _median_rounds(res: Dict[str, Any], rounds: List[Dict[str, Any]]) -> int:
    """Fill `res` (in place) from the rounds' combined figures: each of ROUND_FIGURES the median over the
    rounds, `completed` only when every round completed, `steps_lost` and `held_out_vs_reference` the worst
    round's; the ways' own summaries and the recovery's parts are the median round's (the one whose
    `recovered_vs_disk_restart` is the median, the lower of the two middle ones of an even count; rounds
    without the ratio sort last). With more than one round,
    `rounds` lists each round's figures. Returns the median round's index."""
    mid = median_item(range(len(rounds)), lambda i: rounds[i].get("recovered_vs_disk_restart"))
    res.update(rounds[mid])
    for k in ROUND_FIGURES:
        vals = [rnd[k] for rnd in rounds if rnd.get(k) is not None]
        if vals:
            res[k] = round(statistics.median(vals), 4)
    if any("completed" in rnd for rnd in rounds):
        res["completed"] = all(rnd.get("completed", False) for rnd in rounds)
        res["steps_lost"] = max(rnd.get("steps_lost", 0) for rnd in rounds)
    held = [rnd["held_out_vs_reference"] for rnd in rounds if rnd.get("held_out_vs_reference") is not None]
    if held:
        res["held_out_vs_reference"] = max(held)
    if len(rounds) > 1:
        res["median_round"] = mid + 1
        res["rounds"] = [{k: rnd.get(k) for k in ("completed", "steps_lost", "held_out_vs_reference", *ROUND_FIGURES)}
                         | {"recovered_wall_s": (rnd.get("recovered") or {}).get("wall_s"),
                            "disk_restart_wall_s": (rnd.get("disk_restart") or {}).get("wall_s")}
                         for rnd in rounds]
    return mid


def layout_names(cluster: Any, pipe: int, layout: str) -> List[List[str]]:
    """faults_job.py's rank mapping of `layout` on the whole cluster, by device name (what the JSON reports)."""
    from .faults_job import arrange

    return arrange([d.name for d in sorted(cluster.devices, key=lambda d: (d.host, d.name))], pipe, layout)


GLOBAL_BATCH = 96  # faults_job.py's samples a step (12 micro-batches of 8)


def _series(lines: List[Dict[str, Any]], t_kill: Optional[float]) -> Dict[str, Any]:
    """One way's steps over time, for `pdv plot faults`: each finished step's wall time and attempt, the
    first start, the kill (None: no failure)."""
    starts = [e["t_process"] for e in lines if "start" in e]
    steps = [e for e in lines if "step" in e]
    return {"start": min(starts) if starts else (steps[0]["t"] if steps else 0.0), "t_kill": t_kill,
            "t": [e["t"] for e in steps], "step": [e["step"] for e in steps], "attempt": [e["attempt"] for e in steps]}


def _combine(res: Dict[str, Any]) -> None:
    """The headline figures from the ways' summaries (in place)."""
    rec, disk = res.get("recovered"), res.get("disk_restart")
    if rec:
        res.update({k: rec[k] for k in ("completed", "steps_lost") if k in rec})
        res["recovery_s"], res["recovery_parts_s"] = rec.get("recovery_s"), rec.get("recovery_parts_s")
        ref = (res.get("reference") or {}).get("held_out")
        if ref and rec["held_out"] is not None:
            res["held_out_vs_reference"] = abs(rec["held_out"] / ref - 1.0)
    if rec and disk:
        res["recovered_vs_disk_restart"] = round(rec["wall_s"] / disk["wall_s"], 4)
        if rec.get("mean_step_s_before") and disk.get("mean_step_s_before"):  # every wait counted
            res["snapshot_overhead"] = round(rec["mean_step_s_before"] / disk["mean_step_s_before"] - 1.0, 4)
            res["snapshot_setup_s"] = round(rec["warmup_s"] - disk["warmup_s"], 2)
        if rec["step_s_before"] and disk["step_s_before"]:
            res["snapshot_overhead_median"] = round(rec["step_s_before"] / disk["step_s_before"] - 1.0, 4)
        if rec.get("step_s_after") and disk.get("step_s_after"):  # the survivors' steps (medians)
            res["snapshot_overhead_after"] = round(rec["step_s_after"] / disk["step_s_after"] - 1.0, 4)
        if rec.get("first_step_at_s") is not None and disk.get("first_step_at_s") is not None:
            res["startup_extra_s"] = round(rec["first_step_at_s"] - disk["first_step_at_s"], 2)


def _switch_step(res: Dict[str, Any], lose_at: int) -> int:
    """Where the reference switches plans: where the recovered run did (the step it resumed from), so that
    the two compute every later step under the same plan; the fault's step without a recovered run."""
    rec = res.get("recovered") or {}
    return int(rec["resumed_at"]) if rec.get("resumed_at") else lose_at


def _write_out(res: Dict[str, Any], series: Dict[str, Any], out: Optional[str]) -> None:
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump({**res, "global_batch": GLOBAL_BATCH, "series": series}, f, indent=1)
        log(f"[bench faults] wrote {out} (pdv plot faults {out})")


def main(argv: Optional[List[str]] = None) -> int:
    ap = parser("faults", __doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 90; a scenario's run.steps)")
    ap.add_argument("--lose-at", type=int, default=None, help="the step after which host B is lost (default a third)")
    ap.add_argument("--ckpt-every", type=int, default=25, help="disk_restart: a checkpoint every N steps")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--every", default="1", help="recovered: pdv.snapshots.every (steps, or auto; default 1)")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds added to each step (a slower job)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--only", default="reference,recovered,disk_restart")
    ap.add_argument("--quick", action="store_true", help="12 steps, host B lost after step 4")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="also write the result with each way's steps over time to FILE (for `pdv plot faults`)")
    ap.add_argument("--scenario", default=None, metavar="FILE",
                    help="a fault scenario (launch/scenarios/host_loss.yaml, device_loss.yaml) on the emulated "
                         "cluster (root): its fault played by `pdv emulate`; --steps overrides its run's steps")
    ap.add_argument("--in-place", action="store_true",
                    help="--scenario: the recovered way recovers in place (pdv.snapshots.in_place: the survivors "
                         "go on in their processes, no torchrun restart); every way's process groups time out "
                         "after --pg-timeout")
    ap.add_argument("--pg-timeout", type=float, default=60.0,
                    help="--scenario --in-place: seconds a collective waits for a silent peer (default 60)")
    ap.add_argument("--layout", choices=["stages", "pipelines"], default="stages",
                    help="--scenario: where a stage's replicas run, by the devices' hosts: stages (default, "
                         "DeepSpeed's rank order: a stage's replicas side by side on one host, so each snapshot of "
                         "a stage crosses the link between hosts) or pipelines (each host runs whole pipelines: a "
                         "lost host leaves a whole copy of the model and no snapshot crosses that link, but the "
                         "gradient reduction does)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--scenario: the recovered and disk ways alternate this many rounds; the figures are the "
                         "rounds' medians (what must hold in every round: the worst), each round under `rounds`")
    ap.add_argument("--startup-on-device", action="store_true",
                    help="--scenario: run the workers' start-up under their device's CPU quota too (before "
                         "2026-11-28; default: on their host's CPU, `pdv emulate --startup-on-host`)")
    args = ap.parse_args(argv)
    if args.every != "auto" and not (args.every.isdigit() and int(args.every) >= 1):
        ap.error(f"--every {args.every!r}: a number of steps >= 1, or auto")
    if args.in_place and not args.scenario:
        ap.error("--in-place: needs --scenario (the emulated cluster: one torchrun agent per device, which a lost "
                 "device takes with it, so the survivors' agents leave their workers running)")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1 (got {args.repeats})")
    if args.repeats > 1 and not args.scenario:
        ap.error("--repeats: needs --scenario (the two-host run on this machine is one round)")
    if not (math.isfinite(args.pg_timeout) and args.pg_timeout > 0):
        ap.error(f"--pg-timeout must be a number of seconds > 0 (got {args.pg_timeout:g})")
    if args.scenario:
        from ..config_base import ConfigError
        from ..emulate.launcher import EmulationUnavailable, check_available

        kinds = [k.strip() for k in args.only.split(",") if k.strip()]
        try:
            check_available()  # not root, or no netns / tc / cgroups: one line now, not a failure per way later
            ready_jit_ops()  # not inside the first way's start-up
            res = run_scenario(args.scenario, args.steps, args.timeout, kinds, args.hidden, args.out, args.every,
                               not args.startup_on_device, args.pg_timeout if args.in_place else None, args.layout,
                               args.repeats)
        except ConfigError as exc:
            for line in exc.errors:
                print(f"pdv bench faults: {line}", file=sys.stderr)
            return 2
        except EmulationUnavailable as exc:
            print(f"pdv bench faults: {exc}", file=sys.stderr)
            return 2
        emit(res, args.json)
        return 0
    args.steps = args.steps or 90
    if args.quick:
        args.steps, args.lose_at, args.ckpt_every = 12, 4, 3
    lose_at = args.lose_at if args.lose_at is not None else args.steps // 3
    check_ranges(ap, args, {"--steps": 3, "--ckpt-every": 1, "--hidden": 1}, ["--timeout"])
    if not (math.isfinite(args.sleep) and args.sleep >= 0):
        ap.error(f"--sleep must be a finite number >= 0 (got {args.sleep:g})")
    if not 0 < lose_at < args.steps:
        ap.error(f"--lose-at {lose_at}: must fall inside the run (1 .. {args.steps - 1})")
    kinds = [k.strip() for k in args.only.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("reference", "recovered", "disk_restart")]
    if bad:
        ap.error(f"--only: unknown {', '.join(bad)} (reference, recovered, disk_restart)")
    ready_jit_ops()  # not inside the first way's start-up
    work = tempfile.mkdtemp(prefix="pdv-bench-faults-")
    res: Dict[str, Any] = {"steps": args.steps, "lose_at": lose_at, "ckpt_every": args.ckpt_every,
                           "snapshot_every": args.every}
    runs: Dict[str, Any] = {}
    try:
        series: Dict[str, Any] = {}
        for kind, mode in (("recovered", "snapshots"), ("disk_restart", "disk")):
            if kind in kinds:
                log(f"[bench faults] {kind}: two hosts, host B lost after step {lose_at}")
                runs[kind] = _lost_host(work, kind, mode, args.steps, lose_at, args.ckpt_every, args.hidden,
                                        args.sleep, args.timeout, args.every)
                res[kind] = _summary(runs[kind], args.steps)
                series[kind] = _series(runs[kind]["logs"]["hostA-rank0"], runs[kind]["t_kill"])
        if "reference" in kinds:
            at = _switch_step(res, lose_at)
            log(f"[bench faults] reference: 4 workers to step {at}, a disk checkpoint, 2 workers from it")
            runs["reference"] = _reference(work, args.steps, at, args.hidden, args.sleep, args.timeout)
            ref = runs["reference"]["logs"]["hostA-rank0"]
            res["reference"] = {"held_out": [e["held_out"] for e in ref if "held_out" in e][-1], "switch_at": at,
                                "wall_s": round(runs["reference"]["wall_s"], 2)}
        _combine(res)
        _write_out(res, series, args.out)
    finally:
        for run in runs.values():  # DeepSpeed's CPU all-reduce workspaces of every attempt
            for port in {e["master"][1] for lines in run["logs"].values() for e in lines if e.get("master")}:
                remove_deepspeed_shm(port)
        shutil.rmtree(work, ignore_errors=True)
    emit(res, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
