"""Rank-side script for `pdv bench placement`: time training steps of the demo GPT pipeline, or profile it.

    pdv emulate --cluster C.yaml -- python -m pdv_ext.emulate.train_step_timer train --out r.json [--plan plan.json]
    pdv emulate --cluster C.yaml -- python -m pdv_ext.emulate.train_step_timer profile --cluster C.yaml --out p.json

`train`: builds the GPT PipelineModule (DeepSpeed's default `parameters` partition, row-major placement) and
goes through `pdv_ext.initialize`; with `--plan` the `"pdv": {"placement": {"plan": ...}}` section re-partitions
and re-maps it. Each step starts after a barrier; a step's time is the slowest rank's; rank 0 writes the
median (and the parts/mapping actually used) to `--out` and prints `median_step_ms`. `--breakdown` adds every
rank's wall and CPU per instruction kind, `--trace` every rank's instruction timeline (what the schedule replay,
`pdv_ext.placement.simulate`, is checked against).
`profile`: only the cluster's reference device (the fastest, unless `reference_throughput` says otherwise)
profiles the layers (with the loss on the last, and each layer's AdamW update) and DeepSpeed's own work per
micro-batch and step (`engine_overhead`) under its own CPU quota, so the profile's times are that device's
times. With `--workload-speeds` every rank first times the whole model's forward + backward, one rank at a
time (`meta.workload_seconds`: each device's speed on the model's own operations, kept busy), and with
`--message-cpu` the reference device's CPU for sending and receiving each activation over the emulated link
becomes the layers' `p2p`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

from ..spawn import shutdown_distributed


def _args(argv):
    ap = argparse.ArgumentParser(prog="train_step_timer")
    ap.add_argument("mode", choices=["train", "profile"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", default=None, help="plan JSON (boundaries + rank_mapping) from pdv plan")
    ap.add_argument("--cluster", default=None, help="cluster YAML (profile mode: who is the reference device)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages without a plan")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4, help="gradient accumulation steps per train_batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7, help="profile repetitions per layer")
    ap.add_argument("--workload-speeds", action="store_true",
                    help="profile mode: every rank also times the model's forward + backward (device speeds)")
    ap.add_argument("--workload-reps", type=int, default=7, help="samples per device of --workload-speeds")
    ap.add_argument("--message-cpu", action="store_true",
                    help="profile mode (with --workload-speeds): the layers' p2p from the CPU of send + recv between "
                         "the reference device and a device of its host, over the emulated link")
    ap.add_argument("--message-round-trips", type=int, default=40)
    ap.add_argument("--workload-passes", type=int, default=2,
                    help="back-to-back passes per sample of --workload-speeds (after one untimed pass)")
    ap.add_argument("--trace", action="store_true",
                    help="train mode: also record every rank's instruction timeline (start, end, CPU) of each timed step")
    ap.add_argument("--breakdown", action="store_true",
                    help="train mode: also record each rank's wall and CPU ms per step in each pipeline instruction")
    a = ap.parse_args(argv)
    if a.message_cpu and not (a.mode == "profile" and a.workload_speeds):
        ap.error("--message-cpu needs profile mode with --workload-speeds (it converts CPU to the device's wall time)")
    return a


def _time_workload(a, mods, ids, labels):
    """Every rank in turn (the others wait at a barrier) times the model's own work - forward + backward of
    all its layers and the loss on one micro-batch - under its own CPU quota; returns the list over ranks of
    each rank's `--workload-reps` samples (seconds per pass). A device's speed on the model's operations: a
    CPU-quota device that loses more than its share to descheduling (cold caches after every throttle) shows
    it here, which a long matmul does not.

    A sample is the mean of `--workload-passes` passes run back to back after one untimed pass: the speed
    of a device that is kept busy, as a pipeline's bottleneck is. A single pass after a wait is 7-19%
    faster under a quota (the slower the device, the more): the group starts it with unspent runtime on
    both cores, which a busy device never has (measured on the benchmark cluster, 2026-11-25).
    Collective over the initialised default group."""
    import torch.distributed as dist
    from ..models import lm_loss
    from ..placement.probe import in_turns

    world = dist.get_world_size()

    def once() -> None:
        x = ids
        for m in mods:
            x = m(x)
        lm_loss(x, labels).backward()
        for m in mods:
            m.zero_grad(set_to_none=True)

    cpu: List[float] = []

    def sample() -> float:
        once()  # untimed: into the steady state of a busy device
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.workload_passes):
            once()
        cpu.append((time.process_time() - c0) / a.workload_passes)
        return (time.perf_counter() - t0) / a.workload_passes

    once()  # warm-up
    mine = in_turns(sample, a.workload_reps)
    out = [None] * world
    dist.all_gather_object(out, (mine, cpu))
    return [[float(v) for v in w] for w, _ in out], [[float(v) for v in c] for _, c in out]


def _message_cpu(sizes, ref: int, partner: int, round_trips: int) -> Dict[float, float]:
    """CPU seconds the reference device spends to send one message of each size to `partner` and receive
    one back (torch.distributed send/recv over the emulated link: what DeepSpeed's pipeline instructions
    call): per micro-batch, a stage does one send and one recv at each boundary. Timed as the process's CPU
    over `round_trips` exchanges, not as wall time: the wall is mostly the link's transfer, which the cost
    model charges apart (and overlaps), and a few short wall samples under a CPU quota either miss the
    throttling or hit it (the in-process ping-pong of `message_time` gave 0.08 and 3.53 ms for the same
    262 KB). Collective; the dict on `ref` (empty elsewhere)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    out: Dict[float, float] = {}
    for n in sorted({float(v) for v in sizes if v > 0}):
        if rank in (ref, partner):
            peer = partner if rank == ref else ref
            buf = torch.zeros(max(1, int(n) // 4))
            c0 = 0.0
            for i in range(3 + round_trips):
                if i == 3:
                    c0 = time.process_time()
                if rank == ref:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            if rank == ref:
                out[n] = (time.process_time() - c0) / round_trips
        dist.barrier()
    return out


def _reduce_cpu(nbytes: float, ref: int, partner: int, reps: int = 5, warmup: int = 2) -> Dict[int, float]:
    """CPU seconds the reference device spends in one all-reduce of `nbytes` (float32) over every rank and over
    the pair (`ref`, `partner`): {ranks: seconds}. Gloo's copies and sums are a CPU device's own work, which
    its quota can make the bound where the link is not; two group sizes tell the work per byte sent from the
    work per gradient byte. Timed as CPU, as `_message_cpu` is, for the same reason. Collective; {} off
    `ref`."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    pair = dist.new_group(sorted({ref, partner}))
    buf = torch.ones(max(1, int(nbytes) // 4))
    out: Dict[int, float] = {}
    for ranks, group in ((world, None), (2, pair)):
        if group is not None and (world == 2 or rank not in (ref, partner)):
            continue
        c0 = 0.0
        for i in range(warmup + reps):
            if i == warmup:
                c0 = time.process_time()
            dist.all_reduce(buf, group=group)
        out[ranks] = (time.process_time() - c0) / reps
    dist.barrier()
    return out if rank == ref else {}


def reduce_work(nbytes: float, cpu: Dict[int, float]) -> Dict[str, float]:
    """The reduction's work per gradient byte and per byte sent from CPU seconds at two group sizes:
    cpu(w) = nbytes * (grad + sent * reduce_traffic(w)), solved for (grad, sent), neither below 0."""
    from ..placement.cost import reduce_traffic

    if len(cpu) < 2:
        (w, c), = cpu.items()
        return {"reduce_byte": c / (reduce_traffic("ring", w) * nbytes)}
    (w1, c1), (w2, c2) = sorted(cpu.items())
    t1, t2 = reduce_traffic("ring", w1), reduce_traffic("ring", w2)
    sent = max(0.0, (c2 - c1) / ((t2 - t1) * nbytes))
    grad = max(0.0, c1 / nbytes - sent * t1)
    if grad == 0.0:
        sent = c2 / (t2 * nbytes)
    return {"reduce_byte": sent, "reduce_grad_byte": grad}


def _measure_devices(a, ids, labels):
    """`_time_workload` (and with `--message-cpu`, `_message_cpu` for the sizes the model's stages send, with a
    device of the reference's host) in a gloo group of its own (profile mode): (wall, cpu, messages)."""
    import datetime

    import torch.distributed as dist
    from ..models import gpt_layers

    mods = [spec.build() for spec in gpt_layers(a.layers, a.hidden, a.heads, a.seq_len)]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        wall, cpu = _time_workload(a, mods, ids, labels)
        messages = {}
        if a.message_cpu and dist.get_world_size() > 1:
            from ..placement.cluster import Cluster, reference_device

            cluster = Cluster.load(a.cluster)
            ref = reference_device(cluster)
            same = [d for d in range(len(cluster)) if d != ref and cluster.host_of(d) == cluster.host_of(ref)]
            partner = same[0] if same else (ref + 1) % len(cluster)
            messages = _message_cpu(_activation_bytes(mods, ids), ref, partner, a.message_round_trips)
            grad_bytes = float(sum(p.numel() * p.element_size() for m in mods for p in m.parameters()))
            messages["reduce"] = (grad_bytes, _reduce_cpu(grad_bytes, ref, partner))
        return wall, cpu, messages
    finally:
        shutdown_distributed()


def _activation_bytes(mods, ids) -> List[float]:
    """Bytes of every layer's output but the last: what the model's stage boundaries can send."""
    import torch

    sizes, x = [], ids
    with torch.no_grad():
        for m in mods:
            x = m(x)
            sizes.append(float(x.numel() * x.element_size()))
    return sizes[:-1]


def profile(a) -> int:
    from ..placement.cluster import Cluster, reference_device
    from ..placement.profile import engine_overhead, profile_layers
    from ..models import gpt_layers, lm_loss
    import torch

    cluster = Cluster.load(a.cluster)
    rank = int(os.environ.get("RANK", "0"))
    ref = reference_device(cluster)
    torch.manual_seed(0)
    ids, labels = (torch.randint(0, 256, (a.micro_batch, a.seq_len)) for _ in range(2))
    workload = _measure_devices(a, ids, labels) if a.workload_speeds else None
    if rank != ref:
        return 0
    prof = profile_layers(gpt_layers(a.layers, a.hidden, a.heads, a.seq_len), ids, reps=a.reps, warmup=2,
                          loss_fn=lm_loss, labels=labels)
    # DeepSpeed's own work per micro-batch / per step on this device (a child process in this quota)
    prof.engine = engine_overhead(len(prof))
    if workload is not None:
        wall, cpu, messages = workload
        prof.meta["workload_seconds"] = [statistics.median(w) for w in wall]
        prof.meta["workload_rounds"] = wall
        prof.meta["workload_cpu_seconds"] = [statistics.median(c) for c in cpu]
        if messages:  # CPU per send + recv, in this device's wall seconds at its sustained CPU rate
            rate = prof.meta["workload_cpu_seconds"][rank] / prof.meta["workload_seconds"][rank]
            nbytes, reduce_cpu = messages.pop("reduce")
            if prof.engine is not None and reduce_cpu:  # the reduction's work per byte, at the same rate
                prof.engine.update({k: v / rate for k, v in reduce_work(nbytes, reduce_cpu).items()})
            prof.meta["reduce_cpu_seconds"] = {"bytes": nbytes, **{str(w): c for w, c in reduce_cpu.items()}}
            prof.meta["message_cpu_seconds"] = {str(int(n)): c for n, c in messages.items()}
            for l in prof.layers:
                if float(l.act_bytes) in messages:
                    l.p2p = messages[float(l.act_bytes)] / rate
            prof.meta["p2p_source"] = "message_cpu"
    prof.meta.update({"device_name": os.environ.get("PDV_DEVICE_NAME"), "rank": rank,
                      "cores": os.environ.get("PDV_DEVICE_CORES")})
    prof.save(a.out)
    print(f"profiled {len(prof)} layers on rank {rank}: {sum(l.fwd_bwd for l in prof.layers) * 1e3:.1f} ms fwd+bwd",
          flush=True)
    return 0


class _InstructionTimes:
    """Wall and CPU seconds a rank spends in each kind of pipeline instruction (ForwardPass, RecvActivation,
    ...), through an instance-level instruction map: what a stage really costs, to set beside the cost
    model's per-stage prediction."""

    def __init__(self, engine):
        from ..integrations.deepspeed.internals import wrap_instructions, wrap_loss_aggregation

        self.on = False
        self.events: Optional[List[tuple]] = None  # when a list: (instruction, start, end, cpu) appended
        self.wall: Dict[str, float] = {}
        self.cpu: Dict[str, float] = {}
        wrap_instructions(engine, lambda instr, fn: self._timed(instr.__name__, fn))
        # after the schedule, train_batch averages the loss over the last stage's replicas and broadcasts
        # it along each pipeline: small collectives that are no instruction (else counted as `outside`)
        wrap_loss_aggregation(engine, lambda fn: self._timed("AggregateLoss", fn))

    def _timed(self, name, fn):
        def run(engine, *args, **kwargs):
            if not self.on:
                return fn(engine, *args, **kwargs)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                t1, c1 = time.perf_counter(), time.process_time()
                self.wall[name] = self.wall.get(name, 0.0) + t1 - t0
                self.cpu[name] = self.cpu.get(name, 0.0) + c1 - c0
                if self.events is not None:
                    self.events.append((name, t0, t1, c1 - c0))
        return run

    def per_step_ms(self, steps: int, step_wall: float, step_cpu: float) -> Dict[str, Any]:
        """ms per step: {instruction: [wall, cpu]}, plus `outside` (the step's time in no instruction)."""
        out = {k: [round(self.wall[k] / steps * 1e3, 2), round(self.cpu[k] / steps * 1e3, 2)] for k in sorted(self.wall)}
        out["outside"] = [round((step_wall - sum(self.wall.values())) / steps * 1e3, 2),
                          round((step_cpu - sum(self.cpu.values())) / steps * 1e3, 2)]
        return out


def train(a) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import pdv_ext
    from ..integrations.deepspeed.topology import current_mapping
    from ..models import ByteWindows, gpt_layers, lm_loss, seed_layer, text_splits

    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    stages = a.stages
    pdv = {"aggregation": {"type": "mean"}}
    if a.plan:
        with open(a.plan) as f:
            stages = len(json.load(f)["rank_mapping"])
        pdv["placement"] = {"plan": a.plan}
    torch.manual_seed(0)
    model = PipelineModule(layers=gpt_layers(a.layers, a.hidden, a.heads, a.seq_len), num_stages=stages,
                           loss_fn=lm_loss, seed_layers=True, seed_fn=seed_layer, partition_method="parameters")
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": a.micro_batches,
           "train_batch_size": a.micro_batch * a.micro_batches * (world // stages),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "steps_per_print": 10 ** 9, "pdv": pdv}
    # a generator, read when the engine builds the optimizer: a plan rebuilds the local layers first, and a
    # list taken here would hold the replaced parameters (the optimizer would step none of the new ones)
    engine, _, _, _ = pdv_ext.initialize(model=model, config=cfg,
                                         model_parameters=(p for p in model.parameters() if p.requires_grad))
    train_text, _ = text_splits()
    data = ByteWindows(train_text, a.seq_len, a.micro_batch, seed=engine.grid.get_data_parallel_id())
    timing = _InstructionTimes(engine) if a.breakdown or a.trace else None
    starts: List[float] = []
    times, losses, cpu = [], [], 0.0
    for step in range(a.warmup + a.steps):
        dist.barrier()
        if timing is not None:
            timing.on = step >= a.warmup
            if a.trace and step == a.warmup:
                timing.events = []
        t0, c0 = time.perf_counter(), time.process_time()
        if step >= a.warmup:
            starts.append(t0)
        loss = engine.train_batch(data_iter=data)
        dt = time.perf_counter() - t0
        if step >= a.warmup:
            times.append(dt)
            cpu += time.process_time() - c0
            losses.append(float(loss))
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    # CPU each rank used per second of training: compare with its quota (PDV_DEVICE_CORES)
    share = torch.zeros(world, dtype=torch.float64)
    share[dist.get_rank()] = cpu / sum(times)
    dist.all_reduce(share)
    breakdown = None
    if a.breakdown:
        breakdown = [None] * world
        dist.all_gather_object(breakdown, timing.per_step_ms(len(times), sum(times), cpu))
    trace = None
    if a.trace:  # perf_counter is CLOCK_MONOTONIC: one clock for all ranks of this machine
        trace = [None] * world
        dist.all_gather_object(trace, {"step_starts": starts, "events": timing.events})
    if dist.get_rank() == 0:
        ms = [t * 1e3 for t in slowest.tolist()]
        out = {"median_step_ms": statistics.median(ms), "step_ms": ms, "parts": [int(p) for p in engine.module.parts],
               "rank_mapping": current_mapping(engine.module), "stages": engine.num_stages, "losses": losses,
               "plan": a.plan, "cpu_share": [round(x, 3) for x in share.tolist()]}
        if breakdown is not None:
            out["breakdown_ms"] = breakdown  # per rank: {instruction: [wall, cpu] ms per step}
        if trace is not None:
            out["trace"] = trace  # per rank: step starts and (instruction, start, end, cpu) events
        with open(a.out, "w") as f:
            json.dump(out, f)
        print(f"median_step_ms {out['median_step_ms']:.1f} parts {out['parts']} mapping {out['rank_mapping']} "
              f"cpu used per rank {out['cpu_share']}", flush=True)
    shutdown_distributed()
    return 0


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    return profile(a) if a.mode == "profile" else train(a)


if __name__ == "__main__":
    sys.exit(main())
