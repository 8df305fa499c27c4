"""The Policy protocol, the Actions a policy may return, and the policy registry.

A policy only *decides*: `after_step(metrics)` looks at the step's metrics (identical on every rank) and
returns Actions. The PolicyRunner — not the policy — makes every rank agree (rank 0 decides, broadcasts)
and applies the actions at the same step boundary. Policies must be picklable-state objects: whatever
`state_dict()` returns is saved in checkpoints.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple, Type, Union

from ..config_base import StrictModel, WithOptions
from ..registry import Registry, call_factory

#: filled by `policy/builtin` (imported by the package, so before any lookup) and by plug-ins
POLICIES: Registry = Registry("policy", "pdv_ext.policies")

LRRule = Literal["none", "linear", "sqrt", "adascale"]


# ---------------------------------------------------------------------------------------------------
# Actions: small, picklable records (they travel from rank 0 to every rank)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """Base of all actions. `source` is filled by the runner with the deciding policy's name."""

    def to_dict(self) -> Dict[str, Any]:
        return {"action": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class SetBatchSize(Action):
    """Change micro-batches per step (gradient accumulation) and/or the micro-batch size.

    `lr_rule` scales the LR by the batch ratio: `linear` (r), `sqrt` (sqrt r), `adascale` (the AdaScale
    gain from the current noise-scale estimate), `none`; None = the config's `pdv.policy.lr_scaling`.
    """

    micro_batches: Optional[int] = None
    micro_batch_size: Optional[int] = None
    lr_rule: Optional[LRRule] = None
    source: str = ""
    #: why, for the log line and the benchmarks' decision lists (e.g. the throughputs and efficiencies that
    #: decided it)
    reason: str = ""


@dataclass(frozen=True)
class SetLearningRate(Action):
    """Set the LR (`lr`, absolute, all param groups) or multiply it (`scale`). With an LR scheduler the
    scheduler keeps setting the base LR; `scale` survives that, `lr` resets the scale to 1."""

    lr: Optional[float] = None
    scale: Optional[float] = None
    source: str = ""


@dataclass(frozen=True)
class SetAggregator(Action):
    """Switch the data-parallel aggregator, e.g. `{"type": "gossip", "peers": 1}`."""

    spec: Union[str, Dict[str, Any]] = "mean"
    source: str = ""


@dataclass(frozen=True)
class SetGossipPeers(Action):
    """Change the gossip aggregator's peer count k (`aggregator.set_peers(k)`)."""

    peers: int = 1
    source: str = ""


@dataclass(frozen=True)
class SetDataShares(Action):
    """Micro-batches per data-parallel replica (index: the replica's data-parallel rank), summing to the
    step's micro-batches (the global batch stays the same; `shares=None` = the equal split). Every stage of
    a replica runs that many micro-batches, the data iterator hands each replica its slice of the global
    batch, and the aggregator weighs the replicas by their samples (docs/policy.md, "Data shares")."""

    shares: Optional[Tuple[int, ...]] = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.shares is not None:  # a list from a plugin or a pickle: one hashable, comparable form
            object.__setattr__(self, "shares", tuple(int(n) for n in self.shares))


@dataclass(frozen=True)
class Replan(Action):
    """Move the running pipeline to new stage `boundaries` (DeepSpeed's parts) and `rank_mapping`
    (`[stage][replica] -> global rank`) at this step boundary, in the same processes
    (pdv_ext.placement.move: weights and optimizer state travel layer by layer). `reason` goes to the log."""

    boundaries: Tuple[int, ...] = ()
    rank_mapping: Tuple[Tuple[int, ...], ...] = ()
    reason: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "rank_mapping", tuple(tuple(int(r) for r in row) for row in self.rank_mapping))


ACTIONS: Dict[str, Type[Action]] = {c.__name__: c for c in (SetBatchSize, SetLearningRate, SetAggregator,
                                                               SetGossipPeers, SetDataShares, Replan)}


def action_from_dict(d: Dict[str, Any]) -> Action:
    d = dict(d)
    return ACTIONS[d.pop("action")](**d)


#: Change.kind of each action (what an applied action changed)
CHANGE_KINDS: Dict[Type[Action], str] = {SetDataShares: "shares", Replan: "replan", SetBatchSize: "batch_size",
                                         SetAggregator: "aggregator", SetGossipPeers: "gossip_peers",
                                         SetLearningRate: "lr"}


