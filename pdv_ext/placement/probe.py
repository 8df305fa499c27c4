"""`pdv probe --out cluster.yaml`: measure the launched ranks and write a cluster YAML.

Run under a launcher (torchrun, deepspeed, `pdv emulate`, ...): reads RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT. Each rank in turn (the others wait), in several rounds, measures its matmul throughput; then every pair of ranks, one pair at a time (the
others wait), ping-pongs messages of several sizes over torch.distributed (gloo on CPU) send/recv. For
each size the median round trip of `--reps` repetitions is halved and latency + size / bandwidth fitted
(`fit_latency_bandwidth`): the latency from the small messages, the bandwidth from the large ones (default
up to 8 MiB, long enough that a token-bucket shaper's burst does not inflate it). Device names come from
PDV_DEVICE_NAME (default rank<i>), hosts from PDV_HOST (default the hostname). Rank 0 writes the YAML:
the median link inside and between hosts, plus per-pair overrides where a pair differs by more than 20%.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..spawn import shutdown_distributed

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 23)


def fit_latency_bandwidth(sizes: Sequence[float], times: Sequence[float]) -> Tuple[float, float]:
    """Fit t = latency + size / bandwidth in two steps that each use the points that carry the signal.

    Latency: the median residual of the smaller half around the least-squares line through the larger half
    (transfer-dominated; a relative-error fit lets small messages, inflated by scheduling stalls on a
    throttled or busy host, dominate and over-estimates bandwidth). Bandwidth: the median of
    size / (time - latency) over the sizes within 4x of the largest, which errs by one measurement's noise
    where the slope amplifies it.
    """
    order = np.argsort(np.asarray(sizes, dtype=float))
    s = np.asarray(sizes, dtype=float)[order]
    t = np.asarray(times, dtype=float)[order]
    half = len(s) // 2
    big_s, big_t = (s[half:], t[half:]) if len(s) - half >= 2 else (s, t)
    if len(big_s) >= 2 and np.ptp(big_s) > 0:
        inv_bw = float(np.polyfit(big_s, big_t, 1)[0])
    else:
        inv_bw = 0.0
    if inv_bw <= 0:  # flat curve: the largest message gives a lower bound on bandwidth
        inv_bw = max(t[-1] - t[0], 1e-12) / max(s[-1] - s[0], 1.0)
    small_s, small_t = (s[:half], t[:half]) if half else (s, t)
    lat = max(float(np.median(small_t - small_s * inv_bw)), 0.0)
    # The slope of two or three sizes a factor of two apart multiplies their noise (CI: an emulated 800 Mbit/s
    # link measured 603); each large size on its own, net of the latency, errs only by its own noise, and the
    # median of three ignores one outlier. Large: within a factor of four of the largest message.
    large = s >= s[-1] / 4
    net = t[large] - lat
    if np.all(net > 0):
        return lat, float(np.median(s[large] / net))
    return lat, 1.0 / inv_bw


def _pingpong(peer: int, me_first: bool, size: int, reps: int) -> List[float]:
    import torch
    import torch.distributed as dist

    cuda = dist.get_backend() == "nccl"  # NCCL moves device memory only, and returns before it has moved it
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    buf = torch.empty(size // 4, dtype=torch.float32, device=dev)
    wait = torch.cuda.synchronize if cuda else (lambda: None)
    out = []
    for r in range(reps + 1):
        wait()
        t0 = time.perf_counter()
        if me_first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        wait()
        dt = time.perf_counter() - t0
        if r:  # the first round trip warms up the connection
            out.append(dt / 2)
    return out


def in_turns(sample: Callable[[], float], rounds: int) -> List[float]:
    """This rank's `rounds` values of `sample()`, taken one rank at a time (the others wait at a barrier:
    concurrent work would share the host's cores and measure contention) and in rounds (a burst of
    outside load then touches every rank's samples alike, not one rank's whole block). Collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: List[float] = []
    for _ in range(rounds):
        for r in range(world):
            if r == rank:
                out.append(sample())
            dist.barrier()
    return out


