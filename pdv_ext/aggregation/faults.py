"""Fault injection (`pdv.faults`) and the non-finite guard.

`FaultInjector` makes the configured ranks Byzantine: it replaces their honest gradients, just before
aggregation, with what the attack returns. It is a grad hook of `PDVPipelineEngine` (installed from the
config) and works standalone: `grads = injector.corrupt(grads, comm, step)` before `aggregate`.
Attacks are functions `attack(ctx) -> list[Tensor]`; `ctx.all_grads` holds every rank's honest gradients
(the omniscient adversary), gathered collectively on every rank when the attack needs them.
`label_flip` is a data hook (`flip_labels` / `wrap_data_iter`) the training script applies.

`NonFiniteGuard` makes NaN/Inf from any rank fail loudly with aggregators that cannot filter them
(mean, adasum, gossip): it names the rank(s) and the step. For aggregators whose replicas end identical
it costs no communication on the healthy path (it checks the result locally and asks who was at fault
only when the result is non-finite), so `mean` stays bit-identical to DeepSpeed.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch

from ..comm.base import Comm
from ..registry import load_object
from .faults_config import ATTACKS, FaultsConfig
from .base import all_finite, finite_on_device  # noqa: F401  (all_finite re-exported)
from .robust import device_path, flat_dtype, flatten_as


@dataclasses.dataclass
class AttackContext:
    """What an attack sees. `grads`: this rank's honest gradients; `all_grads[r]`: group rank r's honest
    gradients (None unless gathered); `rank`: group rank; `global_rank`; `step`; `generator`: seeded
    per (seed, rank, step); `config`: the FaultsConfig; `options`: its free-form `options`."""

    grads: List[torch.Tensor]
    all_grads: Optional[List[List[torch.Tensor]]]
    step: int
    rank: int
    global_rank: int
    size: int
    generator: torch.Generator
    config: FaultsConfig
    options: Dict[str, Any]


# ---- built-in attacks ---------------------------------------------------------------------------------
def sign_flip(ctx: AttackContext) -> List[torch.Tensor]:
    s = 1.0 if ctx.config.scale is None else ctx.config.scale
    return [g.mul(-s) for g in ctx.grads]


def gaussian(ctx: AttackContext) -> List[torch.Tensor]:
    return [g + ctx.config.sigma * torch.randn(g.shape, generator=ctx.generator, dtype=torch.float32).to(g)
            for g in ctx.grads]


_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def bit_flip(ctx: AttackContext) -> List[torch.Tensor]:
    """Each entry flips one random bit of its float representation with probability `flip_prob`."""
    out = []
    for g in ctx.grads:
        x = g.detach().clone().contiguous()
        itype = _INT_VIEW[x.element_size()]
        nbits = 8 * x.element_size()
        hit = torch.rand(x.shape, generator=ctx.generator) < ctx.config.flip_prob
        bit = torch.randint(0, nbits, x.shape, generator=ctx.generator)
        mask = torch.where(hit, torch.ones((), dtype=torch.int64) << bit, torch.zeros((), dtype=torch.int64))
        if itype is not torch.int64:  # keep the bit pattern (the sign bit wraps into the narrow type)
            mask = ((mask + 2 ** (nbits - 1)) % 2 ** nbits - 2 ** (nbits - 1))
        bits = x.view(itype)
        bits.bitwise_xor_(mask.to(device=x.device, dtype=itype))  # drawn on the host, applied where x lives
        out.append(x)
    return out


def scaled(ctx: AttackContext) -> List[torch.Tensor]:
    """Omniscient inner-product attack: -scale times the honest mean (default scale 10)."""
    s = 10.0 if ctx.config.scale is None else ctx.config.scale
    assert ctx.all_grads is not None
    m = len(ctx.all_grads)
    return [-s * sum(r[i] for r in ctx.all_grads) / m for i in range(len(ctx.grads))]


def label_flip(ctx: AttackContext) -> List[torch.Tensor]:
    return ctx.grads  # the damage is done in the data (flip_labels)


def nan(ctx: AttackContext) -> List[torch.Tensor]:
    """Non-finite gradients (NaN and +/-Inf), for testing that they never reach the weights."""
    out = []
    for g in ctx.grads:
        x = torch.full_like(g, float("nan"))
        flat = x.view(-1)
        flat[1::3] = float("inf")
        flat[2::3] = float("-inf")
        out.append(x)
    return out


BUILTIN: Dict[str, Callable[[AttackContext], List[torch.Tensor]]] = {
    "sign_flip": sign_flip, "gaussian": gaussian, "bit_flip": bit_flip, "scaled": scaled,
    "label_flip": label_flip, "nan": nan}
assert set(BUILTIN) == set(ATTACKS)


class FaultInjector:
    """Corrupts the gradients of the Byzantine ranks; a grad hook (`before`) of PDVPipelineEngine."""

    def __init__(self, config: Union[FaultsConfig, Dict[str, Any]], global_rank: int):
        self.config = config if isinstance(config, FaultsConfig) else FaultsConfig.model_validate(config)
        self.global_rank = int(global_rank)
        name = self.config.attack
        self.attack: Callable[[AttackContext], List[torch.Tensor]] = BUILTIN[name] if name in BUILTIN else load_object(name)
        self.needs_all = name == "scaled" or (name not in BUILTIN and self.config.omniscient)
        self.last: Dict[str, Any] = {}

    @property
    def byzantine(self) -> bool:
        return self.global_rank in self.config.byzantine_ranks

    def active(self, step: int) -> bool:
        """Same answer on every rank (depends only on config and step)."""
        return bool(self.config.byzantine_ranks) and step >= self.config.start_step

    def check_world(self, world_size: int) -> None:
        bad = [r for r in self.config.byzantine_ranks if r >= world_size]
        if bad:
            from ..config_base import ConfigError

            raise ConfigError([f"pdv.faults.byzantine_ranks: ranks {bad} do not exist in a job of {world_size} ranks"])

    def corrupt(self, grads: List[torch.Tensor], comm: Comm, step: int) -> List[torch.Tensor]:
        """Collective when the attack is omniscient (every rank of `comm` must call it). Writes the
        attack's tensors into `grads` in place on Byzantine ranks and returns `grads`."""
        if not self.active(step):
            return grads
        all_grads = self._gather(grads, comm) if self.needs_all else None
        if not self.byzantine or self.config.attack == "label_flip":
            return grads
        gen = torch.Generator().manual_seed((self.config.seed * 1_000_003 + self.global_rank) * 1_000_003 + step)
        ctx = AttackContext(grads=[g.detach().clone() for g in grads], all_grads=all_grads, step=step, rank=comm.rank,
                            global_rank=self.global_rank, size=comm.size, generator=gen, config=self.config,
                            options=dict(self.config.options))
        bad = self.attack(ctx)
        if not isinstance(bad, (list, tuple)) or len(bad) != len(grads):
            raise TypeError(f"attack {self.config.attack!r} must return a list of {len(grads)} tensors")
        for g, b in zip(grads, bad):
            if tuple(b.shape) != tuple(g.shape):
                raise ValueError(f"attack {self.config.attack!r} returned shape {tuple(b.shape)} for {tuple(g.shape)}")
            g.copy_(b)
        self.last = {"step": step, "attack": self.config.attack}
        return grads

    @staticmethod
    def _gather(grads: List[torch.Tensor], comm: Comm) -> List[List[torch.Tensor]]:
        flat = flatten_as(grads, flat_dtype(grads))
        out = []
        for f in comm.all_gather(flat):
            parts, off = [], 0
            for g in grads:
                parts.append(f[off: off + g.numel()].view_as(g).to(g.dtype))
                off += g.numel()
            out.append(parts)
        return out

    # ---- label flipping (a data hook) --------------------------------------------------------------
    def flip_labels(self, labels: torch.Tensor, step: int) -> torch.Tensor:
        """Labels as this rank trains on them at `step` (flipped on Byzantine ranks under label_flip)."""
        if self.config.attack != "label_flip" or not self.byzantine or not self.active(step):
            return labels
        return self.config.num_classes - 1 - labels

    def wrap_data_iter(self, it: Iterable, step_of: Optional[Callable[[], int]] = None) -> Iterator:
        """(inputs, labels) batches with labels flipped on Byzantine ranks; `step_of()` gives the step."""
        for x, y in it:
            yield x, self.flip_labels(y, step_of() if step_of is not None else self.config.start_step)

    # ---- grad hook protocol ------------------------------------------------------------------------
    def before(self, engine: Any, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        return self.corrupt(grads, engine.dp_comm, int(engine.global_steps))

    def after(self, engine: Any, grads: List[torch.Tensor]) -> None:
        return None


# ---- non-finite guard -----------------------------------------------------------------------------------
class NonFiniteGradients(FloatingPointError):
    """NaN/Inf gradients reached an aggregator that cannot filter them. `.ranks` are group ranks."""

    def __init__(self, msg: str, ranks: List[int], step: int):
        super().__init__(msg)
        self.ranks, self.step = ranks, step


class NonFiniteGuard:
    """Raises `NonFiniteGradients` naming the rank(s) and step when a non-tolerant aggregator sees NaN/Inf.

    `defer=True` (an fp16 engine) leaves non-finite gradients to DeepSpeed's loss scaler: an overflow of the
    scaled gradients is routine there, and DeepSpeed skips that step and lowers the scale, as vanilla does.

    Host syncs on CUDA: one per call where replicas end identical (adasum): the input's exact finite flag
    is computed on the device before the aggregation and read together with the output's after it. Where
    they may differ (gossip) the ranks agree before aggregating: one read of the input's check. Naming
    the culprit (an error path) costs one more."""

    #: passive under DeepSpeed's own `mean` (see integrations.deepspeed.GradHook)
    needs_full_gradients = False

    def __init__(self, defer: bool = False) -> None:
        self._ok = True
        self._ok_dev: Optional[torch.Tensor] = None
        self.defer = defer

    @staticmethod
    def tolerant(aggregator: Any) -> bool:
        return bool(getattr(aggregator, "tolerates_nonfinite", False))

    @staticmethod
    def self_checking(aggregator: Any) -> bool:
        return bool(getattr(aggregator, "checks_nonfinite", False))

    def pre(self, aggregator: Any, grads: List[torch.Tensor], comm: Comm, step: int) -> None:
        self._ok_dev = None
        if self.defer or self.tolerant(aggregator) or self.self_checking(aggregator):
            return
        identical = getattr(aggregator, "replicas_identical", True)
        if identical and grads and device_path(grads[0]):
            # on a device: the input's flag stays there until `post` reads it with the output's, one sync
            self._ok_dev = finite_on_device(grads)
            return
        self._ok = all_finite(grads)
        if not identical and not everyone_finite(self._ok, comm):  # replicas may differ (gossip): agree first
            self._raise(aggregator, comm, step)

    def post(self, aggregator: Any, out: List[torch.Tensor], comm: Comm, step: int) -> None:
        if self.defer or self.tolerant(aggregator) or not getattr(aggregator, "replicas_identical", True):
            return
        if self.self_checking(aggregator):  # it looked at its own reduced buffer: no pass over `out`
            if aggregator.nonfinite_local_ok is not None:  # identical on every rank: all get here together
                self._ok = aggregator.nonfinite_local_ok
                self._raise(aggregator, comm, step)
            return
        if self._ok_dev is not None:  # device path: both flags in one read of the device
            ok_in, ok_out = torch.stack([self._ok_dev, finite_on_device(out).to(self._ok_dev.device)]).tolist()
            self._ok_dev = None
            if not ok_out:
                self._ok = bool(ok_in)
                self._raise(aggregator, comm, step)
            return
        if not all_finite(out):  # identical on every rank, so every rank gets here together
            self._raise(aggregator, comm, step)

    def _raise(self, aggregator: Any, comm: Comm, step: int) -> None:
        flags = comm.all_gather(torch.tensor([0.0 if self._ok else 1.0], dtype=torch.float64,
                                             device=comm.payload_device))
        ranks = [r for r, f in enumerate(flags) if f.item() > 0]
        name = getattr(aggregator, "name", type(aggregator).__name__)
        where = "data-parallel rank(s) " + ", ".join(map(str, ranks))
        to_global = getattr(comm, "global_rank", None)
        if ranks and to_global is not None:
            where += " (global rank(s) " + ", ".join(str(to_global(r)) for r in ranks) + ")"
        if not ranks:
            msg = (f"aggregator '{name}' produced non-finite gradients at step {step} although every rank's input "
                   "was finite (overflow in the sum)")
        else:
            msg = (f"non-finite gradients (NaN/Inf) from {where} at step {step}; aggregator '{name}' cannot filter "
                   "them: use zeno, suspicion, median or trimmed_mean to tolerate faulty ranks")
        raise NonFiniteGradients(msg, ranks, step)

    def run(self, aggregator: Any, grads: List[torch.Tensor], comm: Comm, step: Optional[int] = None) -> List[torch.Tensor]:
        """Standalone: `out = guard.run(agg, grads, comm)` aggregates with the check around it."""
        step = int(getattr(aggregator, "step", 0) if step is None else step)
        self.pre(aggregator, grads, comm, step)
        out = aggregator(grads, comm)
        self.post(aggregator, out, comm, step)
        return out

    # grad hook protocol
    def before(self, engine: Any, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if not self.defer:
            self.pre(engine.aggregator, grads, engine.dp_comm, int(engine.global_steps))
        return grads

    def after(self, engine: Any, grads: List[torch.Tensor]) -> None:
        if not self.defer:
            self.post(engine.aggregator, grads, engine.dp_comm, int(engine.global_steps))


def everyone_finite(mine: bool, comm: Comm) -> bool:
    """Whether every rank of `comm` says its gradients are finite (`mine`: this rank's answer): one
    all-reduce of one host scalar, on the comm's host group where it has one."""
    return mine if comm.size == 1 else comm.all_reduce_scalars([0.0 if mine else 1.0], "max")[0] == 0.0


def loss_scale_overflow(aggregator: Any, grads: List[torch.Tensor], comm: Any) -> bool:
    """Loss-scaled gradients (DeepSpeed fp16, torch AMP's GradScaler under Horovod): whether some replica
    overflowed, for aggregators that would not pass the overflow on. `mean` and `adasum` carry an inf into
    every replica's result, so the scaler skips the step and lowers the scale everywhere, as with the
    frameworks' own reduction. The robust aggregators would drop that replica instead (the scale never
    backs off, and once every replica overflows they raise), and gossip would keep the inf in its residual
    and its neighbours' state. For those the replicas agree first (one flag, on the host group); on an
    overflow anywhere every replica fills its gradients with inf and the aggregator - and its state - is
    not run: all replicas skip the step together."""
    if getattr(aggregator, "replicas_identical", True) and not getattr(aggregator, "tolerates_nonfinite", False):
        return False
    ok = everyone_finite(all_finite(grads), comm)
    if not ok:
        for g in grads:
            g.fill_(float("inf"))
    return not ok


def install_fault_hooks(engine: Any) -> None:
    """Wire `pdv.faults` and the non-finite guard into a PDVPipelineEngine (`engine.pdv_faults` is the
    injector, or None; scripts use `engine.pdv_faults.wrap_data_iter` for label_flip)."""
    cfg = engine.pdv_config.faults
    engine.pdv_faults = None
    if cfg.byzantine_ranks:
        injector = FaultInjector(cfg, engine.global_rank)
        injector.check_world(engine.world_size)
        engine.pdv_faults = injector
        engine.grad_hooks.append(injector)
    engine.grad_hooks.append(NonFiniteGuard(defer=bool(engine.fp16_enabled())))
    agg = engine.aggregator
    if getattr(agg, "needs_validation", False) and engine.validation_iter is None and (
            engine.is_first_stage() or engine.is_last_stage()):
        from ..config_base import ConfigError

        raise ConfigError([f"pdv.aggregation.type: '{agg.name}' needs validation data: pass validation_iter=... "
                           "to pdv_ext.initialize"])