@dataclass(frozen=True)
class Change:
    """What the runner announces to every policy (`Policy.on_change`) right after it applied a change, on every
    rank, identically: the system's other policies changed something, or this one did, or a checkpoint brought
    another plan or split. What a policy measured before it may be stale now.

    `kind`: `shares`, `replan` (the pipeline moved), `batch_size`, `aggregator`, `gossip_peers`, `lr`,
    `checkpoint` (a resumed run found another plan or other data shares in force than the checkpoint's), or
    `recovery` (a resumed run has another world than the checkpoint's: devices were lost or came back, and a
    rank may be on another device).
    `step`: the step boundary it took effect at (the next step runs under it). `source`: the deciding policy
    (empty for `checkpoint`). What is in force after it: `shares` (micro-batches per data-parallel replica,
    None: the equal split), `boundaries` and `rank_mapping` (the pipeline plan; empty where the framework has
    no pipeline), `micro_batch_size`, `micro_batches` (per replica, the equal split's), `dp_size`. `action`:
    the applied action's dict (None for `checkpoint`)."""

    kind: str
    step: int
    source: str = ""
    shares: Optional[Tuple[int, ...]] = None
    boundaries: Tuple[int, ...] = ()
    rank_mapping: Tuple[Tuple[int, ...], ...] = ()
    micro_batch_size: int = 0
    micro_batches: int = 0
    dp_size: int = 0
    action: Optional[Dict[str, Any]] = None

    #: the kinds after which per-replica or per-device work is different: timings taken before are stale
    WORK_KINDS: ClassVar[Tuple[str, ...]] = ("shares", "replan", "batch_size", "checkpoint", "recovery")

    def __post_init__(self) -> None:
        if self.shares is not None:
            object.__setattr__(self, "shares", tuple(int(n) for n in self.shares))
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "rank_mapping", tuple(tuple(int(r) for r in row) for row in self.rank_mapping))

    @property
    def moves_work(self) -> bool:
        """Whether the work of a replica or a device changed (shares, plan, batch geometry)."""
        return self.kind in self.WORK_KINDS

    @property
    def plan(self) -> Optional[Dict[str, Any]]:
        """`{"boundaries", "rank_mapping"}` in force after the change (lists), None without a pipeline."""
        if not self.boundaries or not self.rank_mapping:
            return None
        return {"boundaries": list(self.boundaries), "rank_mapping": [list(r) for r in self.rank_mapping]}


# ---------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------
@dataclass
class TrainContext:
    """What a policy learns at the start: the batch geometry and the world. `applier` is the object the
    runner applies actions to (the engine adapter); policies should not call it directly."""

    world_size: int
    dp_size: int
    micro_batch_size: int
    micro_batches: int
    lr: float
    step: int = 0
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp_size


class Policy(WithOptions):
    """Base class of policies. Subclass, set `name` and an `Options` model, override the hooks.

    `after_step(metrics)` gets a dict (keys in docs/policy.md: step, batch_size, micro_batches,
    micro_batch_size, loss, lr, step_time, step_times, compute_times, samples_per_s, gns, ...) and
    returns a list of Actions (empty: no change). Runs on rank 0 only; must not communicate.
    """

    name: ClassVar[str] = "policy"

    def on_train_begin(self, ctx: TrainContext) -> None:
        """Called once on every rank before the first step (or after a resume)."""

    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        return []

    def on_change(self, change: "Change") -> None:
        """Called on every rank, by the runner, right after a change was applied (any policy's, this one's
        too, or a checkpoint's other plan): restart what the change made stale. Must not communicate nor
        return actions; runs identically on every rank. Default: nothing."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    @classmethod
    def aggregators_named(cls, options: StrictModel) -> List[tuple]:
        """(option key, aggregator name) pairs this policy may switch to — checked by `pdv check-config`."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options.model_dump()})"


def register_policy(name: Optional[str] = None):
    """Class decorator: make a Policy usable as `{"name": name}` in `pdv.policy.plugins`."""
    return POLICIES.register_class(name)


def build_policy(spec: Union[str, Dict[str, Any], Policy]) -> Policy:
    """A Policy from `{"name": ..., **options}`, a name, or an instance."""
    if isinstance(spec, Policy):
        return spec
    spec = {"name": spec} if isinstance(spec, str) else dict(spec)
    name = spec.pop("name")
    cls = POLICIES.get(name)
    pol = cls(spec) if isinstance(cls, type) and issubclass(cls, Policy) else call_factory(cls, spec, Policy, name)
    if not getattr(pol, "plugin_name", None):
        pol.plugin_name = name  # the name the user wrote: used in error reports
    return pol
