"""Parallel random-initialization search (pipeDejavu's third idea).

Data-parallel replicas normally all start from one random point. Here every rank first spends a few
moments probing its own seeded candidate initializations: each candidate is trained `probe_steps` steps on
the rank's data, the ranks all-gather the scores (loss after probing, plus the gradient norm, which also
disqualifies diverging candidates), keep the best `keep_fraction`, and resample around the survivors
with a spread that shrinks every round (coarse-to-fine). The best candidate overall is broadcast and
training starts from it on every rank.

A candidate is a small *recipe* (scheme, scale, seed, parent, spread), not a weight copy: any rank rebuilds
any candidate from it, so only scores travel between ranks, plus the winner's weights once at the end.
All communication goes through `pdv_ext.comm.Comm` (TorchComm under torch.distributed/DeepSpeed,
HorovodComm under Horovod, LocalComm alone).

Standalone::

    report = search_init(model, loss_fn, data_iter, TorchComm(), {"candidates": 4, "rounds": 2})

In the pipeline engine (`"pdv": {"init_search": {"enabled": true}}`) `pdv_ext.initialize` calls
`search_pipeline_init`: the whole (unpartitioned) model is built from the PipelineModule's layer specs on
every rank, searched as one model, and each stage loads its slice of the winner.
"""
from __future__ import annotations

import copy
import hashlib
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .comm.base import Comm, LocalComm
from .config_base import ConfigError
from .init_search_config import InitSearchConfig

__all__ = ["Candidate", "search_init", "search_pipeline_init", "full_model_from_pipeline", "select",
           "apply_scheme", "InitSearchConfig"]


@dataclass(frozen=True)
class Candidate:
    """The recipe of one starting point. `parent` is None in the coarse round; `seed` None means "the
    model's weights as given" (the baseline every search includes)."""

    id: str
    scheme: str
    scale: float
    seed: Optional[int]
    round: int
    rank: int
    parent: Optional["Candidate"] = None
    spread: float = 0.0

    def describe(self) -> Dict[str, Any]:
        return {"id": self.id, "scheme": self.scheme, "scale": self.scale, "seed": self.seed, "round": self.round,
                "rank": self.rank, "parent": self.parent.id if self.parent else None, "spread": self.spread}


def _mix(*parts: Any) -> int:
    """A stable 63-bit seed from parts (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------------------------------------
# Building a candidate's weights
# ---------------------------------------------------------------------------------------------------
_MATRIX_INITS: Dict[str, Callable[..., torch.Tensor]] = {
    "xavier": nn.init.xavier_uniform_,
    "xavier_normal": nn.init.xavier_normal_,
    "kaiming": partial(nn.init.kaiming_uniform_, nonlinearity="relu"),
    "kaiming_normal": partial(nn.init.kaiming_normal_, nonlinearity="relu"),
    "orthogonal": nn.init.orthogonal_,
}


def _state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """A CPU copy of the model's state (parameters and buffers)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _load(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        model.load_state_dict(state)


@torch.no_grad()
def apply_scheme(model: nn.Module, scheme: str, seed: int, scale: float = 1.0) -> None:
    """Re-initialize `model` in place: `default` re-runs every submodule's own `reset_parameters()` under
    `seed`; the others draw every weight matrix (dim >= 2) from that scheme and zero the biases. Matrices
    are then multiplied by `scale`. Draws happen on CPU with a seeded generator (same on any device; for
    `default` the module is reset on the host and moved back).
    Frozen parameters (requires_grad=False, e.g. pretrained parts) and their modules are left alone."""
    if scheme == "default":
        # on the host: CUDA's random kernels size their grids by the GPU's SM count, so one seed gives other
        # numbers on another GPU model, and a rank rebuilding a candidate another rank scored must get its
        # weights (the module moves back afterwards, its Parameter objects unchanged)
        dev = next((p.device for p in model.parameters()), None)
        moved = dev is not None and dev.type != "cpu"
        if moved:
            model.cpu()
        try:
            with torch.random.fork_rng(devices=_rng_devices()):
                torch.manual_seed(seed)
                for m in model.modules():
                    frozen = any(not p.requires_grad for p in m.parameters(recurse=False))
                    if not frozen and hasattr(m, "reset_parameters") and callable(m.reset_parameters):
                        m.reset_parameters()
        finally:
            if moved:
                model.to(dev)
    elif scheme in _MATRIX_INITS:
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() >= 2:
                tmp = torch.empty(p.shape, dtype=torch.float32)
                _MATRIX_INITS[scheme](tmp, generator=g)
                p.copy_(tmp)
            elif name.endswith("bias"):
                p.zero_()
    else:
        raise ValueError(f"unknown init scheme '{scheme}'")
    if scale != 1.0:
        for p in model.parameters():
            if p.dim() >= 2 and p.requires_grad:
                p.mul_(scale)


