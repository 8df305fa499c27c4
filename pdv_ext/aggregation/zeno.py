"""`zeno`: keep the candidates that descend on trusted validation data (Zeno / Zeno++, first-order form).

Every candidate of the group is scored with  score_i = gamma <v, g_i> - rho |g_i|^2,  v being the
group's mean gradient on validation data (each rank computes its own on its validation batch; averaging
the ranks' scores is scoring with the mean), and the m - b best are averaged. Computed on slices: every
rank gets all candidates' and all validation gradients' entries of its 1/m slice (two all-to-alls), its
partial dot products and norms are summed over the slices in rank order (one all-gather of 2m floats:
the same scores, bitwise, on every rank, so every replica keeps the same candidates), it averages the
kept candidates on its slice, and an all-gather rebuilds the result. Candidates with NaN/Inf score -inf
and are always dropped.

Data shares ("weight"): the scores decide who is kept, whatever the shares; the kept candidates are then
averaged weighted by their shares of the step's samples (sum_i n_i g_i / sum_i n_i over the kept), so with
nobody dropped zeno returns `mean`'s sample-weighted mean. Equal shares: the plain average below, unchanged.

Small groups: a group of m ranks supports b <= m - 1 (one honest candidate is all Zeno needs); a larger
b is clamped with one GroupSizeWarning, and a group of one is the identity (no validation gradient needed).

Host syncs on CUDA: none for the scores (float64 dot products and norms on the device, summed over the
slices on the device); one device-to-host copy of the m scores and the finite mask per call, because who
is kept is a host decision (and the report lists it). Whether some rank refreshed its validation
gradient is agreed on host flags (`Comm.all_reduce_scalars`): no device sync on gloo, Horovod, or NCCL
as pdv's integrations set it up (`TorchComm` with a gloo twin, `host_twin`, carries CPU tensors); a bare
NCCL `TorchComm` moves those 8 bytes through the GPU, a second sync. The kept candidates are averaged on
the device in score order with plain adds and one true division, so CPU and CUDA give the same bits for
the same kept set (the scores themselves agree to float64 rounding: the dot products' summation order is
the device's).

Where v comes from: `set_validation_grads(list)` (the pipeline engine does this every `refresh_every`
steps from one extra forward/backward micro-batch of `validation_iter`), or a `validation_fn` callable
returning the list (standalone). Between refreshes the last v is reused (Zeno++'s stale validation).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
from pydantic import Field, model_validator

from ..comm.base import Comm
from ..config_base import StrictModel
from .base import register_aggregator
from .. import kernels
from .robust import (RobustAggregator, bad_ranks, flat_dtype, flatten_as, require_some_finite, scatter_slices,
                     device_path, exact, sum_partials, to_host)


#: columns per float64 block of the device dot products: never an (m, n) float64 copy of the candidates
BLOCK = 1 << 16


def dots64(rows: torch.Tensor, v: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """(<rows_i, v>, |rows_i|^2) for every row, accumulated in float64 on the rows' device (no host sync),
    one column block at a time. CPU tensors take `kernels.adasum_dots` (fused C++), as before."""
    if not device_path(rows):
        dot, g2, _ = kernels.adasum_dots(list(rows), [v] * rows.shape[0])
        return dot, g2
    m, n = rows.shape
    dot = torch.zeros(m, dtype=torch.float64, device=rows.device)
    g2 = torch.zeros(m, dtype=torch.float64, device=rows.device)
    for lo in range(0, n, BLOCK):
        blk = rows[:, lo:lo + BLOCK].to(torch.float64)
        dot += torch.mv(blk, v[lo:lo + BLOCK].to(torch.float64))
        g2 += (blk * blk).sum(dim=1)
    return dot, g2


@register_aggregator("zeno")
class Zeno(RobustAggregator):
    """Validation-scored selection: drops the `b` lowest-scoring ranks each step."""

    needs_validation = True
    shares = "weight"
    per_parameter_state = ("v",)

    class Options(StrictModel):
        #: step size assumed by the score gamma <v, g> - rho |g|^2 (only rho / gamma matters for the choice)
        gamma: float = Field(1.0, gt=0)
        #: penalty on the candidate's squared norm
        rho: float = Field(0.05, ge=0)
        #: candidates dropped each step (the Byzantine ranks tolerated); alias `byzantine`
        b: Optional[int] = Field(None, ge=0)
        byzantine: Optional[int] = Field(None, ge=0)
        #: recompute the validation gradient every this many steps (pipeline engine / validation_fn)
        refresh_every: int = Field(1, ge=1)

        @model_validator(mode="after")
        def _one_b(self):
            if self.b is not None and self.byzantine is not None and self.b != self.byzantine:
                raise ValueError("give either b or its alias byzantine, not two different values")
            return self

        @property
        def dropped(self) -> int:
            return self.b if self.b is not None else (self.byzantine if self.byzantine is not None else 1)

    def __init__(self, options=None, validation_fn: Optional[Callable[[], List[torch.Tensor]]] = None, **kw):
        super().__init__(options, **kw)
        self.validation_fn = validation_fn
        self._v: Optional[torch.Tensor] = None
        self._v_step = -1
        self._vrows: Optional[torch.Tensor] = None  # every rank's v on this rank's slice (scatter buffer)
        self._vsum: Optional[torch.Tensor] = None   # their sum, what the scores use; None when v changed

    def set_validation_grads(self, grads: List[torch.Tensor]) -> None:
        """Hand over this rank's validation gradient (same tensors/order as the gradients aggregated)."""
        self._v = flatten_as([g.detach() for g in grads], flat_dtype(grads))  # scored in float64 (kernels)
        self._v_step = self.step
        self._vsum = None

    group_limits = {"b": (lambda m: m - 1, "dropping b candidates needs more than b ranks")}

    def requested(self, key: str) -> int:
        return self.options.dropped

    def option_key(self, key: str) -> str:
        return "byzantine" if self.options.b is None and self.options.byzantine is not None else "b"

    def needs_refresh(self) -> bool:
        if self.group_size == 1:  # a group of one keeps its only candidate: nothing to score
            return False
        return self._v is None or self.step - self._v_step >= self.options.refresh_every

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        opt, m = self.options, comm.size
        b = self.fit_group(comm)["b"]
        if m == 1:
            return self.alone(grads, "zeno")
        if self.validation_fn is not None and self.needs_refresh():
            self.set_validation_grads(self.validation_fn())
        if self._v is None:
            raise RuntimeError("zeno: no validation gradient; pass validation_iter to pdv_ext.initialize, or call "
                               "set_validation_grads()/give validation_fn when using the aggregator standalone")
        n = sum(g.numel() for g in grads)
        if n != self._v.numel():
            raise ValueError(f"zeno: validation gradient has {self._v.numel()} elements, gradients {n}")
        rows, finite = self.slices(grads, comm)  # every candidate's entries of this rank's slice
        # every rank's validation gradient on this slice, summed: the group's mean v, times m. Scattered
        # again only when some rank's v changed since (agreed on host flags: the scatter is collective);
        # between refreshes (Zeno++'s stale v, refresh_every > 1) the slices are reused
        stale = (self._vsum is None or self._vsum.shape != rows.shape[1:] or self._vsum.dtype != rows.dtype
                 or self._vsum.device != rows.device)
        if comm.all_reduce_scalars([float(stale)])[0] > 0:
            self._vrows = scatter_slices(self._v.to(device=rows.device, dtype=rows.dtype), comm, self._vrows)
            self._vsum = self._vrows.sum(dim=0)
        vsum = self._vsum
        # partial <sum_r v_r, g_i> and |g_i|^2 of every candidate on this slice, float64 (a non-finite one
        # gives NaN/Inf here, masked below), summed over the slices in rank order (identical everywhere)
        dot, g2 = dots64(rows, vsum)
        dot, g2 = sum_partials(torch.stack([dot, g2]), comm)
        # the group-averaged score gamma <mean_r v_r, g_i> - rho |g_i|^2; an over/underflowed one counts as
        # the worst finite score; non-finite candidates score -inf
        scores = torch.nan_to_num(opt.gamma * dot / exact(m, dot) - opt.rho * g2, nan=-1e300, posinf=-1e300,
                                  neginf=-1e300)
        scores = torch.where(finite, scores, torch.full_like(scores, float("-inf")))
        scores, fin = to_host(scores, finite)  # the call's one host sync: who is kept is a host decision
        fin = fin > 0
        require_some_finite(fin, "zeno", self.step)
        n_keep = max(1, min(m - b, int(fin.sum())))
        order = torch.argsort(scores, descending=True, stable=True)
        keep, drop = order[:n_keep].tolist(), order[n_keep:]
        shares = self.share_weights()
        if shares is None:
            out = rows[keep[0]].clone()  # the mean of the kept rows on this slice, without copying them out
            for i in keep[1:]:
                out.add_(rows[i])
            out.div_(exact(n_keep, out))
        else:  # the kept rows weighted by their shares: one coefficient per row, computed on the host
            total = sum(shares[i] for i in keep)
            out = rows[keep[0]] * (shares[keep[0]] / total)
            for i in keep[1:]:
                out.add_(rows[i] * (shares[i] / total))
        self.report = {"dropped": sorted(int(i) for i in drop), "nonfinite": bad_ranks(fin),
                       "scores": [float(x) for x in scores]}
        return self.finish_slices(out, grads, comm)

    def state_dict(self):
        return {**super().state_dict(), "v": self._v, "v_step": self._v_step}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self._v = state.get("v")
        self._v_step = int(state.get("v_step", -1))
        self._vsum = None
