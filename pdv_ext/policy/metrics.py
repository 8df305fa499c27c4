"""The Monitor: cheap per-step training metrics, identical on every rank.

Per step each rank contributes a few scalars — its wall step time, its compute time (forward+backward,
what reveals a straggler: wall times are equalised by the collectives), the sums of squares of its local
and of its aggregated gradients, the loss, and what the aggregator reported — and ONE all-gather over
the world makes them known everywhere. From them: samples/s, per-rank times, and the gradient noise
scale (pdv_ext.policy.gns). Rank 0 writes `metrics.csv` (and TensorBoard events when `tensorboard` is
importable). Framework-independent: it takes a Comm; the DeepSpeed glue (pdv_ext.integrations.deepspeed.glue) feeds
it from grad hooks, Horovod from its optimizer hook.
"""
from __future__ import annotations

import csv
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..aggregation.base import group_by_dtype, wide_dtype
from ..comm.base import Comm
from ..log import logger
from .config import MonitorConfig
from .gns import GNSEstimator

#: the per-rank scalars gathered each step, in order
SLOTS = ("wall", "compute", "local_sq", "agg_sq", "loss", "dropped", "consensus_distance", "grads")  # window means

#: CSV columns, in order (per-rank columns `compute_r{i}` are appended; absent values are left empty)
COLUMNS = ("step", "time", "samples", "batch_size", "micro_batches", "micro_batch_size", "loss", "lr",
           "step_time", "samples_per_s", "gns", "grad_sq", "noise", "compute_max", "compute_min",
           "slowest_rank", "dropped", "consensus_distance")


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ|t|² over `tensors` as a float64 0-d tensor (stays on device: no sync until read). Norms are taken
    in float32 at least: an fp16 norm overflows at 65504, which loss-scaled fp16 gradients reach."""
    ts = [t for t in tensors if t is not None and t.numel()]
    if not ts:
        return torch.zeros((), dtype=torch.float64)
    try:
        norms = [n for dt, idx in group_by_dtype(ts).items()
                 for n in torch._foreach_norm([ts[i] for i in idx], 2, dtype=wide_dtype(dt))]
    except (RuntimeError, TypeError):  # mixed devices, or an old torch
        norms = [t.norm(dtype=wide_dtype(t.dtype)) for t in ts]
    return torch.stack([n.to(torch.float64, copy=False).reshape(()) for n in norms]).square().sum()


def _report_scalars(report: Dict[str, Any]) -> tuple:
    """(dropped count, consensus distance) from an aggregator's `report` (NaN when it says nothing)."""
    dropped = report.get("dropped", report.get("dropped_ranks"))
    if dropped is None:
        n = math.nan
    elif isinstance(dropped, (int, float)):
        n = float(dropped)
    else:
        n = float(len(dropped))
    cd = report.get("consensus_distance")
    return n, float(cd) if isinstance(cd, (int, float)) else math.nan


