"""Rank-side functions for the Horovod tests, and `run_horovod`, which starts them under real `horovodrun`.

A rank runs `python -m tests.integration.horovod_workers FUNC OUTDIR KWARGS_JSON`: it calls `hvd.init()`,
`FUNC(**kwargs)`, pickles the return value to OUTDIR/result<rank>.pkl and meets the others at a barrier
(Horovod shuts down the whole job when one rank leaves early).
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- launcher side ----------------------------------------------------------------------------------
class HorovodRunFailed(RuntimeError):
    pass


def horovodrun_bin() -> str:
    return os.path.join(os.path.dirname(sys.executable), "horovodrun")


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill horovodrun and every process below it (ranks may sit in their own sessions)."""
    try:
        import psutil

        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        kids = []
    for p in [proc.pid] + [k.pid for k in kids]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for k in kids:
        try:
            k.wait(timeout=5)
        except Exception:
            pass


def gloo_timeout_args(deadline: float) -> List[str]:
    """horovodrun flags that let a Gloo operation wait until the test's own deadline: Gloo's default 30 s
    per-operation limit aborts a healthy job on a loaded 2-core machine (one rank descheduled for half a
    minute), while the test's hard deadline still catches a real hang."""
    return ["--gloo-timeout-seconds", str(max(30, int(deadline)))]


def run_command(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None) -> str:
    """Run `cmd` in its own session; kill the whole tree on timeout; return its output or raise."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(list(cmd), cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(proc)
        log.seek(0)
        out = log.read().decode(errors="replace")
    if rc != 0:
        reason = f"timed out after {timeout:.0f}s" if rc is None else f"exit code {rc}"
        tail = "\n".join(out.splitlines()[-60:])
        raise HorovodRunFailed(f"{' '.join(cmd[:8])} ...: {reason}\n{tail}")
    return out


def run_horovod(func: str, np: int = 2, mode: str = "gloo", kwargs: Optional[Dict[str, Any]] = None,
                timeout: float = 150.0, env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Run `func` of this module on `np` local ranks under `horovodrun --gloo|--mpi`; per-rank results."""
    with tempfile.TemporaryDirectory(prefix="pdv-hvd-") as tmp:
        cmd = [horovodrun_bin(), "-np", str(np), "-H", f"localhost:{np}", f"--{mode}", "--network-interface", "lo",
               *(gloo_timeout_args(timeout) if mode == "gloo" else []),
               sys.executable, "-m", "tests.integration.horovod_workers", func, tmp, json.dumps(kwargs or {})]
        run_command(cmd, timeout, env)
        results = []
        for r in range(np):
            with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