class _Builder:
    """Rebuilds candidates from their recipes on top of the shared base weights (with a small cache)."""

    def __init__(self, model: nn.Module, base: Dict[str, torch.Tensor]):
        self.model, self.base = model, base
        self.cache: Dict[str, Dict[str, torch.Tensor]] = {}
        self.param_names = {n for n, p in model.named_parameters() if p.requires_grad}

    def state(self, cand: Candidate) -> Dict[str, torch.Tensor]:
        if cand.id in self.cache:
            return self.cache[cand.id]
        if cand.parent is None:
            _load(self.model, self.base)
            if cand.seed is not None:
                apply_scheme(self.model, cand.scheme, cand.seed, cand.scale)
            state = _state(self.model)
        else:
            state = {k: v.clone() for k, v in self.state(cand.parent).items()}
            g = torch.Generator().manual_seed(int(cand.seed or 0))
            for name in sorted(self.param_names):
                t = state[name]
                if not t.is_floating_point() or t.numel() < 2:
                    continue
                std = float(t.float().std())
                if std > 0 and math.isfinite(std):
                    noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
                    t.add_((noise * (cand.spread * std)).to(t.dtype))
        self.cache[cand.id] = state
        return state

    def keep_only(self, ids: Iterable[str]) -> None:
        keep = set(ids)
        self.cache = {k: v for k, v in self.cache.items() if k in keep}


# ---------------------------------------------------------------------------------------------------
# Probing and selection
# ---------------------------------------------------------------------------------------------------
def _to(x: Any, device: torch.device) -> Any:
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _probe(model: nn.Module, loss_fn: Callable, batches: List[Tuple[Any, Any]], cfg: InitSearchConfig,
           device: torch.device, score_on: List[Tuple[Any, Any]]) -> Tuple[float, float, List[float]]:
    """Train the loaded model `probe_steps` steps; returns (score, last grad norm, losses)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=cfg.lr)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    was_training = model.training
    model.train()
    losses: List[float] = []
    grad_norm = float("nan")
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(_to(x, device)), _to(y, device))
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, float("inf")))
        losses.append(float(loss.detach()))
        if not (math.isfinite(losses[-1]) and math.isfinite(grad_norm)):
            model.train(was_training)
            return float("inf"), grad_norm, losses
        opt.step()
    if cfg.score == "mean":
        score = sum(losses) / len(losses)
    else:  # loss after probing, on the probe batches or on held-out ones
        model.eval()
        with torch.no_grad():
            score = sum(float(loss_fn(model(_to(x, device)), _to(y, device))) for x, y in score_on) / len(score_on)
    model.train(was_training)
    return (score if math.isfinite(score) else float("inf")), grad_norm, losses


def select(entries: List[Dict[str, Any]], keep: int) -> List[Dict[str, Any]]:
    """The `keep` best entries by (score, id): the same order on every rank, ties broken by id."""
    return sorted(entries, key=lambda e: (e["score"], e["candidate"].id))[:max(1, keep)]


def _draw(cfg: InitSearchConfig, rnd: int, rank: int, survivors: List[Candidate], spread: float) -> List[Candidate]:
    """This rank's new candidates of round `rnd` (a deterministic function of the config and survivors)."""
    out = []
    for i in range(cfg.candidates):
        g = rank * cfg.candidates + i  # global index, unique per round
        cid = f"r{rnd}.k{rank}.{i}"
        if rnd == 0:
            scheme = cfg.schemes[g % len(cfg.schemes)]
            scale = cfg.scales[(g // len(cfg.schemes)) % len(cfg.scales)]
            as_given = g == 0 and scheme == "default" and scale == 1.0
            out.append(Candidate(cid, scheme, scale, None if as_given else _mix(cfg.seed, rnd, g), rnd, rank))
        else:
            parent = survivors[g % len(survivors)]
            out.append(Candidate(cid, parent.scheme, parent.scale, _mix(cfg.seed, rnd, g), rnd, rank,
                                 parent=parent, spread=spread))
    return out


def _as_config(cfg: Union[None, Dict[str, Any], InitSearchConfig]) -> InitSearchConfig:
    if isinstance(cfg, InitSearchConfig):
        return cfg
    from pydantic import ValidationError

    from .config_base import format_errors

    try:
        return InitSearchConfig.model_validate(dict(cfg or {}))
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, InitSearchConfig, "pdv.init_search")) from exc


def _broadcast_model(model: nn.Module, comm: Comm, src: int) -> None:
    """Make every rank's parameters and buffers equal to rank `src`'s (one message per dtype)."""
    if comm.size == 1:
        return
    tensors = [p.data for p in model.parameters()] + [b for b in model.buffers()]
    by_dtype: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors([t.contiguous() for t in group])
            comm.broadcast(flat, src)
            for dst, val in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                dst.copy_(val)


