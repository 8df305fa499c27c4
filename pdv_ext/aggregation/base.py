"""The Aggregator protocol and its registry.

An aggregator turns every replica's local gradients into the gradients each honest replica applies.
It is configuration plus a little state (error-feedback buffers, RNG), like an algorithm of
torch.distributed.algorithms; all communication goes through a `Comm`, so the same object runs inside
DeepSpeed's pipeline engine (one per stage, over the stage's data-parallel group) and under Horovod.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
from pydantic import ValidationError

from ..comm.base import Comm
from ..config_base import ConfigError, StrictModel, WithOptions, format_errors
from ..registry import Registry, RegistryError, call_factory

AGGREGATORS: Registry = Registry("aggregator", "pdv_ext.aggregators")


class Aggregator(WithOptions):
    """Base class. Subclasses set `name`, an `Options` model (their config keys) and `aggregate`.

    - `aggregate(grads, comm)` is collective: every rank of `comm` calls it with tensors of the same
      shapes, in the same order; it returns the tensors to apply (it may reuse the inputs' storage).
      Called through `aggregator(grads, comm)` it sees contiguous, dense tensors only: `__call__` checks
      the inputs before any communication and hands non-contiguous ones over as contiguous copies, whose
      results it copies back into the caller's views (`contiguous_call`).
    - `report` holds what the last call measured (dropped ranks, consensus distance, ...) for the Monitor.
    - `state_dict()/load_state_dict()` carry what must survive a checkpoint (error feedback, RNG, step).
    - Data shares: `aggregator(grads, comm, samples=[n_0, ..., n_{m-1}])` says how many samples each group
      rank's gradient averages (replicas may take unequal shares of a step's global batch; every rank's
      gradient is the mean over its own samples). `shares` says what the aggregator makes of them:
      "weight" (the result weighs each replica by its share of the step's samples: `mean` is then the
      exact mean over every sample of the step) or "count" (every replica counts once: the robust
      statistics, whose guarantees are stated in replicas, and adasum, whose geometry a rescaled gradient
      would change; docs/aggregation.md gives each reason). During `aggregate`, `share_weights()` /
      `share_factor()` give the shares (None when they are equal or not given: the unweighted code path,
      bit for bit as without shares).
    """

    name: ClassVar[str] = "base"
    #: True when `aggregate` expects `set_validation_grads` to be called first (Zeno)
    needs_validation: ClassVar[bool] = False
    #: True when `aggregate` spots NaN/Inf itself, on a buffer it reads anyway, and sets
    #: `nonfinite_local_ok` (None: all finite; else whether this rank's own input was finite) for the
    #: non-finite guard, which then skips its own passes over the gradients
    checks_nonfinite: ClassVar[bool] = False
    #: what unequal data shares mean to this aggregator: "weight" or "count" (see the class docstring)
    shares: ClassVar[Literal["weight", "count"]] = "count"
    #: keys of `state_dict()` holding one flat tensor over all aggregated gradients (in their order), or
    #: None: a plan change cuts them at the parameters and joins them in the new stage's order
    #: (pdv_ext.placement.layer_state)
    per_parameter_state: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, options: Optional[Union[Dict[str, Any], StrictModel]] = None, **kwargs: Any):
        super().__init__(options, **kwargs)
        self.step = 0
        self.report: Dict[str, Any] = {}
        self.samples: Optional[List[int]] = None  # this call's per-rank sample counts (None: equal)

    def aggregate(self, grads: List[torch.Tensor], comm: Comm) -> List[torch.Tensor]:
        raise NotImplementedError

    def __call__(self, grads: List[torch.Tensor], comm: Comm,
                 samples: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
        self.samples = unequal_samples(samples, comm.size, who=f"aggregator '{self.name}'")
        try:
            out = contiguous_call(self.aggregate, grads, comm, who=f"aggregator '{self.name}'")
        finally:
            self.samples = None
        self.step += 1
        return out

    def share_weights(self) -> Optional[List[float]]:
        """Each group rank's share of this call's samples (summing to 1), or None when the shares are equal
        (or not given): the caller then takes its unweighted path."""
        if self.samples is None:
            return None
        total = float(sum(self.samples))
        return [n / total for n in self.samples]

    def share_factor(self, comm: Comm) -> Optional[float]:
        """m x this rank's share: what this rank's gradient is multiplied by so that the plain average of
        the group's gradients becomes the sample-weighted one (None when the shares are equal)."""
        w = self.share_weights()
        return None if w is None else comm.size * w[comm.rank]

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step = int(state.get("step", 0))

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.model_dump().items())
        return f"{type(self).__name__}({opts})"


