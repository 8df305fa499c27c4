"""Rank-side functions of the adasum integration tests: our adasum on gloo ranks (world and sub-groups)
and Horovod's `hvd.allreduce(op=hvd.Adasum)` under `horovodrun --mpi`, on identical seeded tensors.

Horovod ranks run `python -m tests.integration.adasum_workers OUTDIR KWARGS_JSON`.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence

import torch

SHAPES = [(33, 17), (17,), (5, 5, 3), (1,), (1000,)]


def rank_tensors(group_rank: int, seed: int = 0, shapes: Sequence[Sequence[int]] = SHAPES) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + group_rank)
    return [torch.randn(*s, generator=g) for s in shapes]


#: (dtype, scale) of the small and huge gradients compared with Horovod: a squared norm below 1e-8 (the
#: guard this module once had) where Horovod's sqrt(DBL_MIN) still computes real coefficients
SCALED = [(torch.float32, 1e-5), (torch.float32, 1e-30), (torch.float32, 1e30), (torch.float16, 1e-4)]


def scaled_tensors(group_rank: int, seed: int = 0) -> List[torch.Tensor]:
    """Per-rank different gradients at tiny and huge magnitudes (float32, float16)."""
    g = torch.Generator().manual_seed(1000 * seed + group_rank + 77)
    return [(torch.randn(40, generator=g, dtype=torch.float64) * s).to(dt) for dt, s in SCALED]


def strided_views(group_rank: int, seed: int = 0) -> List[torch.Tensor]:
    """Non-contiguous views (a matrix column, a transposed matrix, every other element, zero-size) and,
    on odd ranks, a transposed layout of a tensor that is contiguous on even ranks."""
    g = torch.Generator().manual_seed(1000 * seed + group_rank + 55)
    mixed = torch.randn(5, 6, generator=g)
    if group_rank % 2:
        mixed = mixed.t().contiguous().t()
    return [torch.randn(33, 9, generator=g)[:, 4], torch.randn(17, 70_000 // 17, generator=g).t(),
            torch.randn(2 * 301, generator=g)[::2], torch.empty(0, 3), mixed, torch.randn(3, generator=g)]


def gloo_adasum(seed: int = 0, groups: Optional[List[List[int]]] = None) -> Dict[str, Any]:
    """Our adasum over the world and over each listed sub-group (new_group is collective on all ranks)."""
    import torch.distributed as dist

    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.comm import TorchComm
    from pdv_ext.spawn import init_torch_distributed

    init_torch_distributed("gloo")
    out: Dict[str, Any] = {}
    comm = TorchComm()
    out["world"] = build_aggregator("adasum")(rank_tensors(comm.rank, seed), comm)
    out["scaled"] = build_aggregator("adasum")(scaled_tensors(comm.rank, seed), comm)
    # strided views straight into adasum_tensors (at 4 ranks this once failed on some ranks and left the
    # others waiting): the same results as contiguous copies
    from pdv_ext.aggregation.adasum import adasum_tensors

    views = strided_views(comm.rank, seed)
    copies = [v.contiguous().clone() for v in views]
    adasum_tensors(views, comm)
    adasum_tensors(copies, comm)
    out["strided_equal"] = all(torch.equal(v, c) for v, c in zip(views, copies))
    out["strided"] = copies
    for ranks in groups or []:
        pg = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            sub = TorchComm(pg)
            out[tuple(ranks)] = build_aggregator("adasum")(rank_tensors(sub.rank, seed), sub)
    return out


def run_horovod_adasum(np: int, seed: int = 0, timeout: float = 150.0) -> List[List[torch.Tensor]]:
    """Horovod's Adasum on `np` MPI ranks; each rank's result list."""
    from tests.integration.horovod_workers import horovodrun_bin, run_command

    with tempfile.TemporaryDirectory(prefix="pdv-adasum-") as tmp:
        cmd = [horovodrun_bin(), "-np", str(np), "-H", f"localhost:{np}", "--mpi", "--network-interface", "lo",
               sys.executable, "-m", "tests.integration.adasum_workers", tmp, json.dumps({"seed": seed})]
        run_command(cmd, timeout)
        results = []
        for r in range(np):
            with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def _horovod_main(outdir: str, kwargs: Dict[str, Any]) -> None:
    import horovod.torch as hvd

    hvd.init()
    tensors = rank_tensors(hvd.rank(), kwargs.get("seed", 0))
    handles = [hvd.allreduce_async(t, op=hvd.Adasum, name=f"adasum.{i}") for i, t in enumerate(tensors)]
    result = [hvd.synchronize(h) for h in handles]
    scaled = scaled_tensors(hvd.rank(), kwargs.get("seed", 0))  # one at a time: fusion keeps dtypes apart anyway
    result = {"world": result, "scaled": [hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.scaled.{i}")
                                          for i, t in enumerate(scaled)]}
    with open(os.path.join(outdir, f"result{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump(result, f)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    _horovod_main(sys.argv[1], json.loads(sys.argv[2]))
