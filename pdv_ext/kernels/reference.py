"""The torch reference of every kernel op: the definition the C++ and Triton kernels are tested against,
and the implementation for devices and dtypes neither covers.

Device-friendly: results stay on the inputs' device and nothing reads a device value back to the host
(no `.item()`, `.tolist()`, Python-scalar writes - `t[idx] = 0` is a blocking copy of the 0 - or
data-dependent shapes), so on a GPU without Triton a call is a queue of kernel launches, not a host
synchronisation per tensor (`tests/unit/test_host_sync_audit.py` audits every op on CPU). Arguments are assumed checked
(`pdv_ext.kernels` validates them); any layout works, since every op reads through reshape/copy_.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

F64 = torch.float64


def _device(tensors: Sequence[torch.Tensor]) -> torch.device:
    return tensors[0].device if len(tensors) else torch.device("cpu")


def adasum_dots(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a_i·b_i, |a_i|², |b_i|²) per pair, float64 products and sums, three float64 tensors on the device."""
    if not len(a):
        z = torch.zeros(0, dtype=F64, device=_device(a))
        return z, z.clone(), z.clone()
    rows = []
    for x, y in zip(a, b):
        x64, y64 = x.reshape(-1).to(F64), y.reshape(-1).to(F64)
        rows.append(torch.stack((torch.dot(x64, y64), torch.dot(x64, x64), torch.dot(y64, y64))))
    out = torch.stack(rows, dim=1)
    return out[0], out[1], out[2]


def adasum_combine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], ca: torch.Tensor, cb: torch.Tensor,
                   out: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    """out_i = ca_i a_i + cb_i b_i in float64, rounded once to the dtype; the coefficients stay tensors
    (moved to the device without a host round trip)."""
    if not len(a):
        return list(out) if out is not None else []
    dev = _device(a)  # a copy to the host must complete before it is read: only copies to a device overlap
    ca64 = ca.to(device=dev, dtype=F64, non_blocking=dev.type != "cpu")
    cb64 = cb.to(device=dev, dtype=F64, non_blocking=dev.type != "cpu")
    res = []
    for i, (x, y) in enumerate(zip(a, b)):
        val = (x.to(F64) * ca64[i] + y.to(F64).reshape(x.shape) * cb64[i]).to(x.dtype)
        if out is not None:
            out[i].copy_(val.reshape(out[i].shape))
            val = out[i]
        res.append(val)
    return res


def abs_key(acc: torch.Tensor) -> torch.Tensor:
    """|acc| as integers that order like |acc|, every NaN mapped to the canonical NaN (above +inf)."""
    if acc.dtype == torch.float64:
        key = acc.abs().view(torch.int64)
        nan = 0x7FF8000000000000
    else:
        key = acc.abs().float().view(torch.int32)
        nan = 0x7FC00000
    return key.masked_fill(torch.isnan(acc), nan)


def compact(take: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the True entries of `take`, known to number exactly k, without the host sync
    of nonzero(): the j-th taken entry is where the running count first reaches j + 1 (a binary search;
    deterministic, unlike a scatter, under torch.use_deterministic_algorithms)."""
    count = take.cumsum(0)
    return torch.searchsorted(count, torch.arange(1, k + 1, device=take.device))


def topk_error_feedback(update: torch.Tensor, residual: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest |update + residual| (ascending int64 indices, NaN above +inf, ties to the lower index),
    zeroed in residual, which keeps the rest. Threshold by torch.topk; the ties at the threshold are taken
    in index order by a running count - all on the device."""
    acc = update.reshape(-1) + residual.reshape(-1)
    n = acc.numel()
    k = max(0, min(int(k), n))
    if k == 0:
        idx = torch.empty(0, dtype=torch.int64, device=acc.device)
    elif k == n:
        idx = torch.arange(n, device=acc.device)
    else:
        key = abs_key(acc)
        thr = torch.topk(key, k, sorted=False).values.min()
        above, tie = key > thr, key == thr
        take = above | (tie & (tie.cumsum(0) <= k - above.sum()))
        idx = compact(take, k)
    vals = acc.index_select(0, idx)
    acc.index_fill_(0, idx, 0)  # not `acc[idx] = 0`: on CUDA that copies the 0 to the device and waits
    residual.copy_(acc.view(residual.shape))
    return idx, vals


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Median over dim 0 (mean of the two middle values for even m, in the dtype); NaN sorts above +inf."""
    s = stack.sort(dim=0).values
    m = s.shape[0]
    if m % 2:
        return s[m // 2].clone()
    return (s[m // 2 - 1] + s[m // 2]) / 2


def trimmed_mean(stack: torch.Tensor, trim: int) -> torch.Tensor:
    """Mean over dim 0 without the `trim` largest and smallest per coordinate: the kept values summed in
    ascending order in float64, divided (a true, correctly rounded division), rounded once.

    The count is divided by as a 0-dim tensor on the device: torch on CUDA divides a tensor by a Python
    number as a product with the number's rounded reciprocal (BinaryDivTrueKernel.cu), which missed the
    CPU's quotient by one ulp in ~15% of float64 elements (GPU tier, H200); by a device tensor it divides,
    as the CPU, the C++ kernel and Triton (`div.rn.f64`) do."""
    m = stack.shape[0]
    s = stack.sort(dim=0).values
    acc = s[trim].to(F64)
    for i in range(trim + 1, m - trim):
        acc += s[i].to(F64)
    return acc.div_(torch.full((), float(m - 2 * trim), dtype=F64, device=acc.device)).to(stack.dtype)