# ---- rank side --------------------------------------------------------------------------------------
def _rank_tensor(rank: int, n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(dtype)


def comm_checks() -> Dict[str, Any]:
    """Every HorovodComm primitive against values computed locally from every rank's known inputs."""
    import horovod.torch as hvd

    from pdv_ext.comm import HorovodComm

    comm = HorovodComm()
    r, n = comm.rank, comm.size
    mine = _rank_tensor(r, 7)
    every = [_rank_tensor(i, 7) for i in range(n)]
    out: Dict[str, Any] = {"rank": r, "size": n}
    for op, ref in [("sum", sum(every)), ("avg", sum(every) / n), ("max", torch.stack(every).max(0).values),
                    ("min", torch.stack(every).min(0).values)]:
        out[f"all_reduce_{op}"] = bool(torch.allclose(comm.all_reduce(mine.clone(), op), ref, atol=1e-6))
    nc = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous in-place reduce
    comm.all_reduce(nc, "sum")
    out["all_reduce_noncontig"] = bool(torch.equal(nc, torch.arange(12.0).reshape(3, 4).t() * n))
    ints = torch.tensor([r + 1], dtype=torch.int64)
    out["all_reduce_int"] = int(comm.all_reduce(ints, "sum").item()) == n * (n + 1) // 2
    gathered = comm.all_gather(mine.reshape(7, 1))
    out["all_gather"] = all(torch.equal(a.reshape(-1), b) for a, b in zip(gathered, every)) and len(gathered) == n
    rows = torch.full((n, 7), float("nan"))
    rows[r] = mine
    out["all_gather_into"] = bool(torch.equal(comm.all_gather_into(rows), torch.stack(every)))
    b = mine.clone()
    comm.broadcast(b, src=n - 1)
    out["broadcast"] = bool(torch.equal(b, every[n - 1]))
    var = comm.all_gather_varsize(torch.arange(r + 1, dtype=torch.float64))
    out["varsize"] = [t.tolist() for t in var] == [list(map(float, range(i + 1))) for i in range(n)]
    out["objects"] = comm.all_gather_object({"r": r}) == [{"r": i} for i in range(n)]
    out["broadcast_object"] = comm.broadcast_object(("x", r), src=1) == ("x", 1)
    out["scalars"] = comm.all_reduce_scalars([1.0, float(r)], "sum") == [float(n), float(sum(range(n)))]
    # exchange: ring with mixed dtypes and sizes that depend on the pair, plus a silent pair
    nxt, prv = (r + 1) % n, (r - 1) % n
    sends = {nxt: torch.full((r + 2,), float(r), dtype=torch.float64)}
    recvs = {prv: torch.empty(prv + 2, dtype=torch.float64)}
    extra = [i for i in range(n - 1) if n > 2]  # ranks 0..n-2 also send an int16 tensor to rank 0
    if r in extra:
        sends[0] = torch.full((3,), r, dtype=torch.int16)
    if r == 0:
        recvs.update({i: torch.empty(3, dtype=torch.int16) for i in extra})
    comm.exchange(sends, recvs)
    ok = bool(torch.equal(recvs[prv], torch.full((prv + 2,), float(prv), dtype=torch.float64)))
    if r == 0:
        ok = ok and all(int(recvs[i][0]) == i for i in extra)
    out["exchange"] = ok
    comm.exchange({}, {})  # nobody sends: still a valid collective
    comm.barrier()
    # a process set of ranks 1..n-1 (the set is registered on every rank; ops run only on members)
    ps = _SUBSET
    if ps is not None and ps.included():
        sub = HorovodComm(ps)
        out["subset_rank"] = sub.rank
        out["subset_sum"] = float(sub.all_reduce(torch.tensor([float(r)]), "sum").item())
        bb = torch.tensor([float(r)])
        sub.broadcast(bb, src=0)  # group rank 0 = global rank 1
        out["subset_bcast"] = float(bb.item())
        sub.exchange({(sub.rank + 1) % sub.size: torch.tensor([r])}, {(sub.rank - 1) % sub.size: (rv := torch.tensor([0]))})
        out["subset_exchange"] = int(rv.item())
    return out


_SUBSET = None


def _init(func: str) -> None:
    import horovod.torch as hvd

    global _SUBSET
    size = int(os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    if func in ("comm_checks", "all_checks") and size > 2:
        _SUBSET = hvd.ProcessSet(list(range(1, size)))
        hvd.init(process_sets=[_SUBSET])
    else:
        hvd.init()


# -- optimizer ---------------------------------------------------------------------------------------
def _model(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(rank: int, count: int, seed: int = 0):
    g = torch.Generator().manual_seed(100 + 17 * rank + seed)
    return [(torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(count)]


def _train(make_opt, steps: int = 4, passes: int = 1, opt_cls=torch.optim.SGD, **opt_kw):
    import horovod.torch as hvd

    model = _model()
    # every rank builds the same weights from the seed (hvd.broadcast_parameters would do, but under MPI on
    # a busy machine it costs seconds per call; it is exercised by the elastic test and the example)
    opt = make_opt(opt_cls(model.parameters(), lr=0.1, **opt_kw), model, passes)
    data = _batches(hvd.rank(), steps * passes)
    history = []
    for s in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = data[s * passes + k]
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, opt


class _Tap:
    """A grad hook (same protocol as PDVPipelineEngine.grad_hooks) that records what it sees."""

    def __init__(self):
        self.before_norms, self.after_norms = [], []

    def before(self, engine, grads):
        self.before_norms.append(float(sum(g.double().pow(2).sum() for g in grads)))
        return grads

    def after(self, engine, grads):
        self.after_norms.append(float(sum(g.double().pow(2).sum() for g in grads)))


def optimizer_checks(adasum: bool = False, quick: bool = False) -> Dict[str, Any]:
    """Our DistributedOptimizer against Horovod's, step by step; test aggregators; state round trip."""
    import horovod.torch as hvd

    import pdv_ext.horovod as ph
    from pdv_ext.aggregation import AGGREGATORS

    names = lambda m: m.named_parameters()  # noqa: E731
    out: Dict[str, Any] = {"rank": hvd.rank(), "size": hvd.size()}
    for passes, opt_cls in [(1, torch.optim.SGD), (2, torch.optim.Adam)][:1 if quick else 2]:
        kw = {} if opt_cls is torch.optim.Adam else {"momentum": 0.9}
        ref, _ = _train(lambda o, m, k: hvd.DistributedOptimizer(o, named_parameters=names(m), backward_passes_per_step=k,
                                                                 op=hvd.Average), passes=passes, opt_cls=opt_cls, **kw)
        ours, opt = _train(lambda o, m, k: ph.DistributedOptimizer(o, named_parameters=names(m), backward_passes_per_step=k,
                                                                   aggregation="mean"), passes=passes, opt_cls=opt_cls, **kw)
        out[f"mean_equal_p{passes}"] = all(torch.equal(a, b) for sa, sb in zip(ref, ours) for a, b in zip(sa, sb))
        out[f"mean_native_p{passes}"] = opt._native()
        out[f"isinstance_p{passes}"] = isinstance(opt, opt_cls)

        # the aggregator path for mean (a grad hook forces it): one flattened SUM then 1/size
        tap = _Tap()

        def with_tap(o, m, k):
            opt = ph.DistributedOptimizer(o, named_parameters=names(m), backward_passes_per_step=k, aggregation="mean")
            opt.grad_hooks.append(tap)
            return opt

        agg, opt = _train(with_tap, passes=passes, opt_cls=opt_cls, **kw)
        out[f"mean_agg_maxdiff_p{passes}"] = max(float((a - b).abs().max()) for sa, sb in zip(ref, agg)
                                                 for a, b in zip(sa, sb))
        out[f"mean_agg_equal_p{passes}"] = all(torch.equal(a, b) for sa, sb in zip(ref, agg) for a, b in zip(sa, sb))
        out[f"tap_calls_p{passes}"] = len(tap.before_norms)

    if quick:
        return {**out, **(_adasum_checks() if adasum else {})}
    # a test aggregator using exchange (ring neighbours' average) and all_gather to check itself
    AGGREGATORS.register("hvd_test_ring", RingAverage, override=True)
    ring, opt = _train(lambda o, m, k: ph.DistributedOptimizer(o, named_parameters=names(m),
                                                               aggregation={"type": "hvd_test_ring"}), steps=3)
    out["ring_ok"] = opt.aggregator.ok
    out["ring_steps"] = opt.aggregator.step
    out["ring_final"] = [p.tolist() for p in ring[-1]]
    # the committed state carries the aggregator (type, options, state) and survives a round trip
    sd = opt.state_dict()
    opt.aggregator.step = 99
    opt.load_state_dict(sd)
    out["state_roundtrip"] = opt.aggregator.step == 3 and sd["pdv"]["aggregator"]["type"] == "hvd_test_ring"
    opt.load_state_dict({**sd, "pdv": {**sd["pdv"], "aggregator": {"type": "mean"}, "native_op": hvd.Average}})
    out["state_switch"] = opt.aggregator.name == "mean" and opt._native()
    out.update(_fault_checks())
    if adasum and "adasum" in AGGREGATORS:
        out.update(_adasum_checks())
    return out


def _fault_checks() -> Dict[str, Any]:
    """pdv.faults under Horovod: a NaN-sending rank is named by mean's error on every rank, and median
    trains through it; the faults come from a whole PDVConfig passed as `aggregation` too."""
    import pdv_ext.horovod as ph
    from pdv_ext.aggregation.faults import NonFiniteGradients
    from pdv_ext.config import load_pdv

    names = lambda m: m.named_parameters()  # noqa: E731
    nan = {"byzantine_ranks": [1], "attack": "nan", "start_step": 1}
    res: Dict[str, Any] = {}
    try:
        _train(lambda o, m, k: ph.DistributedOptimizer(o, named_parameters=names(m), aggregation="mean", faults=nan))
        res["faults_mean_error"] = None
    except NonFiniteGradients as exc:
        res["faults_mean_error"] = [exc.ranks, exc.step, "rank(s) 1" in str(exc)]
    cfg = load_pdv({"aggregation": {"type": "median"}, "faults": nan})
    hist, opt = _train(lambda o, m, k: ph.DistributedOptimizer(o, named_parameters=names(m), aggregation=cfg))
    res["faults_median_finite"] = all(bool(torch.isfinite(p).all()) for p in hist[-1])
    res["faults_median_steps"] = opt.global_steps
    res["faults_injected"] = opt.pdv_faults.last if opt.pdv_faults.byzantine else None
    res.update(_amp_overflow_checks())
    return res


def _amp_overflow_checks(steps: int = 4, bad_step: int = 1) -> Dict[str, Any]:
    """loss_scaled=True with torch AMP's GradScaler: rank 1's gradients overflow at `bad_step`; with median
    (which would drop that rank) every rank skips that step together and halves its scale, nobody raises."""
    import horovod.torch as hvd

    import pdv_ext.horovod as ph

    model = _model()
    opt = ph.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  aggregation="median", loss_scaled=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    step = [0]
    model[0].weight.register_hook(lambda g: g * float("inf") if hvd.rank() == 1 and step[0] == bad_step else g)
    data = _batches(hvd.rank(), steps)
    before, scales, moved = None, [], []
    for s in range(steps):
        step[0] = s
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        x, y = data[s]
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
    return {"amp_scales": scales, "amp_moved": moved, "amp_agg_steps": opt.aggregator.step,
            "amp_weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def _adasum_checks() -> Dict[str, Any]:
    """Our adasum through HorovodComm vs Horovod's Adasum allreduce (MPI, power-of-two ranks)."""
    import horovod.torch as hvd

    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.comm import HorovodComm

    tensors = [_rank_tensor(hvd.rank(), n, seed=s) for s, n in enumerate([5, 64, 1000])]
    ours = build_aggregator("adasum").aggregate([t.clone() for t in tensors], HorovodComm())
    res: Dict[str, Any] = {"adasum_ran": True}
    if os.environ.get("OMPI_COMM_WORLD_SIZE") and hvd.size() & (hvd.size() - 1) == 0:
        theirs = [hvd.allreduce(t.clone(), op=hvd.Adasum, name=f"ref.adasum.{i}") for i, t in enumerate(tensors)]
        res["adasum_maxdiff"] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    return res


def policy_checks(steps: int = 6) -> Dict[str, Any]:
    """PolicyHook: built-in `schedule` and the plugin template change batch size, aggregator and LR on
    every rank at the same step; the data position counts every sample once."""
    import horovod.torch as hvd

    import pdv_ext.horovod as ph
    from pdv_ext.policy.data import ElasticBatches

    model = _model()
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    data = ElasticBatches((xs, ys), micro_batch_size=4, dp_rank=hvd.rank(), dp_size=hvd.size(), seed=1, record=True)
    xv, yv = xs[:8], ys[:8]
    opt = ph.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                  aggregation="mean",
                                  validation_loss=lambda: torch.nn.functional.cross_entropy(model(xv), yv))
    cfg = {"policy": {"plugins": [
        {"name": "schedule", "changes": [{"step": 0, "micro_batches": 2, "lr_rule": "linear"},
                                         {"step": 1, "aggregator": {"type": "gossip", "peers": 1, "ratio": 0.5}},
                                         {"step": 2, "gossip_peers": 1},
                                         {"step": 3, "aggregator": {"type": "zeno", "b": 1}},
                                         {"step": 4, "micro_batch_size": 2, "aggregator": "adasum"}]},
        {"name": "launch.my_policy:PlateauLR", "patience": 1, "factor": 0.5, "min_delta": 100.0}]}}
    hook = ph.PolicyHook(opt, config=cfg, micro_batch_size=4, data=data)
    aggs, passes, samples = [], [], 0
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(hook.micro_batches):
            x, y = next(data)
            samples += len(x)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        aggs.append(opt.aggregator.name)
        passes.append(hook.micro_batches)
        m = hook.after_step(loss.item())
    state = hook.state_dict()
    return {"rank": hvd.rank(), "log": hook.runner.action_log, "aggs": aggs, "passes": passes,
            "errors": hook.runner.errors, "lr": opt.param_groups[0]["lr"], "samples": samples,
            "seen": sorted(data.seen), "position": data.position, "gns": m.get("gns"), "loss": m.get("loss"),
            "state_keys": sorted(state), "weights": [p.detach().clone() for p in model.parameters()]}


class FixedShares:
    """A user's share policy (plugin template): from step `at`, the given passes per rank."""

    def __new__(cls, **options):
        from pdv_ext.policy.base import Policy, SetDataShares

        class _Fixed(Policy):
            name = "fixed_shares"

            def after_step(self, metrics):
                if metrics["step"] == options["at"]:
                    return [SetDataShares(options["shares"])]
                return []

        return _Fixed({})


def shares_checks(steps: int = 3, passes: int = 2, mbs: int = 4) -> Dict[str, Any]:
    """Per-rank data shares: the native path, the aggregator path (a grad hook forces it) and a user's
    policy returning SetDataShares, against one process on each step's whole global batch."""
    import horovod.torch as hvd

    import pdv_ext.horovod as ph
    from pdv_ext.policy.data import ElasticBatches

    g = torch.Generator().manual_seed(9)
    xs, ys = torch.randn(240, 6, generator=g), torch.randint(0, 3, (240,), generator=g)
    size, total = hvd.size(), passes * hvd.size()
    out: Dict[str, Any] = {"rank": hvd.rank()}
    runs = {"native": (list(range(size, 0, -1)), None), "aggregator": ([total - size + 1] + [1] * (size - 1), _Tap()),
            "policy": (None, None)}
    for label, (shares, tap) in runs.items():
        model = _model()
        opt = ph.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), backward_passes_per_step=passes)
        data = ElasticBatches((xs, ys), mbs, hvd.rank(), size, seed=2, record=True)
        hook = None
        if tap is not None:
            opt.grad_hooks.append(tap)
        if label == "policy":  # at step 0's boundary: steps 1.. run [1, ..., total - size + 1]
            cfg = {"policy": {"plugins": [{"name": "tests.integration.horovod_workers:FixedShares", "at": 0,
                                           "shares": [1] * (size - 1) + [total - size + 1]}]}}
            hook = ph.PolicyHook(opt, config=cfg, micro_batch_size=mbs, data=data)
        elif shares is not None:
            opt.set_data_shares(shares)
            data.set_shares(shares)
        native = []
        for _ in range(steps):
            opt.zero_grad()
            native.append(opt._native())
            for _ in range(hook.micro_batches if hook is not None else opt.backward_passes_per_step):
                x, y = next(data)
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if hook is not None:
                m = hook.after_step(0.0)
        out[label] = {"weights": [p.detach().clone() for p in model.parameters()], "seen": sorted(data.seen),
                      "shares": opt.data_shares, "native": native,
                      "metrics": {"batch_size": m["batch_size"], "data_shares": m["data_shares"]} if hook else None}
    # one process, the whole global batch of each step: Horovod's convention sums the passes, so the
    # equal split's update is passes x the mean gradient over the step's samples
    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    it = ElasticBatches((xs, ys), mbs, 0, 1, seed=2)
    for s in range(steps):
        idx = it.indices(s * total * mbs, total * mbs)
        ref_opt.zero_grad()
        (passes * torch.nn.functional.cross_entropy(ref_model(xs[idx]), ys[idx])).backward()
        ref_opt.step()
    out["reference"] = [p.detach().clone() for p in ref_model.parameters()]
    return out


def mpi_checks() -> Dict[str, Any]:
    return {"comm": comm_checks(), "optimizer": optimizer_checks(adasum=True, quick=True)}


def all_checks(adasum: bool = True) -> Dict[str, Any]:
    """One launch, three groups of checks (a horovodrun start costs seconds on a busy machine)."""
    return {"comm": comm_checks(), "optimizer": optimizer_checks(adasum=adasum), "policy": policy_checks()}


def elastic_train(outdir: str, target: int = 96, kill_rank: int = 1, kill_step: int = 3,
                  aggregation: str = "adasum", commit_every: int = 1) -> Dict[str, Any]:
    """Elastic training to a fixed number of samples, a commit every `commit_every` steps. The rank
    `kill_rank` writes its pid at step `kill_step` and waits to be killed by the test; the others continue
    (from the last commit)."""
    import horovod.torch as hvd

    import pdv_ext.horovod as ph
    from pdv_ext.policy.data import ElasticBatches

    model = _model()
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)
    data = ElasticBatches((xs, ys), micro_batch_size=4, dp_rank=hvd.rank(), dp_size=hvd.size(), seed=1)
    opt = ph.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=model.named_parameters(), aggregation=aggregation)
    hook = ph.PolicyHook(opt, config={"policy": {"plugins": [
        {"name": "schedule", "changes": [{"step": 1, "lr_scale": 0.5}]}]}}, micro_batch_size=4, data=data)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, policy=hook, samples=0, sizes=[])
    # the aggregator's state after each step, at each commit, and as the reset after the loss left it
    stepped, committed, restored = [], [], []
    restored_norm = []  # gossip: its error feedback as the reset left it

    def on_reset():
        restored.append(_digest(opt.aggregator.state_dict()))
        restored_norm.append(_norm(getattr(opt.aggregator, "residual", None)))

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.samples < target:
            opt.zero_grad()
            for _ in range(hook.micro_batches):
                x, y = next(data)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            hook.after_step(loss.item())
            state.samples += hook.micro_batch_size * hook.micro_batches * hvd.size()
            state.sizes = state.sizes + [hvd.size()]
            stepped.append(_digest(opt.aggregator.state_dict()))
            if len(state.sizes) % commit_every == 0:
                state.commit()
                committed.append(stepped[-1])
            if hvd.rank() == kill_rank and hvd.size() > 1 and len(state.sizes) == kill_step:
                with open(os.path.join(outdir, "kill.pid"), "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(600)  # the test kills this process now

    train(state)
    return {"rank": hvd.rank(), "size": hvd.size(), "samples": state.samples, "sizes": state.sizes,
            "position": data.position, "hook_step": hook.step, "agg_step": opt.aggregator.step,
            "agg": opt.aggregator.name, "log": hook.runner.action_log, "lr": opt.param_groups[0]["lr"],
            "monitor_samples": hook.monitor.samples, "committed": committed, "restored": restored, "stepped": stepped,
            "restored_residual_norm": restored_norm}


def _norm(obj: Any) -> float:
    """The sum of the norms of the tensors under `obj` (a tensor, or dicts / lists of them)."""
    if isinstance(obj, torch.Tensor):
        return float(obj.float().norm())
    if isinstance(obj, dict):
        return sum(_norm(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_norm(v) for v in obj)
    return 0.0


def _digest(obj: Any) -> str:
    """sha256 over a state's tensors (dtype, shape, bytes) and plain values, in key order."""
    import hashlib

    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, dict):
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(b"[")
            for v in o:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()


# -- layouts and precisions (issue #21: strided tensors never break the group; fp16 / bf16) -------------
def _strided(rank: int, seed: int = 0):
    """Strided views of every kind (a matrix column, a transposed matrix, every other element, zero-size, a
    layout that differs between ranks) and contiguous copies of them."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    mat = torch.randn(33, 9, generator=g)
    mixed = torch.randn(5, 6, generator=g)
    if rank % 2:
        mixed = mixed.t().contiguous().t()
    views = [mat[:, 4], torch.randn(17, 70, generator=g).t(), torch.randn(2 * 300, generator=g)[::2],
             torch.empty(0, 2), mixed, torch.randn(3, generator=g)]
    return views, [v.contiguous().clone() for v in views]


def _half_model(dtype, strided: bool = False) -> torch.nn.Module:
    model = _model()
    if strided:  # the first weight stored transposed: a non-contiguous parameter, and so gradient
        lin = model[0]
        lin.weight = torch.nn.Parameter(lin.weight.detach().t().contiguous().t())
        assert not lin.weight.is_contiguous()
    return model.to(dtype)


def _train_model(model, make_opt, steps: int = 3, dtype=torch.float32):
    import horovod.torch as hvd

    opt = make_opt(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for x, y in _batches(hvd.rank(), steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def layout_precision_checks() -> Dict[str, Any]:
    """HorovodComm with bf16/fp16 and strided tensors; adasum_tensors on strided views; Adasum's guard on
    identical tiny gradients; DistributedOptimizer with non-contiguous, fp16 and bf16 parameters."""
    import horovod.torch as hvd

    import pdv_ext.horovod as ph
    from pdv_ext.aggregation import build_aggregator
    from pdv_ext.aggregation.adasum import adasum_tensors
    from pdv_ext.comm import HorovodComm

    comm = HorovodComm()
    r, n = comm.rank, comm.size
    out: Dict[str, Any] = {"rank": r, "size": n}
    # Horovod itself refuses bf16 and non-contiguous tensors (before sending anything)
    for key, fn in [("hvd_bf16", lambda: hvd.allreduce(torch.ones(2, dtype=torch.bfloat16), name="probe.bf16")),
                    ("hvd_noncontig", lambda: hvd.allreduce(torch.ones(3, 4)[:, 1], name="probe.nc"))]:
        try:
            fn()
            out[key] = "accepted"
        except Exception as exc:  # noqa: BLE001 - what Horovod says is the record
            out[key] = str(exc)
    # HorovodComm: every primitive in half precisions, on strided tensors too
    for dt in (torch.float16, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        every = [_rank_tensor(i, 7).to(dt) for i in range(n)]
        mine = every[r]
        ref_sum = torch.stack([e.float() for e in every]).sum(0).to(dt)
        col = torch.zeros(7, 3, dtype=dt)
        col[:, 1] = mine
        view = col[:, 1]
        comm.all_reduce(view, "sum")
        out[f"{name}_sum_strided"] = (bool(torch.allclose(view.float(), ref_sum.float(), rtol=1e-2, atol=1e-2))
                                      and bool((col[:, 0] == 0).all()) and bool((col[:, 2] == 0).all()))
        out[f"{name}_avg"] = bool(torch.allclose(comm.all_reduce(mine.clone(), "avg").float(),
                                                 torch.stack([e.float() for e in every]).mean(0), atol=1e-2))
        out[f"{name}_max"] = bool(torch.equal(comm.all_reduce(mine.clone(), "max"), torch.stack(every).max(0).values))
        out[f"{name}_gather"] = all(torch.equal(a, b) for a, b in zip(comm.all_gather(mine), every))
        b = mine.clone()
        comm.broadcast(b, src=n - 1)
        out[f"{name}_bcast"] = bool(torch.equal(b, every[n - 1]))
        out[f"{name}_varsize"] = all(torch.equal(a, b) for a, b in
                                     zip(comm.all_gather_varsize(mine[: r + 1]), [e[: i + 1] for i, e in enumerate(every)]))
        # exchange into one-element pieces of a matrix column (stride 3, yet "contiguous")
        dst = torch.zeros(4, 3, dtype=dt)
        comm.exchange({(r + 1) % n: mine[:4]}, {(r - 1) % n: [dst[i:i + 1, 1].view(1) for i in range(4)]})
        out[f"{name}_exchange_pieces"] = bool(torch.equal(dst[:, 1], every[(r - 1) % n][:4]))
    # adasum_tensors on strided views (the reported failure at 4 ranks) equals contiguous copies
    views, copies = _strided(r, seed=1)
    adasum_tensors(views, comm)
    adasum_tensors(copies, comm)
    out["adasum_strided_equal"] = all(torch.equal(v, c) for v, c in zip(views, copies))
    out["adasum_strided_result"] = [c.clone() for c in copies]
    # identical tiny / huge gradients come back as their mean (Horovod's sqrt(DBL_MIN) guard)
    for dt, v in [(torch.float32, 1e-30), (torch.float32, 1e30), (torch.float16, 1e-4), (torch.float16, 6e-8),
                  (torch.bfloat16, 1e-30)]:
        g = torch.full((5,), v, dtype=torch.float64).to(dt)
        res = build_aggregator("adasum")([g.clone(), g.clone()[:3]], comm)
        out[f"adasum_identical_{str(dt).replace('torch.', '')}_{v:g}"] = bool(torch.equal(res[0], g) and torch.equal(res[1], g[:3]))
    # DistributedOptimizer: a non-contiguous parameter gives the weights of the same model stored contiguously
    names = lambda m: m.named_parameters()  # noqa: E731
    for agg in ("mean", "adasum", "median"):
        w_strided, _ = _train_model(_half_model(torch.float32, strided=True),
                                    lambda o, m: ph.DistributedOptimizer(o, named_parameters=names(m), aggregation=agg))
        w_plain, _ = _train_model(_half_model(torch.float32),
                                  lambda o, m: ph.DistributedOptimizer(o, named_parameters=names(m), aggregation=agg))
        # a transposed weight changes the matmul's summation order: equal up to float rounding
        out[f"opt_strided_{agg}_maxdiff"] = max(float((a - b).abs().max()) for a, b in zip(w_strided, w_plain))
        out[f"opt_strided_{agg}_weights"] = w_strided
    # fp16 / bf16 models: native mean, mean through the aggregator path (a grad hook), adasum, median
    for dt in (torch.float16, torch.bfloat16):
        name = str(dt).replace("torch.", "")
        res = {}
        for label, agg, hook in [("mean", "mean", False), ("mean_agg", "mean", True), ("adasum", "adasum", False),
                                 ("median", "median", False)]:
            def make(o, m, agg=agg, hook=hook):
                opt = ph.DistributedOptimizer(o, named_parameters=names(m), aggregation=agg)
                if hook:
                    opt.grad_hooks.append(_Tap())
                return opt
            try:
                w, opt = _train_model(_half_model(dt, strided=True), make, dtype=dt)
                res[label] = w
                out[f"opt_{name}_{label}_dtype"] = all(p.dtype == dt for p in w)
                out[f"opt_{name}_{label}_finite"] = all(bool(torch.isfinite(p.float()).all()) for p in w)
                out[f"opt_{name}_{label}_native"] = opt._native()
            except Exception as exc:  # noqa: BLE001 - reported, the test names it
                out[f"opt_{name}_{label}_error"] = f"{type(exc).__name__}: {exc}"
        out[f"opt_{name}_weights"] = res
        if "mean" in res and "mean_agg" in res:  # same mean, rounded differently (one vs two roundings)
            out[f"opt_{name}_mean_paths_maxdiff"] = max(float((a.float() - b.float()).abs().max())
                                                        for a, b in zip(res["mean"], res["mean_agg"]))
    return out


from pdv_ext.aggregation import Aggregator  # noqa: E402


class RingAverage(Aggregator):
    """Test aggregator: the average of my gradient and my ring neighbours' (via `exchange`), checked
    against the same average computed from `all_gather` — exercises exchange inside an aggregator."""

    name = "hvd_test_ring"

    def __init__(self, options=None, **kw):
        super().__init__(options, **kw)
        self.ok = True

    def aggregate(self, grads, comm):
        r, n = comm.rank, comm.size
        peers = sorted({(r + 1) % n, (r - 1) % n} - {r})
        out = []
        for g in grads:
            got = {p: torch.empty_like(g) for p in peers}
            comm.exchange({p: g for p in peers}, got)
            avg = (g + sum(got.values())) / (1 + len(peers))
            every = comm.all_gather(g)
            ref = (every[r] + sum(every[p] for p in peers)) / (1 + len(peers))
            self.ok = self.ok and bool(torch.allclose(avg, ref))
            out.append(avg)
        return out


def main(argv: Sequence[str]) -> None:
    func, outdir, kwargs = argv[0], argv[1], json.loads(argv[2])
    import horovod.torch as hvd

    _init(func)
    if func == "elastic_train":
        kwargs["outdir"] = outdir
    result = globals()[func](**kwargs)
    with open(os.path.join(outdir, f"result{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump(result, f)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