def unequal_samples(samples: Optional[Sequence[int]], size: int, who: str = "aggregator") -> Optional[List[int]]:
    """`samples` checked against a group of `size` ranks (one positive count per rank); None when absent or
    all equal (equal shares take the aggregators' unweighted paths, bit for bit). No communication: every
    rank must pass the same list (the integrations derive it from the agreed shares)."""
    if samples is None:
        return None
    counts = [int(n) for n in samples]
    if len(counts) != size or any(n <= 0 for n in counts) or any(n != s for n, s in zip(counts, samples)):
        raise ValueError(f"{who}: samples must give one positive integer count per rank of the group of {size} "
                         f"(got {list(samples)!r})")
    return None if len(set(counts)) <= 1 else counts


def register_aggregator(name: Optional[str] = None):
    """Class decorator: make an Aggregator selectable as `"pdv": {"aggregation": {"type": name}}`."""
    return AGGREGATORS.register_class(name)


def build_aggregator(spec: Union[str, Dict[str, Any], Any, Aggregator, None] = None, *,
                     prefix: str = "aggregation") -> Aggregator:
    """An Aggregator from a name, a `{"type": ..., **options}` dict or an AggregationConfig.

    Bad input fails here, before any step: an unknown name raises RegistryError, any other kind of `spec`
    TypeError, and bad options or a 'module:attr' that is not an Aggregator subclass (or a factory returning
    one) ConfigError, one line per problem naming `<prefix>.<key>`.
    """
    if isinstance(spec, Aggregator):
        return spec
    if spec is None:
        spec = {"type": "mean"}
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        if not (hasattr(spec, "type") and hasattr(spec, "options")):
            raise TypeError("build_aggregator: expected an aggregator name, a {'type': ..., **options} dict, an "
                            f"AggregationConfig or an Aggregator (got {type(spec).__name__} {spec!r})")
        spec = {"type": spec.type, **spec.options}  # AggregationConfig
    spec = dict(spec)
    name = spec.pop("type", "mean")
    cls = AGGREGATORS.get(name)
    if isinstance(cls, type) and issubclass(cls, Aggregator):
        try:
            return cls(spec)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, cls.Options, prefix)) from exc
    try:
        return call_factory(cls, spec, Aggregator, name)  # a factory registered by a user
    except RegistryError as exc:
        raise ConfigError([f"{prefix}.type: {exc}"]) from exc


def flatten(tensors: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One contiguous 1-D buffer of `tensors` (same dtype); written into `out` when given (reusing a
    buffer avoids allocating — and page-faulting in — tens of MB every step)."""
    if not tensors:
        return torch.empty(0)
    if out is None:
        return torch._utils._flatten_dense_tensors([t.contiguous() for t in tensors])
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


def all_finite(tensors: List[torch.Tensor]) -> bool:
    """Whether every element is finite; exact, and cheap on the healthy path.

    A NaN/Inf anywhere makes its tensor's sum non-finite, so one summing pass (no mask allocated;
    ~20x cheaper than isfinite().all(), which cost 15% of a pipeline step) clears healthy gradients.
    A non-finite sum can also come from huge finite values overflowing: only then is the exact
    element-wise check run. Each of the two reads the device once for the whole list (a host sync on
    CUDA), never once per tensor.
    """
    if sums_finite(tensors):
        return True
    return all(finite_flags(tensors))


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to sum or take norms of `dtype` values in: float32 at least (an fp16 sum or norm overflows
    at 65504, which loss-scaled gradients reach), float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sums_finite(tensors: List[torch.Tensor]) -> bool:
    """Whether every tensor's sum is finite (one read of the device): True proves every element finite,
    False means a NaN/Inf element or finite values whose sum overflowed (`finite_flags` tells which)."""
    return not tensors or bool(torch.isfinite(torch.stack([
        t.sum(dtype=wide_dtype(t.dtype)).double() for t in tensors])).all())


def finite_on_device(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Whether every element of every tensor is finite, as a 0-d bool tensor on their device: exact and
    read nowhere (no host sync), for a caller that reads it later together with other values. One
    `aminmax` pass per tensor: min and max are both finite exactly when every element is (NaN propagates
    through both, +-inf shows in one), and unlike a sum they cannot overflow."""
    ts = [t.reshape(-1) for t in tensors if t.numel()]
    if not ts:
        dev = tensors[0].device if tensors else torch.device("cpu")
        return torch.ones((), dtype=torch.bool, device=dev)
    return torch.isfinite(torch.stack([torch.stack(torch.aminmax(t)).to(torch.float64) for t in ts])).all()


