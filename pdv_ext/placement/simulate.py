"""Step time of a plan by replaying DeepSpeed's own 1F1B instruction schedule (`TrainSchedule`).

The closed form of `cost.evaluate` treats every link as a pipeline resource that overlaps the devices'
work. DeepSpeed's pipeline engine does not overlap that freely: its sends and receives are blocking and
ordered within each schedule step - a stage sends the activation of a forward pass only in its next
(backward) step, after it has received the gradient it waits for - so on a slow link a round trip
(gradient back, next activation forward) sits inside the steady-state cycle. On the emulated benchmark
cluster that cycle, not the slowest stage, set the step of a plan whose stages straddle the 100 Mbit/s
link (2026-11-25: 456 ms traced against 361 ms from the closed form).

The replay runs every (replica, stage) pair as one actor on its own device, through the instruction list
DeepSpeed's `TrainSchedule` gives that stage, in time order (always the actor furthest behind that can move):
- ForwardPass / BackwardPass: the stage's layers' `fwd` / `fwd_bwd - fwd` on the actor's device (a third /
  two thirds where the profile did not time the forward alone), each with half of the engine's
  per-micro-batch work (`Profile.engine`),
- SendActivation / SendGrad: the device's half of the message work (`p2p / 2`); the message waits for its
  link's previous message to leave, then arrives a latency + bytes / bandwidth later. Messages between the
  same two hosts queue on one link (the emulator shapes one uplink per host pair; a NIC does the same), so
  replicas that run out of step share it only when their messages really meet,
- RecvActivation / RecvGrad: waits for the matching message (the k-th receive on a channel takes its k-th
  send), then the device's half of the message work,
- after the pipeline: each stage's gradient reduction once all its replicas are done, then every device's
  parameter update; DeepSpeed's gradient clipping all-reduces the norm over all stages, so the step ends
  with the slowest update after the last reduction.

`schedule="gpipe"` replays the same instructions in GPipe's order instead (every micro-batch's forward,
then every backward), for the pictures of `pdv plan --plot --schedule gpipe`. With `keep_trace` the result
holds every instruction's span (`spans`) and every message's time on its link (`messages`): what
`placement.gantt` draws.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .cluster import Cluster
from .cost import stage_params
from .profile import Profile

FORWARD_SHARE = 1.0 / 3.0  # forward's share of forward + backward when the profile did not time it alone


@dataclass
class Message:
    """One activation ("act") or gradient ("grad") message of micro-batch `mb` from actor `src` (stage,
    replica) to actor `dst`: on its link from `wire_start` until `wire_end` (bytes / bandwidth; after the
    link's previous message left), received data available at `arrives` (+ latency)."""

    kind: str
    mb: int
    src: Tuple[int, int]
    dst: Tuple[int, int]
    wire_start: float
    wire_end: float
    arrives: float


@dataclass
class Replay:
    step_time: float
    pipeline_time: float                   # the last stage instruction's end (before reductions and updates)
    finish: List[float]                    # per stage: end of its last pipeline instruction
    tail: List[float]                      # per stage: reduction + update after it
    busy: List[float]                      # per stage: time in its own work (not waiting)
    trace: Optional[List[List[Tuple[str, float, float]]]] = field(default=None, repr=False)
    #: with keep_trace: [stage][replica] -> (instruction, micro-batch, start of its work, end), waits excluded
    spans: Optional[List[List[List[Tuple[str, int, float, float]]]]] = field(default=None, repr=False)
    messages: Optional[List[Message]] = field(default=None, repr=False)
    reduce: Optional[List[float]] = field(default=None, repr=False)   # per stage: its reduction's duration
    update: Optional[List[List[float]]] = field(default=None, repr=False)  # [stage][replica]: update duration
    reduced: float = 0.0                   # when the last reduction ends (every update starts then)
    schedule: str = "1f1b"


def _schedule(micro_batches: int, stages: int, stage_id: int) -> List[str]:
    """The stage's instruction names in order, from DeepSpeed's TrainSchedule (the engine's own schedule)."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    names = []
    for cmds in TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id).steps():
        names.extend(type(c).__name__ for c in cmds)
    return names


def _gpipe_schedule(micro_batches: int, stages: int, stage_id: int) -> List[str]:
    """GPipe's order of the same instructions: every micro-batch's forward, then every backward."""
    first, last = stage_id == 0, stage_id == stages - 1
    fwd = ([] if first else ["RecvActivation"]) + ["ForwardPass"] + ([] if last else ["SendActivation"])
    bwd = ([] if last else ["RecvGrad"]) + ["BackwardPass"] + ([] if first else ["SendGrad"])
    return fwd * micro_batches + bwd * micro_batches


SCHEDULES = {"1f1b": _schedule, "gpipe": _gpipe_schedule}


def replay(profile: Profile, cluster: Cluster, boundaries: Sequence[int], groups: Sequence[Sequence[int]],
           micro_batches: int, aggregator: str = "mean", keep_trace: bool = False, schedule: str = "1f1b") -> Replay:
    """Replay one training step of the plan (`boundaries`: DeepSpeed parts; `groups[s]`: stage s's devices,
    replica r of every stage forming pipeline r) under DeepSpeed's 1F1B schedule (or GPipe's order)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}' (one of {', '.join(SCHEDULES)})")
    arr = profile.arrays()
    n_st = len(groups)
    if list(boundaries)[0] != 0 or list(boundaries)[-1] != len(profile) or len(boundaries) != n_st + 1 \
            or any(b <= a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries {list(boundaries)} do not split {len(profile)} layers into {n_st} non-empty stages")
    width = len(groups[0])
    if any(len(g) != width for g in groups):
        raise ValueError(f"stage groups {[list(g) for g in groups]} differ in data-parallel width")
    sp = stage_params(cluster, groups, micro_batches, "1f1b", aggregator, profile.engine)
    fb = [float(arr["fwd_bwd"][boundaries[s]:boundaries[s + 1]].sum()) for s in range(n_st)]
    if np.all(arr["fwd"] > 0):
        fw = [float(arr["fwd"][boundaries[s]:boundaries[s + 1]].sum()) for s in range(n_st)]
    else:
        fw = [f * FORWARD_SHARE for f in fb]
    act = [float(arr["act_bytes"][boundaries[s + 1] - 1]) for s in range(n_st - 1)]
    p2p = [float(arr["p2p"][boundaries[s + 1] - 1]) for s in range(n_st - 1)]
    eng_mb, eng_step = profile.engine_micro_batch, profile.engine_step

    # one actor per (replica, stage), on its own device
    def dev(s, r):
        return groups[s][r]

    cost = {}
    for r in range(width):
        for s in range(n_st):
            v = cluster.speed(dev(s, r))
            m_in = p2p[s - 1] / v / 2 if s else 0.0
            m_out = p2p[s] / v / 2 if s < n_st - 1 else 0.0
            cost[(s, r)] = {"ForwardPass": (fw[s] + eng_mb / 2) / v, "BackwardPass": (fb[s] - fw[s] + eng_mb / 2) / v,
                            "RecvActivation": m_in, "SendGrad": m_in, "SendActivation": m_out, "RecvGrad": m_out}

    def wire(a: int, b: int):
        """(FIFO resource, latency, bandwidth) of the link from device a to device b: messages between the
        same two hosts queue on one resource (the emulator shapes one uplink per host pair, as a NIC would)."""
        ln = cluster.link(a, b)
        ha, hb = cluster.host_of(a), cluster.host_of(b)
        key = ("hosts", ha, hb) if ha != hb else ("devices", a, b)
        return key, ln.latency, ln.bandwidth

    free: Dict[tuple, float] = {}
    arrivals: Dict[tuple, List[float]] = {}
    taken: Dict[tuple, int] = {}
    actors = [(s, r) for r in range(width) for s in range(n_st)]
    progs = {a: SCHEDULES[schedule](micro_batches, n_st, a[0]) for a in actors}
    pc = {a: 0 for a in actors}
    clock = {a: 0.0 for a in actors}
    busy = {a: 0.0 for a in actors}
    trace = {a: [] for a in actors} if keep_trace else None
    spans = {a: [] for a in actors} if keep_trace else None
    messages: Optional[List[Message]] = [] if keep_trace else None
    done: Dict[tuple, int] = {}  # (actor, instruction) -> how many ran: the k-th of a kind is micro-batch k
    step_of = {"RecvActivation": -1, "RecvGrad": +1, "SendActivation": +1, "SendGrad": -1}

    def runnable(a) -> bool:
        name = progs[a][pc[a]]
        if not name.startswith("Recv"):
            return True
        chan = ((a[0] + step_of[name], a[1]), a)
        return taken.get(chan, 0) < len(arrivals.get(chan, []))

    # in time order: always the actor that can move and is furthest behind, so that the messages sharing a
    # link queue in the order they were sent (a blocked receive waits for a send at a later time)
    while True:
        ready = [a for a in actors if pc[a] < len(progs[a]) and runnable(a)]
        if not ready:
            break
        a = min(ready, key=lambda x: clock[x])
        s, r = a
        name, t = progs[a][pc[a]], clock[a]
        if name.startswith("Recv"):
            chan = ((s + step_of[name], r), a)
            start = max(t, arrivals[chan][taken.get(chan, 0)])
            taken[chan] = taken.get(chan, 0) + 1
        elif name.startswith("Send"):
            peer = (s + step_of[name], r)
            key, lat, bw = wire(dev(s, r), dev(*peer))
            nbytes = act[min(s, peer[0])]
            start = max(t, free.get(key, 0.0))  # waits for the link's previous message to leave
            free[key] = start + nbytes / bw
            arrivals.setdefault((a, peer), []).append(start + nbytes / bw + lat)
            if messages is not None:
                messages.append(Message("act" if name == "SendActivation" else "grad", done.get((a, name), 0), a,
                                        peer, start, start + nbytes / bw, start + nbytes / bw + lat))
        else:
            start = t
        end = start + cost[a].get(name, 0.0)
        busy[a] += end - start
        if trace is not None:
            trace[a].append((name, t, end))
            spans[a].append((name, done.get((a, name), 0), start, end))
        done[(a, name)] = done.get((a, name), 0) + 1
        clock[a] = end
        pc[a] += 1
    if any(pc[a] < len(progs[a]) for a in actors):
        raise RuntimeError("schedule replay deadlocked (a receive without its send): a bug")
    params = [float(arr["param_bytes"][boundaries[s]:boundaries[s + 1]].sum()) for s in range(n_st)]
    upd = [float(arr["update"][boundaries[s]:boundaries[s + 1]].sum()) for s in range(n_st)]
    finish = [max(clock[(s, r)] for r in range(width)) for s in range(n_st)]
    reduce = [float(sp.reduce(s, params[s])) for s in range(n_st)]
    reduced = max(finish[s] + reduce[s] for s in range(n_st))
    updates = [[(upd[s] + eng_step) / cluster.speed(dev(s, r)) for r in range(width)] for s in range(n_st)]
    update = max(u for row in updates for u in row)
    tail = [reduced + update - finish[s] for s in range(n_st)]
    per = (lambda d: [[d[(s, r)] for r in range(width)] for s in range(n_st)])
    return Replay(reduced + update, max(finish), finish, tail, [max(busy[(s, r)] for r in range(width)) for s in range(n_st)],
                  None if trace is None else per(trace), None if spans is None else per(spans), messages,
                  reduce, updates, reduced, schedule)