class Monitor:
    """Collects one step's local scalars, gathers them over `comm`, and returns the step's metrics.

    Use: `begin_step()`; during the step `add_local_grads(grads)` / `add_aggregated_grads(grads)` (the
    grad hook does it) and `add_compute(seconds)`; then `end_step(...)` (collective) -> metrics dict.
    `dp_size` is the number of data-parallel replicas (every rank of a replica, across pipeline stages,
    contributes a slice of that replica's gradient norm).
    """

    def __init__(self, comm: Comm, dp_size: int, config: Optional[MonitorConfig] = None, every: int = 1,
                 sync: Optional[Callable[[], None]] = None, layout: Optional[Sequence[Sequence[int]]] = None):
        self.comm = comm
        #: (pipeline stage, data-parallel replica) of every rank of `comm`, by rank: what a per-rank time
        #: belongs to (default: one stage, rank r is replica r)
        self.layout = [tuple(map(int, x)) for x in layout] if layout is not None else \
            [(0, r) for r in range(comm.size)]
        #: micro-batches per replica when the data shares are unequal (None: equal), set by the applier
        self.shares: Optional[List[int]] = None
        #: waits for the device at `end_step` (GPU ranks: `torch.cuda.synchronize`): the host only queues a
        #: step's kernels, so without it the step's wall time would miss their tail. Training loops read the
        #: loss every step, which waits for the same work, so it costs little more than moving that wait.
        self._sync = sync
        self.every = int(every)
        self._reset_window()
        self.dp_size = int(dp_size)
        self.config = config or MonitorConfig()
        self.gns = GNSEstimator(self.config.ema)
        self.rows: List[Dict[str, Any]] = []
        self.samples = 0
        self._extra: Dict[str, Any] = {}
        self._t0 = time.perf_counter()
        self._start = time.time()
        self._writer: Optional[_Writer] = None
        if comm.rank == 0 and self.config.output_dir:
            self._writer = _Writer(self.config.output_dir, self.config.tensorboard, self.config.flush_every)
        self.begin_step()

    # ---- inputs during a step -------------------------------------------------------------------
    def begin_step(self, step: Optional[int] = None) -> None:
        """Start the clock of step `step` (1-based, as end_step will get it). With `every` > 1 and a step
        given, gradient norms are measured on the window's last step only (the GNS then gets one sample
        per window: the cost of the two norm passes is divided by `every`)."""
        self._norms_now = self.config.gns and (step is None or step % self.every == 0)
        self._t0 = time.perf_counter()
        self._compute = 0.0
        self._spans: List[tuple] = []
        self._local_sq: Optional[torch.Tensor] = None
        self._agg_sq: Optional[torch.Tensor] = None

    def add_compute(self, seconds: float) -> None:
        self._compute += seconds

    def add_compute_span(self, start: Any, end: Any) -> None:
        """Compute measured on a device: a pair of recorded timing events (`torch.cuda.Event(enable_timing=
        True)`). On a GPU the host only queues the work, so a host clock around forward/backward measures
        launches, not compute; the events time the device. They are read on the window's reporting step
        (complete by then: the step's end waits for the device, see `sync`)."""
        self._spans.append((start, end))

    @property
    def norms_now(self) -> bool:
        """Whether this step's gradient norms are measured (the noise scale on, the window's last step)."""
        return bool(self._norms_now)

    def add_local_grads(self, grads: Sequence[torch.Tensor]) -> None:
        if self._norms_now:
            s = sum_of_squares(grads)
            self._local_sq = s if self._local_sq is None else self._local_sq + s

    def add_aggregated_grads(self, grads: Sequence[torch.Tensor]) -> None:
        if self._norms_now:
            s = sum_of_squares(grads)
            self._agg_sq = s if self._agg_sq is None else self._agg_sq + s

    def note(self, **values: Any) -> None:
        """Extra columns for this step's row (e.g. `val_loss`), written by rank 0."""
        self._extra.update(values)

    # ---- the collective -------------------------------------------------------------------------
    def end_step(self, step: int, loss: Optional[float], lr: Optional[float], micro_batch_size: int,
                 micro_batches: int, report: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
        """Close the step. On every `every`-th step (collective): gather the window's scalars from every
        rank and return the metrics (identical on all ranks; times and norms are window means). On the
        other steps: no communication, rank 0 records its local view, returns None."""
        if self._sync is not None:
            self._sync()
        wall = time.perf_counter() - self._t0
        has = self._local_sq is not None and self._agg_sq is not None
        dropped, cd = _report_scalars(report or {})
        w = self._window
        w["n"] += 1
        w["wall"] += wall
        w["compute"] += self._compute
        w["spans"] += self._spans
        if has:
            w["grads"] += 1
            local_sq, agg_sq = torch.stack([self._local_sq, self._agg_sq.to(self._local_sq.device)]).tolist()
            w["local_sq"] += local_sq
            w["agg_sq"] += agg_sq
        if not math.isnan(dropped):
            w["dropped"] = dropped if math.isnan(w["dropped"]) else max(w["dropped"], dropped)
        if not math.isnan(cd):
            w["cd"] = cd
        batch = micro_batch_size * micro_batches * self.dp_size
        self.samples += batch
        if step % self.every:
            self._record({"step": step, "time": time.time() - self._start, "samples": self.samples,
                          "batch_size": batch, "micro_batches": micro_batches, "micro_batch_size": micro_batch_size,
                          "loss": loss, "lr": lr, "step_time": wall,
                          "samples_per_s": batch / wall if wall > 0 else math.nan})
            self.begin_step()
            return None
        self._drain_spans()
        n, g = w["n"], max(w["grads"], 1)
        mine = torch.tensor([w["wall"] / n, w["compute"] / n, w["local_sq"] / g, w["agg_sq"] / g,
                             math.nan if loss is None else float(loss), w["dropped"], w["cd"],
                             1.0 if w["grads"] else 0.0], dtype=torch.float64, device=self.comm.payload_device)
        rows = (torch.stack(self.comm.all_gather(mine)) if self.comm.size > 1 else mine[None]).cpu()
        m = self._combine(rows, step, lr, micro_batch_size, micro_batches)
        self._record(m)
        self._reset_window()
        self.begin_step()
        return m

    def _reset_window(self) -> None:
        self._window = {"n": 0, "wall": 0.0, "compute": 0.0, "local_sq": 0.0, "agg_sq": 0.0, "grads": 0,
                        "dropped": math.nan, "cd": math.nan, "spans": []}

    def _combine(self, rows: torch.Tensor, step: int, lr: Optional[float], mbs: int, mb: int) -> Dict[str, Any]:
        col = {k: rows[:, i] for i, k in enumerate(SLOTS)}
        batch = mbs * mb * self.dp_size
        wall = float(col["wall"].max())
        compute = col["compute"].tolist()
        shares = list(self.shares) if self.shares is not None else [mb] * self.dp_size
        m: Dict[str, Any] = {
            "step": step, "time": time.time() - self._start, "samples": self.samples, "batch_size": batch,
            "micro_batches": mb, "micro_batch_size": mbs, "dp_size": self.dp_size, "lr": lr,
            "step_time": wall, "step_times": col["wall"].tolist(), "compute_times": compute,
            "samples_per_s": batch / wall if wall > 0 else math.nan,
            "data_shares": shares, "stage_of_rank": [s for s, _ in self.layout],
            "replica_of_rank": [d for _, d in self.layout],
        }
        losses = col["loss"][~torch.isnan(col["loss"])]
        m["loss"] = float(losses[0]) if len(losses) else None
        if any(c > 0 for c in compute):
            m["compute_max"], m["compute_min"] = max(compute), min(compute)
            m["slowest_rank"] = int(max(range(len(compute)), key=compute.__getitem__))
        for key in ("dropped", "consensus_distance"):
            v = col[key][~torch.isnan(col[key])]
            if len(v):
                m[key] = float(v.max())
        if self.config.gns and bool((col["grads"] > 0).all()):
            # each replica's full-model |g|² is spread over its stages: sum over all ranks / replicas
            local_sq = float(col["local_sq"].sum()) / self.dp_size
            agg_sq = float(col["agg_sq"].sum()) / self.dp_size
            # the replicas' local batches: with unequal shares their harmonic mean keeps the estimate
            # unbiased (E mean_d |g_d|² = |G|² + S mean_d 1/B_d); the aggregate is the whole batch's mean
            b_small = len(shares) / sum(1.0 / (mbs * n) for n in shares) if self.shares is not None else mbs * mb
            m["local_sq"], m["agg_sq"] = local_sq, agg_sq
            if self.dp_size > 1:
                self.gns.update(local_sq, agg_sq, b_small, mbs * mb * self.dp_size)
                m["gns"], m["grad_sq"], m["noise"] = self.gns.gns, self.gns.grad_sq, self.gns.noise
        return m

    def _record(self, m: Dict[str, Any]) -> None:
        if self._extra:
            m.update(self._extra)
            self._extra = {}
        if self.comm.rank != 0:
            return
        row = {k: v for k, v in m.items() if not isinstance(v, list)}
        if self.shares is not None and m.get("data_shares"):  # unequal shares: micro-batches per replica
            row["data_shares"] = "/".join(str(n) for n in m["data_shares"])
        for i, c in enumerate(m.get("compute_times", [])):
            row[f"compute_r{i}"] = c
        self.rows.append(row)
        if self._writer is not None:
            self._writer.write(row)

    def update_last(self, **values: Any) -> None:
        """Add columns to the last recorded row (e.g. a held-out loss evaluated after the step)."""
        if self.comm.rank != 0 or not self.rows:
            return
        self.rows[-1].update(values)
        if self._writer is not None:
            self._writer.update_last(values)

    def open(self, output_dir: str) -> None:
        """Start writing metrics.csv (+ TensorBoard) under `output_dir` (rank 0; earlier rows included).
        Says so in one log line: the start-up summary, logged before, said where the metrics went then."""
        if self.comm.rank != 0:
            return
        self.close()
        self._writer = _Writer(output_dir, self.config.tensorboard, self.config.flush_every)
        logger.info("monitor -> %s", self._writer.path)
        for row in self.rows:
            self._writer.write(row)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ---- checkpoints ----------------------------------------------------------------------------
    def _drain_spans(self) -> None:
        """Fold the window's device-timed spans into its compute seconds (one wait on the last event;
        after the step's end waited for the device, none)."""
        w = self._window
        if w["spans"]:
            w["spans"][-1][1].synchronize()
            w["compute"] += sum(a.elapsed_time(b) for a, b in w["spans"]) / 1e3
            w["spans"] = []

    def state_dict(self) -> Dict[str, Any]:
        self._drain_spans()  # CUDA events do not pickle: a checkpoint between agreement steps keeps seconds
        return {"gns": self.gns.state_dict(), "samples": self.samples, "window": dict(self._window)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.gns.load_state_dict(state["gns"])
        self.samples = int(state.get("samples", 0))
        if "window" in state:
            self._window = {"spans": [], **dict(state["window"])}


class _Writer:
    """metrics.csv (header grows when new columns appear: the file is rewritten) + TensorBoard."""

    def __init__(self, output_dir: str, tensorboard: bool, flush_every: int):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.csv")
        self.flush_every = flush_every
        self.rows: List[Dict[str, Any]] = []
        self.header: List[str] = []
        self.f = open(self.path, "w", newline="", encoding="utf-8")
        self.csv: Optional[csv.DictWriter] = None
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:  # tensorboard not installed: CSV only
                self.tb = None

    def write(self, row: Dict[str, Any], tb: bool = True) -> None:
        self.rows.append(row)
        new = [k for k in row if k not in self.header]
        if new or self.csv is None:
            known = [c for c in COLUMNS if c in self.header or c in row]
            rest = [k for k in self.header + new if k not in COLUMNS]
            self.header = known + rest
            self.f.seek(0)
            self.f.truncate()
            self.csv = csv.DictWriter(self.f, fieldnames=self.header, extrasaction="ignore")
            self.csv.writeheader()
            for r in self.rows:
                self.csv.writerow(_fmt(r))
        else:
            self.csv.writerow(_fmt(row))
        if len(self.rows) % self.flush_every == 0:
            self.f.flush()
        if tb and self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self.tb.add_scalar(f"pdv/{k}", v, int(row["step"]))

    def update_last(self, values: Dict[str, Any]) -> None:
        self.rows[-1].update(values)
        self.csv = None  # rewrite the file (new columns; rare: evaluations)
        self.write(self.rows.pop(), tb=False)
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"pdv/{k}", v, int(self.rows[-1]["step"]))

    def close(self) -> None:
        self.f.close()
        if self.tb is not None:
            self.tb.close()


def _fmt(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)) for k, v in row.items()}
