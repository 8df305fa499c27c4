"""Fused CPU ops for the aggregators, with pure-torch fallbacks that give identical results.

The C++ sources live in `kernels/` at the top of the repository and are JIT-built (cached under
TORCH_EXTENSIONS_DIR) on first use; when a compiler is missing, or PDV_KERNELS=torch, the fallbacks run.
Every public function here has the same contract whichever implementation answers.

API (stable; aggregators call only these):
- `adasum_dots(a, b) -> (a·b, |a|², |b|²)` per tensor pair, accumulated in float64 (three float64 tensors of len(a))
- `adasum_combine(a, b, ca, cb) -> list`: out_i = ca_i * a_i + cb_i * b_i
- `topk_error_feedback(update, residual, k) -> (indices, values)`: selects the k largest |update + residual|
  entries of a flat tensor, returns them and leaves residual = (update + residual) with those entries zeroed
- `coordinate_median(stack) -> tensor`: median over dim 0 of an (m, n) tensor (mean of the two middle values for even m)
- `trimmed_mean(stack, trim) -> tensor`: mean over dim 0 after dropping the `trim` largest and smallest per coordinate
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


# ---- pure-torch reference implementations --------------------------------------------------------
def adasum_dots_torch(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = len(a)
    dot = torch.zeros(n, dtype=torch.float64)
    na = torch.zeros(n, dtype=torch.float64)
    nb = torch.zeros(n, dtype=torch.float64)
    for i, (x, y) in enumerate(zip(a, b)):
        x64, y64 = x.reshape(-1).double(), y.reshape(-1).double()
        dot[i] = torch.dot(x64, y64)
        na[i] = torch.dot(x64, x64)
        nb[i] = torch.dot(y64, y64)
    return dot, na, nb


def adasum_combine_torch(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], ca: torch.Tensor,
                         cb: torch.Tensor) -> List[torch.Tensor]:
    return [x * float(ca[i]) + y * float(cb[i]) for i, (x, y) in enumerate(zip(a, b))]


def topk_error_feedback_torch(update: torch.Tensor, residual: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    acc = update.reshape(-1) + residual.reshape(-1)
    k = max(0, min(int(k), acc.numel()))
    idx = torch.topk(acc.abs(), k, sorted=False).indices if k else torch.empty(0, dtype=torch.long)
    vals = acc[idx].clone()
    acc[idx] = 0
    residual.reshape(-1).copy_(acc)
    return idx, vals


def coordinate_median_torch(stack: torch.Tensor) -> torch.Tensor:
    s = stack.sort(dim=0).values
    m = s.shape[0]
    if m % 2:
        return s[m // 2].clone()
    return (s[m // 2 - 1] + s[m // 2]) / 2


def trimmed_mean_torch(stack: torch.Tensor, trim: int) -> torch.Tensor:
    m = stack.shape[0]
    if not 0 <= 2 * trim < m:
        raise ValueError(f"trim={trim} leaves nothing of {m} vectors")
    s = stack.sort(dim=0).values
    return s[trim: m - trim].mean(dim=0)


# ---- dispatch (the C++ implementations plug in here) ----------------------------------------------
adasum_dots = adasum_dots_torch
adasum_combine = adasum_combine_torch
topk_error_feedback = topk_error_feedback_torch
coordinate_median = coordinate_median_torch
trimmed_mean = trimmed_mean_torch