def finite_flags(tensors: List[torch.Tensor]) -> List[bool]:
    """Per tensor, whether every element is finite: the exact check, one read of the device for all."""
    if not tensors:
        return []
    return [bool(f) for f in torch.stack([torch.isfinite(t).all() for t in tensors]).tolist()]


class BufferCache:
    """Reusable flat buffers keyed by (dtype, device, numel): one per gradient bucket."""

    def __init__(self) -> None:
        self._bufs: Dict[Any, torch.Tensor] = {}

    def get(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        t0 = tensors[0]
        key = (t0.dtype, t0.device, sum(t.numel() for t in tensors))
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(key[2], dtype=t0.dtype, device=t0.device)
        return buf

    def clear(self) -> None:
        self._bufs.clear()


def unflatten_into(flat: torch.Tensor, tensors: List[torch.Tensor], scale: float = 1.0) -> List[torch.Tensor]:
    """Copy `flat` (times `scale`, fused into the copy) back into `tensors` in place; returns `tensors`."""
    for dst, src in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        if scale == 1.0:
            dst.copy_(src)
        else:
            torch.mul(src, scale, out=dst)
    return tensors


def group_by_dtype(tensors: List[torch.Tensor]) -> Dict[torch.dtype, List[int]]:
    """Indices of `tensors` per dtype, in first-seen order."""
    groups: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


# ---- inputs of any layout --------------------------------------------------------------------------
def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share memory (an expanded or as_strided view): such a view cannot
    take results back. Exact for the layouts torch views produce (dims sorted by stride, each stride
    past the extent of the smaller ones), conservative otherwise."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    extent = 0  # elements spanned by the dims seen so far, minus one
    for st, n in dims:
        if st <= extent:
            return True
        extent += st * (n - 1)
    return False


def check_tensors(tensors: Sequence[Any], who: str = "aggregator") -> None:
    """Reject what no aggregator can take, before any communication: not a tensor, not dense (sparse,
    mkldnn), or a view whose elements overlap (results could not be written back). The checks read only
    this rank's call, so in an SPMD program (the same code on every rank) every rank raises the same
    error at the same call, and no collective is left half done. Strided, non-contiguous, zero-size and
    mixed-layout tensors (one rank's view contiguous, another's not) are all accepted."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: input {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"{who}: input {i} has layout {t.layout}; pass dense tensors (t.to_dense())")
        if t.numel() > 1 and not t.is_contiguous() and _overlaps(t):
            raise ValueError(f"{who}: input {i} (shape {tuple(t.shape)}, stride {t.stride()}) is a view whose "
                             "elements overlap (e.g. from expand()); pass t.clone() or t.contiguous()")


def contiguous_inputs(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """`tensors`, with each non-contiguous one replaced by a contiguous copy (the others as they are)."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def copy_back(tensors: Sequence[torch.Tensor], work: Sequence[torch.Tensor],
              out: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """After aggregating `work` (from `contiguous_inputs(tensors)`) into `out`: each result of a copied
    input goes back into the caller's tensor, which then stands in the returned list in its place."""
    res = list(out)
    if len(res) != len(tensors):
        return res
    for i, (t, w) in enumerate(zip(tensors, work)):
        if w is not t:
            t.copy_(res[i])
            res[i] = t
    return res


def contiguous_call(fn: Callable[[List[torch.Tensor], Comm], List[torch.Tensor]], tensors: Sequence[torch.Tensor],
                    comm: Comm, who: str = "aggregator") -> List[torch.Tensor]:
    """`fn(tensors, comm)` for tensors of any layout: checked first (`check_tensors`, no communication),
    `fn` gets contiguous tensors (copies of the non-contiguous ones), and the copies' results are written
    back into the caller's views. Results equal those of contiguous copies of the inputs, on every rank,
    whatever layout each rank passed."""
    tensors = list(tensors)
    check_tensors(tensors, who)
    work = contiguous_inputs(tensors)
    out = fn(work, comm)
    if all(w is t for w, t in zip(work, tensors)):
        return out
    return copy_back(tensors, work, out)
