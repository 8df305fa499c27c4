"""Per-layer profile of a pipeline model: forward+backward, parameter update and message times, parameter
bytes, activation bytes, memory.

Measured once on the local device at the configured micro-batch size (median of repetitions) and scaled to
other devices by their throughput (`Cluster.speed`). Saved as JSON::

    {"micro_batch": 4, "device": "cpu", "device_throughput": 3.1e10,
     "layers": [{"name": "Embed", "fwd_bwd": 0.0012, "param_bytes": 98304, "act_bytes": 131072,
                 "saved_bytes": 262144, "update": 0.0004, "p2p": 0.0011}, ...]}

`fwd_bwd` is paid once per micro-batch (the last layer's includes the loss when a loss function is given);
`update` once per training step: what the engine does with the layer's parameters after the last backward
(gradient norm for clipping - DeepSpeed clips at 1.0 by default -, the optimizer step, zero_grad).
`act_bytes` is what the layer's output sends to the next stage per micro-batch; `saved_bytes` what
autograd keeps for the backward pass (the activation memory one in-flight micro-batch costs); `p2p` the
time both ends spend on one message of `act_bytes` (CPU tensors: gloo's send + recv), paid per micro-batch
by the devices on either side of a stage boundary after that layer.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Annotated, Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ..config_base import ConfigError, StrictModel, format_errors


@dataclass
class LayerProfile:
    name: str
    fwd_bwd: float          # seconds per micro-batch on the profiling device
    param_bytes: float
    act_bytes: float        # output activation bytes per micro-batch
    saved_bytes: float = 0.0  # activation memory kept for backward, per micro-batch
    update: float = 0.0     # seconds per step on the profiling device: grad norm + optimizer step + zero_grad
    p2p: float = 0.0        # seconds to send + receive act_bytes once (both ends), on the profiling device
    fwd: float = 0.0        # the forward alone (part of fwd_bwd); 0 = not timed (the schedule replay takes 1/3)


# -- the JSON schema (validated on load, so a bad value names its key instead of surfacing in the cost model) --
_NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # seconds or bytes: finite, >= 0


# derived from LayerProfile, so that a field added there is saved *and* loaded: every number finite, >= 0
LayerSpec = create_model("LayerSpec", __base__=StrictModel, **{
    f.name: (str if f.name == "name" else _NonNegative, ... if f.default is MISSING else f.default)
    for f in fields(LayerProfile)})


class EngineSpec(BaseModel):
    """`Profile.engine`: the numbers the cost model reads (DeepSpeed's work per micro-batch and per step; a
    reduction's CPU work per byte sent and per gradient byte, where measured); the fit's details pass through."""

    model_config = ConfigDict(extra="allow")
    micro_batch: _NonNegative = 0.0
    step: _NonNegative = 0.0
    reduce_byte: _NonNegative = 0.0
    reduce_grad_byte: _NonNegative = 0.0


def _engine_dict(spec: EngineSpec) -> Dict[str, Any]:
    """The engine numbers as read (a profile written before `reduce_byte` existed loads back unchanged)."""
    d = spec.model_dump()
    for key in ("reduce_byte", "reduce_grad_byte"):
        if key not in spec.model_fields_set:
            d.pop(key)
    return d


class ProfileSpec(StrictModel):
    layers: List[LayerSpec] = Field(min_length=1)
    micro_batch: int = Field(default=1, ge=1)
    device: str = "cpu"
    device_throughput: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    meta: Dict[str, Any] = Field(default_factory=dict)
    engine: Optional[EngineSpec] = None


@dataclass
class Profile:
    layers: List[LayerProfile]
    micro_batch: int = 1
    device: str = "cpu"
    device_throughput: Optional[float] = None  # measured matmul FLOP/s of the profiling device
    meta: Dict[str, Any] = field(default_factory=dict)
    # DeepSpeed's own work on the profiling device (see `engine_overhead`): {"micro_batch": seconds per
    # micro-batch and stage, "step": seconds per step outside the micro-batches, and where measured
    # (`train_step_timer profile --message-cpu`) "reduce_byte" / "reduce_grad_byte": a gradient reduction's
    # own work per byte a member sends / per gradient byte}; None = not measured
    engine: Optional[Dict[str, Any]] = None

    def __len__(self) -> int:
        return len(self.layers)

    # -- arrays the cost model and solvers use ------------------------------------------------------
    def arrays(self) -> Dict[str, np.ndarray]:
        return {k: np.array([getattr(l, k) for l in self.layers], dtype=float)
                for k in ("fwd_bwd", "param_bytes", "act_bytes", "saved_bytes", "update", "p2p", "fwd")}

    def scaled(self, speed: float) -> "Profile":
        """The profile as seen on a device `speed` times as fast as the profiling device."""
        return replace(
            self, layers=[replace(l, fwd_bwd=l.fwd_bwd / speed, update=l.update / speed, p2p=l.p2p / speed,
                                  fwd=l.fwd / speed)
                          for l in self.layers],
            device_throughput=None if self.device_throughput is None else self.device_throughput * speed,
            meta=dict(self.meta),
            engine=None if self.engine is None else {**self.engine, "micro_batch": self.engine_micro_batch / speed,
                                                     "step": self.engine_step / speed,
                                                     **{k: float(self.engine[k]) / speed
                                                        for k in ("reduce_byte", "reduce_grad_byte")
                                                        if k in self.engine}})

    def calibrated(self, total_fwd_bwd: float) -> "Profile":
        """The profile with every layer's forward + backward scaled so that they sum to `total_fwd_bwd`: the
        whole model's forward + backward timed in one pass on the profiling device. Layers timed one by one
        keep their share of the cost but not its total (on the emulated CPU cluster their sum was 10%
        above and 25% below the whole pass in two profiles); `meta["fwd_bwd_scale"]` records the factor."""
        total = float(sum(l.fwd_bwd for l in self.layers))
        if not (total > 0 and total_fwd_bwd > 0):
            raise ValueError(f"cannot calibrate a profile whose forward + backward sums to {total} "
                             f"against {total_fwd_bwd} s")
        k = total_fwd_bwd / total
        return replace(self, layers=[replace(l, fwd_bwd=l.fwd_bwd * k, fwd=l.fwd * k) for l in self.layers],
                       meta={**self.meta, "fwd_bwd_scale": k}, engine=None if self.engine is None else dict(self.engine))

    @classmethod
    def combined(cls, profiles: Sequence["Profile"]) -> "Profile":
        """One profile from several of the same model (e.g. taken between the runs of a benchmark, so that
        what the machine's load did meanwhile is sampled too): per layer the median of each time
        (`fwd_bwd`, `update`, `p2p`), the median of the engine's two numbers, and `meta.workload_rounds`
        pooled device by device (`meta.workload_seconds` their medians). Sizes must agree: they are the
        model's, not the machine's."""
        profiles = list(profiles)
        if not profiles:
            raise ValueError("Profile.combined needs at least one profile")
        first = profiles[0]
        timed = ("fwd_bwd", "update", "p2p", "fwd")
        for i, p in enumerate(profiles[1:], 1):
            if [l.name for l in p.layers] != [l.name for l in first.layers] or p.micro_batch != first.micro_batch:
                raise ValueError(f"profile {i} is not of the same model as profile 0 "
                                 f"(layers or micro-batch size differ)")
            for a, b in zip(first.layers, p.layers):
                diff = [f.name for f in fields(LayerProfile) if f.name not in timed and getattr(a, f.name) != getattr(b, f.name)]
                if diff:
                    raise ValueError(f"profile {i}, layer {a.name}: {', '.join(diff)} differ from profile 0")
        layers = [replace(l, **{k: statistics.median(getattr(p.layers[j], k) for p in profiles) for k in timed})
                  for j, l in enumerate(first.layers)]
        engine = None
        if all(p.engine is not None for p in profiles):
            engine = {**first.engine, "micro_batch": statistics.median(p.engine_micro_batch for p in profiles),
                      "step": statistics.median(p.engine_step for p in profiles)}
            for key in ("reduce_byte", "reduce_grad_byte"):
                if any(key in p.engine for p in profiles):
                    engine[key] = statistics.median(float(p.engine.get(key, 0.0)) for p in profiles)
        meta = {**first.meta, "profiles_combined": len(profiles)}
        if all("fwd_bwd_scale" in p.meta for p in profiles):
            meta["fwd_bwd_scale"] = statistics.median(p.meta["fwd_bwd_scale"] for p in profiles)
            meta["fwd_bwd_scales"] = [p.meta["fwd_bwd_scale"] for p in profiles]
        rounds = [p.meta.get("workload_rounds") for p in profiles]
        seconds = [p.meta.get("workload_seconds") for p in profiles]
        for key in ("workload_rounds", "workload_seconds"):
            meta.pop(key, None)
        if all(r is not None for r in rounds) and len({len(r) for r in rounds}) == 1:
            meta["workload_rounds"] = [[v for r in rounds for v in r[d]] for d in range(len(rounds[0]))]
            meta["workload_seconds"] = [statistics.median(v) for v in meta["workload_rounds"]]
        elif all(w is not None for w in seconds) and len({len(w) for w in seconds}) == 1:  # no rounds kept
            meta["workload_seconds"] = [statistics.median(w[d] for w in seconds) for d in range(len(seconds[0]))]
        return replace(first, layers=layers, meta=meta, engine=engine)

    @property
    def engine_micro_batch(self) -> float:
        """Seconds of DeepSpeed's work per micro-batch and stage on the profiling device (0 if not measured)."""
        return float((self.engine or {}).get("micro_batch", 0.0))

    @property
    def engine_step(self) -> float:
        """Seconds of DeepSpeed's fixed work per step (outside the micro-batches) on the profiling device."""
        return float((self.engine or {}).get("step", 0.0))

    # -- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str = "profile") -> "Profile":
        """Validated against `ProfileSpec`: a ConfigError names `source` and the key path of every problem."""
        if not isinstance(d, dict):
            raise ConfigError([f"{source}: expected a layer profile {{'layers': [{{'name', 'fwd_bwd', "
                               f"'param_bytes', 'act_bytes', ...}}, ...], 'micro_batch': ..., ...}} "
                               f"(written by `pdv profile`), got {type(d).__name__}"])
        try:
            spec = ProfileSpec.model_validate(d)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, ProfileSpec, source)) from exc
        return cls([LayerProfile(**l.model_dump()) for l in spec.layers], spec.micro_batch, spec.device,
                   spec.device_throughput, spec.meta, None if spec.engine is None else _engine_dict(spec.engine))

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:  # ValueError: bad JSON or not UTF-8
            raise ConfigError([f"{path}: cannot read profile JSON: {exc}"]) from exc
        return cls.from_dict(data, source=path)

    @classmethod
    def synthetic(cls, num_layers: int, seed: int = 0, heavy_every: int = 0) -> "Profile":
        """Random but realistic layers (for benchmarks and tests): transformer-like blocks, optional heavy
        layers every `heavy_every` (e.g. embeddings/heads)."""
        rng = np.random.default_rng(seed)
        layers = []
        for i in range(num_layers):
            heavy = heavy_every and i % heavy_every == 0
            t = float(rng.uniform(0.8, 1.2) * (3.0 if heavy else 1.0)) * 1e-2
            params = float(rng.uniform(0.5, 1.5) * (4.0 if heavy else 1.0)) * 2 ** 22
            act = float(rng.choice([1.0, 2.0, 4.0])) * 2 ** 20
            layers.append(LayerProfile(f"layer{i}", t, params, act, 4 * act))
        return cls(layers, micro_batch=1, device="synthetic")


