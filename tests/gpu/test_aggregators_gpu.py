"""GPU tier: every aggregator on CUDA tensors against the same call on CPU tensors, through the in-process
ThreadComm (one GPU cannot hold two NCCL ranks; the aggregators' logic across ranks runs on threads), at 3
and 4 ranks, in float32, bfloat16 and float16; and the host syncs per call (issue #20 items 2 and 4).

Equality (docs/aggregation.md, "Devices"):
- bit-identical: `mean`, `median`, `trimmed_mean`, `zeno` (its output; its float64 scores agree to
  float64 rounding, the dot products' summation order being the device's), `gossip` (its output; the
  consensus-distance estimate agrees to float32 rounding);
- within 2 units in the last place of the output dtype: `adasum` (float64 dot products, summed in the
  device's order, become its coefficients) and `suspicion` (a float64 Gram matrix likewise becomes its
  weights); their decisions (who is replaced) are identical.
Host syncs, counted with `torch.cuda.set_sync_debug_mode("warn")` (every synchronizing call warns): at
most one per call and rank for median, trimmed_mean, zeno, suspicion, gossip (the one their docstrings
name), mean (one bucket) and adasum, in steady state and in the first call; `pdv_ext.kernels` is counted
with them (its CUDA implementations are sync-free).
Skipped without CUDA (tests/conftest.py); collected everywhere (`pytest --collect-only tests/gpu`).
"""
import warnings

import pytest
import torch

from pdv_ext.aggregation import build_aggregator

from tests.threadcomm import run_threads

pytestmark = pytest.mark.gpu

SPECS = {
    "mean": {"type": "mean"},
    "adasum": {"type": "adasum"},
    "median": {"type": "median"},
    "trimmed_mean": {"type": "trimmed_mean", "b": 1},
    "zeno": {"type": "zeno", "b": 1},
    "suspicion": {"type": "suspicion", "k": 1},
    "gossip": {"type": "gossip", "peers": 2, "ratio": 0.05},
    "gossip_dense_sync": {"type": "gossip", "peers": 1, "ratio": 1.0, "sync_every": 2},
}
BITWISE = {"mean", "median", "trimmed_mean", "zeno", "gossip", "gossip_dense_sync"}
#: the aggregator's docstring: host syncs per call and rank on CUDA
MAX_SYNCS = {name: 1 for name in SPECS}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STEPS = 3
SHAPES = [(64, 33), (1000,), (7,), (3, 5, 2)]  # 3159 entries: several slices, ragged ones, a small tensor
SCALE = 0.025  # the gradient scale of the H100 measurement (gossip: 0.069 apart before)


def grads(rank, step, dtype, device, byzantine=None):
    g = torch.Generator().manual_seed(1000 * step + rank)
    base = torch.Generator().manual_seed(step)
    out = []
    for s in SHAPES:
        t = SCALE * (torch.randn(s, generator=base) + 0.5 * torch.randn(s, generator=g))
        out.append(t)
    if rank == byzantine:
        out = [-8 * t for t in out]
    return [t.to(dtype).to(device) for t in out]


def run(name, m, dtype, device, steps=STEPS, count_syncs=False):
    """Outputs (flat, on the host) and reports per rank and step; with `count_syncs` also the synchronizing
    CUDA calls of the aggregation calls (all ranks; the inputs are uploaded before counting starts)."""
    spec = SPECS[name]
    inputs = [[grads(r, s, dtype, device, byzantine=m - 1) for s in range(steps)] for r in range(m)]
    valid = grads(99, 0, dtype, device)

    def fn(comm):
        agg = build_aggregator(dict(spec))
        if name == "zeno":
            agg.set_validation_grads(valid)
        outs, reps = [], []
        for s in range(steps):
            outs.append(agg(inputs[comm.rank][s], comm))
            reps.append(dict(agg.report))
        return outs, reps

    syncs = []
    if count_syncs:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = run_threads(m, fn)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    else:
        res = run_threads(m, fn)
    host = [([torch.cat([t.reshape(-1).cpu() for t in o]) for o in outs], reps) for outs, reps in res]
    return host, syncs


def ulp_close(got, want, dtype):
    eps = torch.finfo(dtype).eps
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=2 * eps, atol=2 * eps * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m", [3, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_cuda_matches_cpu(name, m, dtype):
    cpu, _ = run(name, m, dtype, "cpu")
    cuda, _ = run(name, m, dtype, "cuda")
    for r in range(m):
        for s in range(STEPS):
            want, got = cpu[r][0][s], cuda[r][0][s]
            assert got.dtype == want.dtype == dtype
            if name in BITWISE:
                assert torch.equal(got, want), (name, m, dtype, r, s, float((got.float() - want.float()).abs().max()))
            else:
                ulp_close(got, want, dtype)
            rc, rg = cpu[r][1][s], cuda[r][1][s]
            assert rc.get("dropped") == rg.get("dropped") and rc.get("peers") == rg.get("peers")
            for key in ("scores", "suspicion"):
                if key in rc:
                    torch.testing.assert_close(torch.tensor(rg[key]), torch.tensor(rc[key]), rtol=1e-12, atol=0.0)
            if "consensus_distance" in rc:
                assert rg["consensus_distance"] == pytest.approx(rc["consensus_distance"], rel=1e-5, abs=1e-12)


@pytest.mark.parametrize("m", [3, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_host_syncs_per_call(name, m):
    """At most MAX_SYNCS[name] synchronizing CUDA calls per call and rank (fp32; every step, the first too)."""
    _, syncs = run(name, m, torch.float32, "cuda", steps=STEPS, count_syncs=True)
    per_call = len(syncs) / (m * STEPS)
    assert per_call <= MAX_SYNCS[name], (
        f"{name}: {len(syncs)} synchronizing CUDA calls in {STEPS} calls on {m} ranks; first: "
        + "; ".join(sorted({f'{w.filename}:{w.lineno}' for w in syncs})[:8]))


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "zeno", "suspicion", "gossip"])
def test_nonfinite_rank_on_cuda_matches_cpu(name):
    """A rank sending NaN/Inf: the robust aggregators leave it out on CUDA exactly as on CPU (gossip: the
    NaN travels in its top-k on both devices alike)."""
    m = 4

    def make(device):
        def fn(comm):
            agg = build_aggregator(dict(SPECS[name]))
            if name == "zeno":
                agg.set_validation_grads(grads(99, 0, torch.float32, device))
            g = grads(comm.rank, 0, torch.float32, device)
            if comm.rank == 2:
                g[1][5] = float("nan")
                g[0][3, 3] = float("inf")
            out = agg(g, comm)
            return torch.cat([t.reshape(-1).cpu() for t in out]), agg.report.get("dropped")
        return run_threads(m, fn)

    cpu, cuda = make("cpu"), make("cuda")
    for (a, da), (b, db) in zip(cpu, cuda):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and da == db
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) if name != "suspicion" else True
        if name == "suspicion":
            ulp_close(b, a, torch.float32)