def measure(sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 5, matmul_size: int = 512,
            progress: bool = True, rounds: Optional[int] = None) -> Optional[Dict]:
    """Collective over the launched ranks; returns the cluster dict on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    from .profile import matmul_throughput

    rank, world = dist.get_rank(), dist.get_world_size()
    name = os.environ.get("PDV_DEVICE_NAME") or f"rank{rank}"
    host = os.environ.get("PDV_HOST") or socket.gethostname()
    flops = statistics.median(in_turns(lambda: matmul_throughput(matmul_size, reps=1, min_sample_s=0.1),
                                       rounds or max(5, reps)))
    try:
        import psutil

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        mem = float(psutil.virtual_memory().total) / max(local, 1)
    except ImportError:
        mem = None
    infos: List = [None] * world
    dist.all_gather_object(infos, {"name": name, "host": host, "throughput": flops, "memory": mem})
    pairs = [(i, j) for i in range(world) for j in range(i + 1, world)]
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(pairs) * len(sizes), desc="probe p2p", unit="msg", file=sys.stderr)
    results: Dict[Tuple[int, int], Tuple[float, float]] = {}
    for i, j in pairs:
        meds = []
        for size in sizes:
            if rank in (i, j):
                ts = _pingpong(j if rank == i else i, rank == i, size, reps)
                meds.append(statistics.median(ts))
            if bar is not None:
                bar.update(1)
        if rank == i:
            results[(i, j)] = fit_latency_bandwidth(sizes, meds)
        dist.barrier()
    if bar is not None:
        bar.close()
    gathered: List = [None] * world
    dist.all_gather_object(gathered, results)
    if rank != 0:
        return None
    links: Dict[Tuple[int, int], Tuple[float, float]] = {}
    for part in gathered:
        links.update(part)
    return build_cluster(infos, links)


def build_cluster(infos: List[Dict], links: Dict[Tuple[int, int], Tuple[float, float]]) -> Dict:
    """Cluster dict from per-rank infos and measured (latency, bandwidth) per pair."""
    intra = [v for (i, j), v in links.items() if infos[i]["host"] == infos[j]["host"]]
    inter = [v for (i, j), v in links.items() if infos[i]["host"] != infos[j]["host"]]

    def med(vals, default):
        if not vals:
            return default
        return {"bandwidth": float(np.median([b for _, b in vals])), "latency": float(np.median([l for l, _ in vals]))}

    intra_l = med(intra, {"bandwidth": 1e10, "latency": 1e-5})
    inter_l = med(inter, intra_l)
    overrides = []
    for (i, j), (lat, bw) in sorted(links.items()):
        ref = intra_l if infos[i]["host"] == infos[j]["host"] else inter_l
        if abs(bw / ref["bandwidth"] - 1) > 0.2:
            overrides.append({"a": infos[i]["name"], "b": infos[j]["name"], "bandwidth": float(bw),
                              "latency": float(lat)})
    devices = []
    for inf in infos:
        d = {"name": inf["name"], "host": inf["host"], "throughput": float(inf["throughput"])}
        if inf.get("memory"):
            d["memory"] = float(inf["memory"])
        devices.append(d)
    return {"devices": devices, "links": {"intra_host": dict(intra_l), "inter_host": dict(inter_l), "pairs": overrides},
            "measured_pairs": [{"a": infos[i]["name"], "b": infos[j]["name"], "bandwidth": float(bw),
                                "latency": float(lat)} for (i, j), (lat, bw) in sorted(links.items())]}


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad flags fail before the process group starts (every rank fails alike, none waits for the others)."""
    import torch.distributed as dist

    from ..cli_args import check_ranges

    check_ranges(ap, args, {"--matmul-size": 1, "--reps": 1, "--rounds": 1})
    if not args.sizes or min(args.sizes) < 4:
        ap.error(f"--sizes: give at least one message size, each >= 4 bytes (got {args.sizes})")
    if args.backend is not None:
        known = [b for b in ("gloo", "nccl", "mpi", "ucc") if dist.is_backend_available(b)]
        if args.backend not in known:
            ap.error(f"--backend {args.backend}: not available in this torch build; available: {', '.join(known)}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pdv probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="cluster YAML to write (rank 0)")
    ap.add_argument("--sizes", type=int, nargs="*", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per size (median)")
    ap.add_argument("--matmul-size", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=None,
                    help="matmul timing rounds per device, taken in turns (median; default max(5, --reps))")
    ap.add_argument("--backend", default=None, help="torch.distributed backend (default gloo; nccl p2p on GPUs)")
    args = ap.parse_args(argv)
    _check_args(ap, args)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"pdv probe: run me under a launcher (torchrun / deepspeed / pdv emulate); missing {', '.join(missing)}",
              file=sys.stderr)
        return 2
    import torch.distributed as dist
    import yaml

    dist.init_process_group(backend=args.backend or "gloo")
    if dist.get_backend() == "nccl":  # one GPU per rank: NCCL and its object collectives use the current one
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        data = measure(sorted(args.sizes), args.reps, args.matmul_size, rounds=args.rounds)
        if data is not None:
            measured = data.pop("measured_pairs")
            with open(args.out, "w", encoding="utf-8") as f:
                f.write("# written by pdv probe; measured_pairs (all pairs) are in the comment below\n")
                yaml.safe_dump(data, f, sort_keys=False)
                for p in measured:
                    f.write(f"# {p['a']} <-> {p['b']}: {p['bandwidth'] * 8 / 1e6:.1f} Mbit/s, "
                            f"{p['latency'] * 1e6:.0f} us\n")
            print(f"pdv probe: {len(data['devices'])} devices, intra-host "
                  f"{data['links']['intra_host']['bandwidth'] * 8 / 1e6:.1f} Mbit/s, inter-host "
                  f"{data['links']['inter_host']['bandwidth'] * 8 / 1e6:.1f} Mbit/s -> {args.out}")
    finally:
        shutdown_distributed()
    return 0