# ---------------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------------
def search_init(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], data_iter: Iterable,
                comm: Optional[Comm] = None, cfg: Union[None, Dict[str, Any], InitSearchConfig] = None,
                *, device: Optional[Union[str, torch.device]] = None) -> Dict[str, Any]:
    """Search a starting point for `model` and load it in place on every rank of `comm`; returns a report.

    Collective: every rank of `comm` calls it with the same config. `data_iter` yields `(inputs, labels)`
    batches of this rank's data (`probe_steps` of them are drawn once and reused for every candidate, so
    a rank's candidates are compared on identical data); `loss_fn(model(inputs), labels)` is the loss.
    `cfg.enabled` is ignored here (calling it is the switch). The caller's RNG state is left unchanged.
    """
    cfg = _as_config(cfg)
    comm = comm or LocalComm()
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    t0 = time.perf_counter()
    it: Iterator = iter(data_iter)
    try:
        batches = [next(it) for _ in range(cfg.probe_steps + cfg.score_batches)]
    except StopIteration:
        raise ValueError(f"init search: data_iter ended before {cfg.probe_steps + cfg.score_batches} batches "
                         "(pdv.init_search.probe_steps + score_batches)") from None
    batches, score_on = batches[:cfg.probe_steps], (batches[cfg.probe_steps:] or batches[:cfg.probe_steps])
    was_training = model.training
    _broadcast_model(model, comm, 0)  # one shared base: "the model as given" means rank 0's weights
    builder = _Builder(model, _state(model))
    keep = max(1, int(round(cfg.keep_fraction * cfg.candidates * comm.size)))
    survivors: List[Dict[str, Any]] = []
    rounds: List[Dict[str, Any]] = []
    best_local: Optional[Tuple[float, str, Dict[str, torch.Tensor]]] = None  # probed weights (start_from=probed)
    default_score = None
    with torch.random.fork_rng(devices=_rng_devices()):  # probing must not shift the caller's data order or dropout
        torch.manual_seed(_mix(cfg.seed, "probe", comm.rank))
        for rnd in range(cfg.rounds):
            spread = 0.0 if rnd == 0 else cfg.spread * cfg.shrink ** (rnd - 1)
            mine = _draw(cfg, rnd, comm.rank, [e["candidate"] for e in survivors], spread)
            results = []
            for cand in mine:
                _load(model, builder.state(cand))
                score, gnorm, losses = _probe(model, loss_fn, batches, cfg, device, score_on)
                results.append({"candidate": cand, "score": score, "grad_norm": gnorm,
                                "first_loss": losses[0] if losses else float("nan")})
                if cfg.start_from == "probed" and (best_local is None or (score, cand.id) < best_local[:2]):
                    best_local = (score, cand.id, _state(model))
            entries = [e for per_rank in comm.all_gather_object(results) for e in per_rank]
            if rnd == 0:
                default_score = next((e["score"] for e in entries if e["candidate"].seed is None), None)
            survivors = select(survivors + entries, keep)
            builder.keep_only(e["candidate"].id for e in survivors)
            finite = sorted(e["score"] for e in entries if math.isfinite(e["score"]))
            rounds.append({"round": rnd, "spread": spread, "candidates": len(entries),
                           "diverged": len(entries) - len(finite),
                           "best_score": finite[0] if finite else float("inf"),
                           "median_score": finite[len(finite) // 2] if finite else float("inf"),
                           "survivors": [e["candidate"].id for e in survivors]})
        winner = survivors[0]
        cand: Candidate = winner["candidate"]
        if comm.rank == cand.rank:
            if cfg.start_from == "probed" and math.isfinite(winner["score"]):  # never start from diverged weights
                assert best_local is not None and best_local[1] == cand.id, "winner must be its owner's best"
                _load(model, best_local[2])
            else:
                _load(model, builder.state(cand))
    _broadcast_model(model, comm, cand.rank)
    model.train(was_training)
    return {
        "winner": {**cand.describe(), "score": winner["score"], "grad_norm": winner["grad_norm"]},
        "default_score": default_score,
        "rounds": rounds,
        "candidates": sum(r["candidates"] for r in rounds),
        "ranks": comm.size,
        "start_from": cfg.start_from,
        "probe_seconds": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------------------------------------------
# Pipeline engine: search the whole model, load each stage's slice
# ---------------------------------------------------------------------------------------------------
class _FullModel(nn.Module):
    """All layers of a PipelineModule on one rank, named like the PipelineModule names them (`"3.fc.weight"`,
    `"tied_modules.embed.weight"`), so a stage's state dict is a subset of this one's."""

    def __init__(self) -> None:
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.forward_funcs: List[Callable] = []

    def forward(self, x: Any) -> Any:
        for fn in self.forward_funcs:
            x = fn(x)
        return x


def full_model_from_pipeline(module: Any, layers: Sequence[Any]) -> nn.Module:
    """Build every layer of a `PipelineModule` from its specs (`layers`, every stage's), seeded as the
    PipelineModule seeds them."""
    from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime import utils as ds_utils

    full = _FullModel()
    for idx, layer in enumerate(layers):
        if module.seed_layers:
            (module.seed_fn or ds_utils.set_random_seed)(module.base_seed + idx)
        if isinstance(layer, PipelineModule):
            raise NotImplementedError("init search: nested PipelineModules are not supported")
        if isinstance(layer, nn.Module):
            m = copy.deepcopy(layer)
            full.add_module(str(idx), m)
            full.forward_funcs.append(m)
        elif isinstance(layer, TiedLayerSpec):
            if layer.key not in full.tied_modules:
                full.tied_modules[layer.key] = layer.build()
            tied = full.tied_modules[layer.key]
            full.forward_funcs.append(tied if layer.forward_fn is None else partial(layer.forward_fn, tied))
        elif isinstance(layer, LayerSpec):
            m = layer.build()
            full.add_module(str(idx), m)
            full.forward_funcs.append(m)
        else:
            full.forward_funcs.append(layer)
    return full


#: device bytes per parameter byte of the full model while searching: weights, gradients and the two
#: moments of the probes' Adam (activations on top)
SEARCH_BYTES_PER_PARAM_BYTE = 4


def _agree_it_fits(full: Any, device: torch.device, comm: Comm) -> None:
    """Every rank holds the whole model on its GPU beside its own stage: check that it fits on every rank
    before anything moves, and agree (one flag), so that one rank's shortage is a ConfigError on all of
    them instead of an out-of-memory there and a hang everywhere else."""
    short = ""
    if device.type == "cuda":
        params = sum(p.numel() * p.element_size() for p in full.parameters())
        need, free = SEARCH_BYTES_PER_PARAM_BYTE * params, torch.cuda.mem_get_info(device)[0]
        if need > free:
            short = f"{need / 2 ** 30:.2f} GiB needed, {free / 2 ** 30:.2f} GiB free on rank {comm.rank}"
    bad = comm.all_reduce_scalars([1.0 if short else 0.0], "max")[0] if comm.size > 1 else float(bool(short))
    if bad > 0:
        raise ConfigError(["pdv.init_search: every rank searches over the whole model on its device, which does "
                           "not fit on some rank (" + (short or "another rank is short") + "): search on a "
                           "smaller configuration, or initialise without pdv.init_search"])


def _rng_devices() -> List[int]:
    """The devices whose RNG `fork_rng` must restore: `torch.manual_seed` reseeds CUDA too, so the
    current GPU where CUDA is in use (only it: forking every GPU would open a context on each)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def search_pipeline_init(module: Any, data_iter: Optional[Iterable], cfg: Union[Dict[str, Any], InitSearchConfig],
                         comm: Optional[Comm] = None, *, layers: Sequence[Any]) -> Dict[str, Any]:
    """Run the search over the whole model on every rank (world group by default) and load this stage's slice
    of the winner into `module` (a built PipelineModule whose layer specs, every stage's, are `layers`).
    Called by `pdv_ext.initialize` before the engine exists, so optimizers and fp16 master weights start
    from the winner."""
    cfg = _as_config(cfg)
    if data_iter is None:
        raise ConfigError(["pdv.init_search: needs data on every rank: pass init_search_iter=... (an iterator of "
                           "(inputs, labels) batches) to pdv_ext.initialize"])
    if module.loss_fn is None:
        raise ConfigError(["pdv.init_search: the PipelineModule needs a loss_fn to score candidates"])
    if comm is None:  # the world (every rank calls this); on NCCL its payloads travel on a gloo twin
        from .comm.torch_comm import world_comm

        comm = world_comm()
    first = next(iter(module.parameters()), None)
    if first is not None:
        device = first.device
    else:  # a stage without parameters still searches where the others do (its collectives must match)
        from deepspeed.accelerator import get_accelerator

        device = torch.device(get_accelerator().device_name(getattr(module, "local_rank", 0)))
    with torch.random.fork_rng(devices=_rng_devices()):  # building the full model must not shift the caller's RNG
        full = full_model_from_pipeline(module, layers)
    _agree_it_fits(full, device, comm)
    full = full.to(device)
    report = search_init(full, module.loss_fn, data_iter, comm, cfg, device=device)
    winner = full.state_dict()
    local = module.state_dict()
    missing = [k for k in local if k not in winner]
    if missing:
        raise RuntimeError(f"init search: stage parameters not found in the full model: {missing[:5]}")
    with torch.no_grad():
        for k, v in local.items():
            v.copy_(winner[k])
    report["stage_keys"] = len(local)
    return report
