"""`horovod_mean_ms` for `pdv bench aggregate`: our `mean` through HorovodComm vs Horovod's own allreduce.

Both run in one `horovodrun --gloo` job on the same per-rank tensors, alternating, median of `reps`:
- baseline (`hvd_allreduce_ms`): what `hvd.DistributedOptimizer` does — one `allreduce_async_(op=Average)`
  per tensor, then wait for all (Horovod fuses them into its fusion buffer);
- candidate (`horovod_mean_ms`): `build_aggregator("mean").aggregate(tensors, HorovodComm())` — one
  flattened buffer per dtype, one SUM allreduce, then x1/size.
A step's time is the slowest rank's. Returns None values when Horovod is not installed.

    from pdv_ext.bench._horovod_timing import horovod_mean_timing
    horovod_mean_timing(sizes=[...], ranks=4, reps=10)   # -> {"horovod_mean_ms", "hvd_allreduce_ms", ...}
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence


def layer_sizes(mb: float = 64.0) -> List[int]:
    """float32 element counts of a transformer-like stack totalling `mb` MB (4 big matrices, a bias and
    two norm vectors per block, repeated)."""
    total = int(mb * 2 ** 20 / 4)
    hidden = 1024
    block = [4 * hidden * hidden, hidden * 4, hidden, hidden, 4 * hidden * hidden // 4, hidden]
    sizes: List[int] = []
    while sum(sizes) < total:
        for s in block:
            sizes.append(min(s, total - sum(sizes)))
            if sum(sizes) >= total:
                break
    return [s for s in sizes if s > 0]


def _horovodrun() -> Optional[str]:
    path = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if os.path.exists(path):
        return path
    from shutil import which

    return which("horovodrun")


def horovod_mean_timing(sizes: Optional[Sequence[int]] = None, ranks: int = 4, reps: int = 10, warmup: int = 2,
                        timeout: float = 600.0) -> Dict[str, Any]:
    """Launch the timing job; `{"horovod_mean_ms", "hvd_allreduce_ms", "horovod_ratio", "horovod_equal"}`."""
    none = {"horovod_mean_ms": None, "hvd_allreduce_ms": None, "horovod_ratio": None, "horovod_equal": None}
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        return none
    exe = _horovodrun()
    if exe is None:
        return none
    sizes = list(sizes) if sizes is not None else layer_sizes()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="pdv-hvd-bench-") as tmp:
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump({"sizes": sizes, "reps": reps, "warmup": warmup}, f)
        cmd = [exe, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", "--network-interface", "lo",
               sys.executable, "-m", "pdv_ext.bench._horovod_timing", tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        from ..spawn import run_command

        rc, tail = run_command(cmd, env=env, timeout=timeout)
        if rc != 0:
            raise RuntimeError(f"horovod timing job failed ({'timeout' if rc is None else rc}):\n{tail}")
        res = []
        for r in range(ranks):
            with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                res.append(pickle.load(f))
    import statistics

    def med(key: str) -> float:
        return statistics.median(max(r[key][i] for r in res) for i in range(len(res[0][key]))) * 1e3

    ours, theirs = med("ours"), med("hvd")
    return {"horovod_mean_ms": round(ours, 3), "hvd_allreduce_ms": round(theirs, 3),
            "horovod_ratio": round(ours / theirs, 4) if theirs > 0 else None,
            "horovod_equal": all(r["equal"] for r in res)}


def _rank(tmp: str) -> None:
    """Rank side: alternate the two reductions on the same tensors; record wall times."""
    import horovod.torch as hvd
    import torch

    from ..aggregation import build_aggregator
    from ..comm.horovod_comm import HorovodComm

    with open(os.path.join(tmp, "args.json")) as f:
        args = json.load(f)
    hvd.init()
    g = torch.Generator().manual_seed(hvd.rank())
    base = [torch.randn(n, generator=g) for n in args["sizes"]]
    comm, mean = HorovodComm(), build_aggregator("mean")
    times: Dict[str, List[float]] = {"ours": [], "hvd": []}
    for i in range(args["warmup"] + args["reps"]):
        for kind in (("hvd", "ours") if i % 2 == 0 else ("ours", "hvd")):
            ts = [t.clone() for t in base]
            hvd.barrier()
            t0 = time.perf_counter()
            if kind == "hvd":
                handles = [hvd.allreduce_async_(t, name=f"bench.{j}", op=hvd.Average) for j, t in enumerate(ts)]
                for h in handles:
                    hvd.synchronize(h)
            else:
                ts = mean.aggregate(ts, comm)
            dt = time.perf_counter() - t0
            if i >= args["warmup"]:
                times[kind].append(dt)
            if i == args["warmup"]:
                if kind == "hvd":
                    ref = ts
                else:
                    got = ts
    equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ref, got))
    with open(os.path.join(tmp, f"result{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump({**times, "equal": bool(equal)}, f)
    hvd.barrier()


if __name__ == "__main__":
    _rank(sys.argv[1])