# ---------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------
def _tensors(x: Any) -> List[Any]:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _nbytes(x: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(x)))


def matmul_throughput(size: int = 512, reps: int = 5, device: Optional[str] = None,
                      min_sample_s: float = 0.0) -> float:
    """Median FLOP/s of a size x size float32 matmul on `device`.

    Each sample repeats the matmul until it lasts `min_sample_s`: a CPU-quota-throttled process runs in
    bursts of one CFS period, so a sample must span many periods to see the average quota.
    """
    import torch

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    rates = []
    for _ in range(reps + 1):
        n = 0
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while True:
            (a @ b).sum().item()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_sample_s:
                break
        rates.append(2.0 * size ** 3 * n / dt)
    return statistics.median(rates[1:])


class _Update:
    """One layer's parameter update, timed a sample at a time: the once-per-step work the engine does after
    the last backward - the gradient norm (DeepSpeed clips at 1.0 by default), `optimizer(params).step()`
    (default `torch.optim.AdamW`, what DeepSpeed's `torch_adam` builds) and `zero_grad`. `restore` puts
    the parameters back as they were."""

    def __init__(self, params: Sequence[Any], optimizer: Optional[Callable] = None):
        import torch

        self.params = [p for p in params if p.requires_grad]
        self.saved = [p.detach().clone() for p in self.params]
        self.grads = [torch.randn_like(p) for p in self.params]  # values do not change the cost
        self.opt = (optimizer or torch.optim.AdamW)(self.params) if self.params else None

    def load(self) -> None:
        """Give the parameters their gradients (untimed)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone()

    def step(self) -> None:
        """The timed work: clip, optimizer step, zero_grad."""
        import torch

        if self.opt is None:
            return
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sample(self, sync: Callable[[], None]) -> float:
        if self.opt is None:
            return 0.0
        self.load()
        sync()
        t0 = time.perf_counter()
        self.step()
        sync()
        return time.perf_counter() - t0

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for p, s in zip(self.params, self.saved):
                p.copy_(s)


def message_time(sizes: Sequence[float], reps: int = 5, warmup: int = 1) -> Dict[float, float]:
    """Median seconds both ends spend on one message of each size (bytes) through gloo, the transport of
    CPU tensors: ping-pong between two ranks in this process (threads), half a round trip.

    A pipeline stage's device does this for every activation and gradient it sends or receives; the time
    is mostly CPU (copies, syscalls), so a slower device pays it at its own speed. Empty dict when gloo is
    unavailable."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    sizes = sorted({float(n) for n in sizes if n > 0})
    if not sizes or not dist.is_gloo_available():
        return {}
    store, pgs = dist.HashStore(), [None, None]

    def make(r):
        pgs[r] = dist.ProcessGroupGloo(dist.PrefixStore("pdv-profile", store), r, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    bufs = {n: (torch.zeros(int(n) // 4 or 1), torch.zeros(int(n) // 4 or 1)) for n in sizes}
    order = [n for n in sizes for _ in range(warmup + reps)]

    def echo():
        for n in order:
            b = bufs[n][1]
            pgs[1].recv([b], 0, 0).wait()
            pgs[1].send([b], 0, 0).wait()

    peer = threading.Thread(target=echo)
    peer.start()
    times: Dict[float, List[float]] = {n: [] for n in sizes}
    for i, n in enumerate(order):
        a = bufs[n][0]
        t0 = time.perf_counter()
        pgs[0].send([a], 1, 0).wait()
        pgs[0].recv([a], 1, 0).wait()
        if i % (warmup + reps) >= warmup:
            times[n].append((time.perf_counter() - t0) / 2)
    peer.join()
    return {n: float(statistics.median(v)) for n, v in times.items()}


def _fwd_bwd(mod: Any, x: Any, sync: Callable[[], None], loss: Optional[Callable] = None):
    """(seconds, saved bytes, output, forward seconds) of one forward+backward of `mod` on `x`: backward from `loss(output)`
    when given, else from a gradient of ones on every output that needs one."""
    import torch

    saved = [0.0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    inp = _detach(x)
    sync()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = mod(inp)
        l = loss(y) if loss is not None else None
    sync()
    t_fwd = time.perf_counter() - t0
    if l is not None:
        l.backward()
    else:
        outs = [t for t in _tensors(y) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    sync()
    return time.perf_counter() - t0, saved[0], y, t_fwd


class _Kept:
    """A caller's module as it was before profiling: every submodule's parameter and buffer objects with
    their data (device, dtype) and gradients, the buffers' values (a training-mode forward updates running
    statistics in place), and the training flags. `restore` puts all of it back, so that the same Parameter
    objects (which the caller's optimizer holds) keep their original tensors. Parameter values are put
    back by `_Update.restore` (the only thing that changes them); this keeps no copy of them."""

    def __init__(self, mod: Any):
        self.entries = [(m, m.training, dict(m._parameters),
                         {n: (p.data, p.grad) for n, p in m._parameters.items() if p is not None}, dict(m._buffers),
                         {n: b.detach().clone() for n, b in m._buffers.items() if b is not None})
                        for m in mod.modules()]

    def restore(self) -> None:
        import torch

        for m, training, params, data, buffers, values in self.entries:
            for n, p in params.items():
                if p is not None:
                    p.grad = None  # a device gradient must not meet the original data
                    p.data, grad = data[n]
                    p.grad = grad
                m._parameters[n] = p
            for n, b in buffers.items():
                m._buffers[n] = b
                if b is not None:
                    with torch.no_grad():
                        b.copy_(values[n])
            m.training = training


#: device bytes per parameter byte while profiling: the parameter, its saved copy (`_Update`), the fixed
#: update gradient, the backward's gradient, and AdamW's two moments (activations come on top)
PROFILE_BYTES_PER_PARAM_BYTE = 6


class ProfileMemoryError(MemoryError):
    """The model cannot be profiled on one device: it names what would be needed and what is free."""


def check_fits(built: Sequence[Any], free_bytes: int, dev: str = "cuda") -> None:
    """Raise `ProfileMemoryError` (before anything moves to the device) when the layers' parameters,
    times `PROFILE_BYTES_PER_PARAM_BYTE`, exceed the device's free memory: profiling holds the whole
    model on one device, which a model split into pipeline stages because it does not fit cannot be."""
    import torch
    from torch import nn

    target = torch.device(dev).type
    ps = [p for m in built if isinstance(m, nn.Module) for p in m.parameters()]
    params = sum(p.numel() * p.element_size() for p in ps)
    resident = sum(p.numel() * p.element_size() for p in ps if p.device.type == target)  # not in the free bytes
    need = PROFILE_BYTES_PER_PARAM_BYTE * params - resident
    if need > free_bytes:
        gib = 2 ** 30
        raise ProfileMemoryError(
            f"profiling needs the whole model on {dev}: {params / gib:.2f} GiB of parameters take at least "
            f"{need / gib:.2f} GiB there (weights, a saved copy, two gradients, AdamW's moments; activations on "
            f"top), {free_bytes / gib:.2f} GiB are free. Profile a smaller configuration of the same layers "
            "(`pdv profile`, then scale), or on a larger device, and pass the profile JSON "
            "(pdv.placement.profile)")


def _place(mod: Any, dev: str) -> Any:
    """Put a module on the profiling device, in place (`nn.Module.to`); `_Kept.restore` undoes it."""
    return mod.to(dev)


class _HostEvent:
    """`torch.cuda.Event`'s timing interface on the host clock: the pass-timing logic runs on CPU (tests)."""

    def __init__(self, enable_timing: bool = True):
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as CUDA events


def _pass_round(built: Sequence[Any], inputs: Sequence[Any], updates: Sequence["_Update"],
                last_loss: Optional[Callable], event: Callable[[], Any], synchronize: Callable[[], None]):
    """One round timed the way a GPU runs it: the forward of every layer, then the backward of every layer
    (last first), then every layer's update, each timed by events recorded in the stream between layers and
    one `synchronize` at the end of the round. No host synchronisation between layers, so the host's
    kernel launches overlap the device's work as in training (a sync per layer adds its launch latency to
    every layer). Each layer's input is detached: its backward is its own. Returns per layer (fwd + bwd
    seconds, forward seconds, update seconds, saved bytes, output)."""
    import torch

    n = len(built)
    fe, be, ue = ([event() for _ in range(n + 1)] for _ in range(3))
    ins = [_detach(x) for x in inputs]
    outs, saved = [], [0.0] * n
    fe[0].record()
    for i, mod in enumerate(built):
        def pack(t, i=i):
            saved[i] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mod(ins[i])
            l = last_loss(y) if last_loss is not None and i == n - 1 else None
        fe[i + 1].record()
        outs.append((y, l))
    roots = []  # what each layer's backward starts from, made before the backward is timed
    for y, l in outs:
        ts = [l] if l is not None else [t for t in _tensors(y) if t.requires_grad]
        roots.append((ts, None if l is not None else [torch.ones_like(t) for t in ts]))
    be[n].record()
    for i in reversed(range(n)):
        ts, gs = roots[i]
        if ts:
            torch.autograd.backward(ts, gs)
        be[i].record()
    for u in updates:  # the backward's gradients are not the update's: fixed random ones (untimed)
        u.load()
    ue[0].record()
    for i, u in enumerate(updates):
        u.step()
        ue[i + 1].record()
    synchronize()
    fwd = [fe[i].elapsed_time(fe[i + 1]) / 1e3 for i in range(n)]
    bwd = [be[i + 1].elapsed_time(be[i]) / 1e3 for i in range(n)]
    upd = [ue[i].elapsed_time(ue[i + 1]) / 1e3 if u.opt is not None else 0.0 for i, u in enumerate(updates)]
    return [(f + b, f, u, saved[i], outs[i][0]) for i, (f, b, u) in enumerate(zip(fwd, bwd, upd))]


def whole_pass_seconds(built: Sequence[Any], x: Any, loss: Optional[Callable] = None, reps: int = 5,
                       warmup: int = 1, event: Optional[Callable[[], Any]] = None,
                       synchronize: Callable[[], None] = lambda: None) -> float:
    """Median seconds of one forward + backward of all layers chained (autograd across them; backward from
    `loss(output)` when given, else from ones on the output): what one pipeline stage holding every layer
    runs per micro-batch. Timed by `event`s (CUDA events on a GPU) around the pass and one `synchronize`
    after it; `_HostEvent`s by default. Gradients are dropped after each pass."""
    import torch

    event = event or _HostEvent
    params = [p for m in built if isinstance(m, torch.nn.Module) for p in m.parameters()]
    samples = []
    for r in range(warmup + reps):
        start, end = event(), event()
        start.record()
        y = x
        for m in built:
            y = m(y)
        if loss is not None:
            loss(y).backward()
        else:
            outs = [t for t in _tensors(y) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        end.record()
        synchronize()
        for p in params:
            p.grad = None
        if r >= warmup:
            samples.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(samples))


def whole_update_seconds(updates: Sequence["_Update"], reps: int = 5, warmup: int = 1,
                         synchronize: Callable[[], None] = lambda: None) -> float:
    """Median seconds of every layer's update run back to back (gradients given untimed): the engine's one
    optimizer step after the last backward. Timed layer by layer, each update is a short burst; under a CPU
    quota a burst after a pause runs on unspent quota, so the layers' sum was a third of the step's
    measured OptimizerStep on the emulated cluster (9.4 vs 29 ms at 0.275 cores); a pass over all of them
    is throttled as the step's is. 0 when no layer has parameters."""
    live = [u for u in updates if u.opt is not None]
    if not live:
        return 0.0
    samples = []
    for r in range(warmup + reps):
        for u in live:
            u.load()
        synchronize()
        t0 = time.perf_counter()
        for u in live:
            u.step()
        synchronize()
        if r >= warmup:
            samples.append(time.perf_counter() - t0)
    return float(statistics.median(samples))


def profile_layers(layers: Sequence[Any], sample_input: Any, reps: int = 5, warmup: int = 1,
                   device: Optional[str] = None, progress: bool = False, loss_fn: Optional[Callable] = None,
                   labels: Any = None, optimizer: Optional[Callable] = None, timing: str = "auto",
                   calibrate: Optional[bool] = None, tie_identical: bool = True) -> Profile:
    """Profile built modules / LayerSpecs / callables in order, feeding each the previous output.

    Forward+backward per layer: the backward is driven by a gradient of ones of the output's shape, so
    every layer's own backward cost is measured independently of the others. With `loss_fn` and `labels`
    the last layer's backward starts from `loss_fn(output, labels)` instead, and its time includes the loss
    (the last stage computes it for every micro-batch). `update` per layer: see `_Update`.

    Samples are taken in rounds over all layers, not layer after layer: on a shared machine a burst of
    load then slows one round (which the median drops) instead of every sample of one layer (which it
    cannot; identical transformer blocks measured 27-37 ms layer after layer under load).

    `timing`: "layer" times each layer's forward + backward and update on the host clock with a device
    synchronisation around each (the CPU way, exact there); "pass" runs a round as a GPU runs a pass
    (`_pass_round`: forward of all layers, backward of all, updates, events in the stream between layers,
    one synchronize per round); "auto" (default): "pass" on CUDA, "layer" elsewhere. `calibrate` scales
    the layers' forward + backward to sum to the whole model's timed pass (`whole_pass_seconds`,
    `Profile.calibrated`, `meta.whole_pass_seconds`); None (default): on CUDA only.

    `tie_identical` (default): layers that are the same computation - same class, same parameter and buffer
    names, shapes and dtypes, same input and output shapes and dtypes, neither of them the last layer with the
    loss - get one cost, the median of all their samples pooled. Their true costs are equal, while each one's
    own median keeps the measurement's noise (identical blocks under a CPU quota measured 37-52 ms), and the
    solver then puts the blocks that happened to measure cheap together on one stage, which runs slower than
    predicted. `meta.identical_layers` lists the groups.

    Modules passed in built are profiled where they are moved to (`device`, default CUDA when available)
    and left as they were: same device, dtype, values, gradients, training mode and Parameter objects.
    They are profiled in training mode.
    """
    import torch
    from torch import nn

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.startswith("cuda")
    if timing == "auto":
        timing = "pass" if cuda else "layer"
    if timing not in ("layer", "pass"):
        raise ValueError(f"timing: 'auto', 'layer' or 'pass' (got {timing!r})")
    calibrate = cuda if calibrate is None else bool(calibrate)
    kept = [_Kept(spec) for spec in layers if isinstance(spec, nn.Module)]  # before any move: tied weights too
    try:
        return _profile(layers, sample_input, reps, warmup, dev, progress, loss_fn, labels, optimizer, timing,
                        calibrate, tie_identical)
    finally:
        for k in kept:
            k.restore()


def _signature(mod: Any, inp: Any, out: Any) -> Optional[tuple]:
    """What makes two layers the same computation (None: not a module, never tied): the class, every parameter's
    and buffer's name, shape and dtype, and the input's and output's tensor shapes and dtypes."""
    from torch import nn

    if not isinstance(mod, nn.Module):
        return None
    shapes = lambda x: tuple((tuple(t.shape), str(t.dtype)) for t in _tensors(x))  # noqa: E731
    return (type(mod).__qualname__,
            tuple((n, tuple(p.shape), str(p.dtype)) for n, p in mod.named_parameters()),
            tuple((n, tuple(b.shape), str(b.dtype)) for n, b in mod.named_buffers()),
            shapes(inp), shapes(out))


def _tie(samples: List[List[float]], groups: List[List[int]]) -> List[float]:
    """Per layer: the median of its samples, or of its group's samples pooled."""
    med = [float(statistics.median(s)) for s in samples]
    for g in groups:
        pooled = float(statistics.median([v for i in g for v in samples[i]]))
        for i in g:
            med[i] = pooled
    return med


def _profile(layers, sample_input, reps, warmup, dev, progress, loss_fn, labels, optimizer, timing, calibrate,
             tie_identical):
    import torch
    from torch import nn

    built = [spec.build() if hasattr(spec, "build") and hasattr(spec, "typename") else spec for spec in layers]
    if dev.startswith("cuda"):  # every layer is resident at once (a pass is timed as a GPU runs it)
        check_fits(built, torch.cuda.mem_get_info(torch.device(dev))[0], dev)
    for i, mod in enumerate(built):
        if isinstance(mod, nn.Module):
            built[i] = mod = _place(mod, dev)
            mod.train()
    x = [t.to(dev) for t in sample_input] if isinstance(sample_input, (list, tuple)) else sample_input.to(dev)
    first_input = x
    if loss_fn is not None and labels is not None:
        labels = labels.to(dev) if hasattr(labels, "to") else labels
        last_loss = lambda y: loss_fn(y, labels)  # noqa: E731
    else:
        last_loss = None
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _HostEvent
    inputs = []  # each layer's input: the previous layer's output
    with torch.no_grad():
        for mod in built:
            inputs.append(x)
            x = _detach(mod(_detach(x)))
    outs = inputs[1:] + [x]  # each layer's output
    params = [list(m.parameters()) if isinstance(m, nn.Module) else [] for m in built]
    updates = [_Update(p, optimizer) for p in params]
    n = len(built)
    times, upd, fwds = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
    saved, act = [0.0] * n, [0.0] * n
    rounds = range(warmup + reps)
    if progress:
        from tqdm import tqdm

        rounds = tqdm(rounds, desc="profile", unit="round")
    whole = None
    try:
        for r in rounds:
            if timing == "pass":
                res = _pass_round(built, inputs, updates, last_loss, event, sync)
                for p in (p for ps in params for p in ps):
                    p.grad = None
            else:
                res = []
                for i, mod in enumerate(built):
                    dt, saved_i, y, fw = _fwd_bwd(mod, inputs[i], sync, last_loss if i == n - 1 else None)
                    for p in params[i]:
                        p.grad = None
                    res.append((dt, fw, updates[i].sample(sync), saved_i, y))
            if r >= warmup:
                for i, (dt, fw, u, saved_i, y) in enumerate(res):
                    times[i].append(dt)
                    fwds[i].append(fw)
                    upd[i].append(u)
                    saved[i], act[i] = float(saved_i), _nbytes(y)
        if calibrate:
            whole = whole_pass_seconds(built, first_input, last_loss, reps, warmup, event, sync)
        whole_update = whole_update_seconds(updates, reps, warmup, sync)
    finally:
        for u in updates:
            u.restore()
    groups: List[List[int]] = []
    if tie_identical:
        by_sig: Dict[Any, List[int]] = {}
        for i, mod in enumerate(built):
            sig = None if (i == n - 1 and last_loss is not None) else _signature(mod, inputs[i], outs[i])
            if sig is not None:
                by_sig.setdefault(sig, []).append(i)
        groups = [g for g in by_sig.values() if len(g) > 1]
    t_med, f_med, u_med = _tie(times, groups), _tie(fwds, groups), _tie(upd, groups)
    update_sum = float(sum(u_med))
    if update_sum > 0 and whole_update > 0:  # the layers keep their shares of the step's one update
        u_med = [u * whole_update / update_sum for u in u_med]
    out = [LayerProfile(type(mod).__name__ if not hasattr(spec, "typename") else spec.typename.__name__,
                        t_med[i], float(sum(p.numel() * p.element_size() for p in params[i])),
                        act[i], saved[i], u_med[i], fwd=f_med[i])
           for i, (mod, spec) in enumerate(zip(built, layers))]
    if dev == "cpu":
        msg = message_time([l.act_bytes for l in out], reps, warmup)
        for l in out:
            l.p2p = msg.get(float(l.act_bytes), 0.0)
    mb = int(_tensors(sample_input)[0].shape[0]) if _tensors(sample_input) else 1
    prof = Profile(out, micro_batch=mb, device=dev, device_throughput=matmul_throughput(device=dev))
    prof.meta["timing"] = ("events per layer, one synchronize per pass" if timing == "pass"
                           else "host clock per layer, synchronised around each")
    if groups:
        prof.meta["identical_layers"] = groups
    prof.meta["param_tensors"] = [len(u.params) for u in updates]  # what the engine's per-tensor work scales with
    if update_sum > 0 and whole_update > 0:
        prof.meta.update({"whole_update_seconds": whole_update, "update_scale": whole_update / update_sum})
    if whole is not None:
        layer_sum = sum(l.fwd_bwd for l in out)
        prof = prof.calibrated(whole)
        prof.meta.update({"whole_pass_seconds": whole, "layer_sum_seconds": layer_sum})
    return prof


def _detach(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.requires_grad_(True) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_detach(v) for v in x)
    return x


def profile_module(module: Any, sample_input: Any, reps: int = 5, progress: bool = False,
                   labels: Any = None, *, layers: Sequence[Any]) -> Profile:
    """Profile a `PipelineModule` whose layer specs (all of them, whatever the local stage holds) are
    `layers` (`pdv_ext.integrations.deepspeed.profile_pipeline` passes them); with `labels`, the last
    layer's time includes the module's `loss_fn`."""
    return profile_layers(list(layers), sample_input, reps=reps, progress=progress,
                          loss_fn=getattr(module, "loss_fn", None), labels=labels)


# ---------------------------------------------------------------------------------------------------
# DeepSpeed's own work per micro-batch and per step
# ---------------------------------------------------------------------------------------------------
ENGINE_MICRO_BATCHES = (1, 4, 8)


def _engine_worker(num_layers: int, micro_batches: Sequence[int], reps: int, warmup: int,
                   device: str = "cpu", clipping: Optional[float] = None,
                   tensors_per_layer: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """In a fresh process (world size 1): time `train_batch` of one-stage DeepSpeed PipelineEngines over
    `num_layers` trivially cheap layers (Linear 4 -> 4 on 2 x 4 inputs, MSE loss, AdamW as in training), one
    engine per gradient-accumulation count in `micro_batches`, in rounds over the engines (a burst of load
    slows one round, which the median drops). What remains is the engine's own work: the schedule loop and
    its instructions' Python (LoadMicroBatch, ForwardPass, BackwardPass per micro-batch; ReduceTiedGrads,
    ReduceGrads, OptimizerStep, loss aggregation per step). The same layers' plain forward + backward +
    loss and their plain optimizer step (clip, AdamW, zero_grad) are timed too, to be subtracted: the
    layer profile already holds that work for the real layers.

    On a GPU (`device` "cuda", the engines on CUDA, timed with a synchronisation around each step) the
    engine's work is host time the device waits through: its Python, its synchronising copies and its
    per-tensor kernels (DeepSpeed's fp32 clipping takes one norm and one scale per tensor: 4.4 ms against
    torch's 1.0 ms for the GPT's 102 tensors on an H200). There the engines use `clipping` as the training
    config does and layers with the real layers' parameter-tensor counts (`tensors_per_layer`)."""
    import os
    import socket

    import torch
    from torch import nn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import deepspeed
    from deepspeed.pipe import PipelineModule

    from deepspeed.accelerator import get_accelerator

    cuda = device.startswith("cuda")
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name() if cuda else "gloo",
                               verbose=False)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    x, y = torch.randn(2, 4), torch.randn(2, 4)

    class TensorStub(nn.Module):
        """A trivially cheap layer with a real layer's count of parameter tensors (4 values each): on a GPU
        the engine's per-tensor work (clipping, accumulation, zero_grad) costs launches per tensor."""

        def __init__(self, k: int):
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(k)])

        def forward(self, x):
            for p in self.ps:
                x = x * p
            return x

    def stand_ins():
        if tensors_per_layer is None:
            return [nn.Linear(4, 4) for _ in range(num_layers)]
        return [TensorStub(k) for k in tensors_per_layer]

    def data():
        while True:
            yield x, y

    engines = {}
    for b in micro_batches:
        model = PipelineModule(layers=stand_ins(), num_stages=1,
                               loss_fn=nn.functional.mse_loss, partition_method="uniform")
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": int(b), "train_batch_size": 2 * int(b),
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               "steps_per_print": 10 ** 9}
        if clipping is not None:
            cfg["gradient_clipping"] = float(clipping)
        engines[int(b)] = deepspeed.initialize(model=model, config=cfg,
                                               model_parameters=[p for p in model.parameters()])[0]
    plain = nn.Sequential(*stand_ins()).to(device)
    px, py = x.to(device), y.to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    its = {b: data() for b in engines}
    times: Dict[int, List[float]] = {b: [] for b in engines}
    fb, upd = [], []
    for r in range(warmup + reps):
        for b, engine in engines.items():
            sync()
            t0 = time.perf_counter()
            engine.train_batch(data_iter=its[b])
            sync()
            if r >= warmup:
                times[b].append(time.perf_counter() - t0)
        sync()
        t0 = time.perf_counter()
        nn.functional.mse_loss(plain(px), py).backward()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if r >= warmup:
            fb.append(t1 - t0)
            upd.append(t2 - t1)
    return {"times": {str(b): float(statistics.median(v)) for b, v in times.items()},
            "plain_fwd_bwd": float(statistics.median(fb)), "plain_update": float(statistics.median(upd))}


def engine_overhead(num_layers: int, micro_batches: Sequence[int] = ENGINE_MICRO_BATCHES, reps: int = 9,
                    warmup: int = 3, timeout: float = 900.0, device: str = "cpu", clipping: Optional[float] = None,
                    tensors_per_layer: Optional[Sequence[int]] = None) -> Optional[Dict[str, Any]]:
    """DeepSpeed PipelineEngine's own work on this device, beyond what the layer profile measures:
    {"micro_batch": seconds per micro-batch (least-squares slope of a one-stage engine's step time over the
    micro-batch count, minus the cheap layers' plain forward + backward + loss), "step": seconds per step
    outside the micro-batches (the intercept, minus their plain optimizer step), "times", ...}.

    The slope is the schedule loop plus the LoadMicroBatch, ForwardPass and BackwardPass instructions'
    Python; a pipeline stage also runs send/recv instructions, whose work is gloo's (the profile's `p2p`)
    plus a thin wrapper, so the per-micro-batch work is charged once per stage. Measured in a child process
    (DeepSpeed needs its own world; the child shares this process's CPU quota and cores). None when
    DeepSpeed is unavailable or the run fails."""
    import json as _json
    import subprocess
    import sys

    opts = {"device": device, "clipping": clipping,
            "tensors_per_layer": list(tensors_per_layer) if tensors_per_layer is not None else None}
    cmd = [sys.executable, "-m", "pdv_ext.placement.profile", "engine", str(num_layers), str(reps), str(warmup),
           _json.dumps(opts), *[str(b) for b in micro_batches]]
    # on a CPU profile the child's engines and the plain layers it subtracts run on the CPU, on any machine:
    # what is measured is the engine's own Python. On CUDA they run on the GPU, each step synchronised.
    env = ({**os.environ, "DS_ACCELERATOR": "cuda"} if device.startswith("cuda")
           else {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return None
    res = _json.loads(lines[-1])
    times = {int(k): v for k, v in res["times"].items()}
    bs = sorted(times)
    slope, icpt = np.polyfit(np.array(bs, dtype=float), np.array([times[b] for b in bs]), 1)
    return {"micro_batch": max(float(slope) - res["plain_fwd_bwd"], 0.0),
            "step": max(float(icpt) - res["plain_update"], 0.0),
            "slope": float(slope), "intercept": float(icpt), "times": {str(b): times[b] for b in bs},
            "plain_fwd_bwd": res["plain_fwd_bwd"], "plain_update": res["plain_update"], "layers": num_layers}


if __name__ == "__main__":  # child of engine_overhead
    import sys

    if len(sys.argv) >= 6 and sys.argv[1] == "engine":
        res = _engine_worker(int(sys.argv[2]), [int(b) for b in sys.argv[6:]], int(sys.argv[3]), int(sys.argv[4]),
                             **json.loads(sys.argv[5]))
        print(json.dumps(res), flush=True)
