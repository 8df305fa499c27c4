"""The PolicyRunner: rank 0 decides, every rank applies the same actions at the same step boundary.

Independent of DeepSpeed: it takes a world `Comm` and an *applier* — the object that knows how to change
batch size, LR and aggregator in a given framework (pdv_ext.integrations.deepspeed.glue.EngineApplier for DeepSpeed's
pipeline engine; Horovod has its own). Per step, after the Monitor's all-gather (metrics are identical
on all ranks), rank 0 asks each enabled policy, resolves what depends on rank-local state (the LR
factor), and broadcasts one small message; when there is nothing to do it costs one broadcast of one
integer. A policy that raises is reported with its name and step, then disabled on every rank
(`on_error="disable"`), or every rank raises PolicyError (`on_error="raise"`). Rank 0 logs one INFO line
per applied action (step, policy, action and its values, what changed) through pdv_ext's logger.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from ..comm.base import Comm
from .base import (CHANGE_KINDS, Action, Change, Policy, Replan, SetAggregator, SetBatchSize, SetDataShares,
                   SetGossipPeers, SetLearningRate, TrainContext, action_from_dict)
from ..log import logger as pdv_logger
from .gns import lr_factor
from .shares import check_shares, rescale_shares

log = pdv_logger.getChild("policy")


class PolicyError(RuntimeError):
    """A policy failed and `pdv.policy.on_error` is "raise" (raised on every rank)."""


class Applier(Protocol):
    """What the runner needs from a framework. Every method is called on every rank, at a step boundary."""

    def batch_geometry(self) -> Tuple[int, int, int]:
        """(micro_batch_size, micro_batches per step, data-parallel size)."""

    def set_batch_size(self, micro_batches: int, micro_batch_size: int) -> None: ...

    def get_lr(self) -> List[float]:
        """Current LR of each optimizer param group."""

    def set_lr(self, lrs: Sequence[float]) -> None: ...

    def set_aggregator(self, spec: Any) -> None: ...

    def set_gossip_peers(self, peers: int) -> None: ...

    def data_shares(self) -> Optional[List[int]]:
        """Micro-batches per data-parallel replica, None for the equal split (optional: frameworks without
        per-replica batches leave both data-share methods out, and SetDataShares is refused)."""

    def set_data_shares(self, shares: Optional[Sequence[int]]) -> None: ...

    def replan(self, boundaries: Sequence[int], rank_mapping: Sequence[Sequence[int]]) -> Any:
        """Move the pipeline (optional: frameworks without pipelines leave it out, and Replan is refused);
        returns what the move measured (an object with `to_dict()`)."""


class PolicyRunner:
    """Runs `policies` after every step; see the module docstring for the agreement protocol."""

    def __init__(self, policies: Sequence[Policy], comm: Comm, applier: Applier, on_error: str = "disable",
                 every: int = 1, lr_scaling: str = "sqrt"):
        if on_error not in ("disable", "raise"):
            raise ValueError("on_error must be 'disable' or 'raise'")
        self.policies = list(policies)
        self.comm, self.applier = comm, applier
        self.on_error, self.every, self.lr_scaling = on_error, int(every), lr_scaling
        self.disabled: Dict[int, str] = {}  # policy index -> error message
        self.errors: List[Dict[str, Any]] = []
        #: (step, action dict) of every applied action, identical on all ranks
        self.action_log: List[Tuple[int, Dict[str, Any]]] = []
        self.base_lrs: Optional[List[float]] = None
        self.lr_scale = 1.0
        self._written: Optional[List[float]] = None
        self._lr_moved = False  # the LR changed between our writes: a scheduler (or the user) sets it
        self.step = 0
        # rank 0: decided but not yet broadcast (between agreement steps)
        self._queue: List[Dict[str, Any]] = []
        self._queued_errors: List[Dict[str, Any]] = []
        self._stop: Optional[str] = None
        self._geom: Optional[Tuple[int, int, int]] = None
        #: what the last Replan's move measured (MoveReport.to_dict()), for policies and benchmarks
        self.last_move: Optional[Dict[str, Any]] = None
        #: every change announced to the policies (Change), identical on all ranks
        self.changes: List[Change] = []
        #: the plan and shares in force when last seen (start, change): a resume under others is announced
        self._in_force: Optional[Dict[str, Any]] = None

    # ---- hooks ----------------------------------------------------------------------------------
    def context(self, step: int = 0) -> TrainContext:
        mbs, mb, dp = self.applier.batch_geometry()
        lrs = self.applier.get_lr()
        return TrainContext(world_size=self.comm.size, dp_size=dp, micro_batch_size=mbs, micro_batches=mb,
                            lr=lrs[0] if lrs else 0.0, step=step,
                            extra={"stages": int(getattr(self.applier, "num_stages", 1)),
                                   "lr_scaling": self.lr_scaling,
                                   "data_shares": (self.applier.data_shares()
                                                   if hasattr(self.applier, "data_shares") else None),
                                   "placement": (self.applier.placement()
                                                 if hasattr(self.applier, "placement") else None)})

    def on_train_begin(self, step: int = 0) -> None:
        ctx = self.context(step)
        for i, pol in enumerate(self.policies):
            if i not in self.disabled:
                self._guard(i, step, pol.on_train_begin, ctx, local=True)
        # a checkpoint taken under another plan or split (a layer-keyed load, another world): the policies'
        # restored measurements belong to what the checkpoint had in force, not to what runs now
        before, now = self._in_force, self._in_force_now()
        if before is not None and before.get("world", now["world"]) != now["world"]:  # a restart on other devices
            self._announce(Change(kind="recovery", step=step, **self._state_fields()))
        elif before is not None and (before["shares"], before["plan"]) != (now["shares"], now["plan"]):
            self._announce(Change(kind="checkpoint", step=step, **self._state_fields()))
        self._in_force = now

    def after_step(self, metrics: Dict[str, Any]) -> List[Action]:
        """Collective: every rank calls it with the (identical) metrics of the step just finished.

        Rank 0 asks the policies every step; what they decided is broadcast and applied on every
        `every`-th step (one broadcast per `every` steps: cheaper, and decisions wait at most every-1 steps).
        """
        step = int(metrics["step"])
        self.step = step
        self._sync_lr()
        if self.comm.rank == 0 and self._stop is None:
            self._decide(metrics)
        if step % self.every:  # not an agreement step
            return []
        payload = None
        if self.comm.rank == 0 and (self._queue or self._queued_errors or self._stop):
            payload = {"actions": self._queue, "errors": self._queued_errors, "stop": self._stop}
            self._queue, self._queued_errors, self._geom = [], [], None
        payload = self._broadcast(payload)
        if not payload:
            return []
        if self.comm.rank != 0:
            for err in payload.get("errors", []):
                self._record_error(err)
        if payload.get("stop"):
            raise PolicyError(payload["stop"])
        applied = []
        for item in payload.get("actions", []):
            action = action_from_dict(item["action"])
            effect = self._apply(action, item)
            self.action_log.append((step, action.to_dict()))
            if self.comm.rank == 0:
                log.info("step %d: policy '%s' applied %s: %s", step, action.source, _action_text(action), effect)
            applied.append(action)
            if effect != "no change":
                self._announce(Change(kind=CHANGE_KINDS[type(action)], step=step, source=action.source,
                                      action=action.to_dict(), **self._state_fields()))
        return applied

    # ---- one adaptive system: every applied change is announced to every policy ---------------------
    def applied(self, kind: str) -> List[Dict[str, Any]]:
        """Every applied action of type `kind` (e.g. "SetBatchSize"), each with its step and its fields (the
        deciding policy's reason among them): what a benchmark reports of a run's decisions."""
        return [{"step": int(at), **{k: v for k, v in a.items() if k != "action"}}
                for at, a in self.action_log if a.get("action") == kind]

    def _in_force_now(self) -> Dict[str, Any]:
        """The data shares and the pipeline plan in force (what a policy's measurements belong to)."""
        ap = self.applier
        shares = ap.data_shares() if hasattr(ap, "data_shares") else None
        pl = ap.placement() if hasattr(ap, "placement") else None
        plan = None if not pl else {"boundaries": [int(b) for b in pl["boundaries"]],
                                    "rank_mapping": [[int(r) for r in row] for row in pl["rank_mapping"]]}
        return {"shares": None if shares is None else [int(n) for n in shares], "plan": plan,
                "world": int(self.comm.size)}

    def _state_fields(self) -> Dict[str, Any]:
        now = self._in_force_now()
        mbs, mb, dp = self.applier.batch_geometry()
        plan = now["plan"] or {}
        return {"shares": now["shares"], "boundaries": tuple(plan.get("boundaries", ())),
                "rank_mapping": tuple(tuple(r) for r in plan.get("rank_mapping", ())),
                "micro_batch_size": int(mbs), "micro_batches": int(mb), "dp_size": int(dp)}

    def _announce(self, change: Change) -> None:
        """Tell every enabled policy, on every rank (each rank runs this after the same apply: the same
        change, in the same order). No communication: what is in force is identical on every rank."""
        self.changes.append(change)
        self._in_force = {"shares": None if change.shares is None else list(change.shares),
                          "plan": change.plan, "world": int(self.comm.size)}
        for i, pol in enumerate(self.policies):
            if i not in self.disabled:
                self._guard(i, change.step, pol.on_change, change, local=True)

    # ---- rank 0 ---------------------------------------------------------------------------------
    def _decide(self, metrics: Dict[str, Any]) -> None:
        step = int(metrics["step"])
        metrics.setdefault("last_move", self.last_move)  # what the last Replan cost (identical on every rank)
        for i, pol in enumerate(self.policies):
            if i in self.disabled:
                continue
            geom = self._geom
            try:
                out = pol.after_step(metrics) or []
                resolved = []
                for a in out:
                    if not isinstance(a, Action):
                        raise TypeError(f"after_step returned {a!r}, not an Action")
                    resolved.append(self._resolve(a, _name(pol), metrics))
            except Exception as exc:  # a plugin's bug must not kill the run unless asked to
                self._geom = geom  # forget what this policy's valid actions simulated
                err = {"index": i, "policy": _name(pol), "step": step, "error": f"{type(exc).__name__}: {exc}"}
                self._queued_errors.append(err)
                self._record_error(err)
                if self.on_error == "raise":
                    self._stop = f"policy '{err['policy']}' failed at step {step}: {err['error']}"
                    return
                continue
            self._queue.extend(resolved)

    def _resolve(self, a: Action, source: str, metrics: Dict[str, Any]) -> Dict[str, Any]:
        """Validate an action and fix what must be identical on every rank (the LR factor), against the
        geometry the queued actions will have produced."""
        d = a.to_dict()
        d["source"] = d.get("source") or source
        item: Dict[str, Any] = {"action": d}
        if isinstance(a, SetBatchSize):
            mbs0, mb0, dp = self._geom or self.applier.batch_geometry()
            mb, mbs = _or(a.micro_batches, mb0), _or(a.micro_batch_size, mbs0)
            if mb < 1 or mbs < 1:
                raise ValueError(f"SetBatchSize: sizes must be >= 1 (got micro_batches={mb}, micro_batch_size={mbs})")
            rule = a.lr_rule or self.lr_scaling
            item["lr_factor"] = lr_factor(rule, mbs0 * mb0 * dp, mbs * mb * dp, metrics.get("gns"))
            self._geom = (mbs, mb, dp)
        elif isinstance(a, Replan):
            if not hasattr(self.applier, "replan"):
                raise ValueError(f"Replan: {type(self.applier).__name__} has no pipeline to move")
            if not a.boundaries or not a.rank_mapping:
                raise ValueError("Replan: needs boundaries and rank_mapping")
        elif isinstance(a, SetDataShares):
            if not hasattr(self.applier, "set_data_shares"):
                raise ValueError(f"SetDataShares: {type(self.applier).__name__} has no per-replica batches")
            _, mb, dp = self._geom or self.applier.batch_geometry()
            if a.shares is not None:
                _, mb_now, _ = self.applier.batch_geometry()
                if mb != mb_now and sum(a.shares) == mb_now * dp:  # split for the batch a queued change replaces
                    d["shares"] = tuple(rescale_shares(a.shares, mb * dp))
                check_shares(d["shares"], dp, mb * dp, what="SetDataShares")
        return item

    def _broadcast(self, payload: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Rank 0's payload on every rank: a length, then (only when non-empty) the pickled bytes.
        (Comm.broadcast_object always sends both; the empty case is the common one.)"""
        if self.comm.size == 1:
            return payload
        data = pickle.dumps(payload) if (self.comm.rank == 0 and payload) else b""
        dev = self.comm.payload_device
        n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
        self.comm.broadcast(n, 0)
        if int(n.item()) == 0:
            return None
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
        if self.comm.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.comm.broadcast(buf, 0)
        return pickle.loads(buf.cpu().numpy().tobytes())

    # ---- every rank -----------------------------------------------------------------------------
    def _apply(self, action: Action, item: Dict[str, Any]) -> str:
        """Apply `action` on this rank; returns what changed, for the log line."""
        ap = self.applier
        lr0 = _first(ap.get_lr())
        if isinstance(action, SetBatchSize):
            mbs0, mb0, dp = ap.batch_geometry()
            mb, mbs = _or(action.micro_batches, mb0), _or(action.micro_batch_size, mbs0)
            if mb < 1 or mbs < 1:
                raise ValueError(f"SetBatchSize from '{action.source}': sizes must be >= 1 (got {mb}, {mbs})")
            if (mb, mbs) == (mb0, mbs0):
                return "no change"
            shares = ap.data_shares() if hasattr(ap, "data_shares") else None
            ap.set_batch_size(mb, mbs)  # (an applier starts a new global batch from the equal split)
            kept = ""
            if shares is not None and mb != mb0:  # the split another policy chose, carried to the new batch
                scaled = rescale_shares(shares, mb * dp)
                if len(set(scaled)) > 1:
                    ap.set_data_shares(scaled)
                kept = f", data shares {list(shares)} -> {scaled if len(set(scaled)) > 1 else 'equal'}"
            elif shares is not None:
                ap.set_data_shares(shares)
            self._scale_lr(float(item.get("lr_factor", 1.0)))
            return (f"batch {mbs0 * mb0 * dp} -> {mbs * mb * dp} (micro_batches {mb0} -> {mb}, micro_batch_size "
                    f"{mbs0} -> {mbs}), lr {lr0:.4g} -> {_first(ap.get_lr()):.4g}{kept}")
        if isinstance(action, SetLearningRate):
            if action.lr is not None:
                self.base_lrs = [float(action.lr)] * len(ap.get_lr())
                self.lr_scale = 1.0
            if action.scale is not None:
                self.lr_scale *= float(action.scale)
            self._write_lr()
            if not self._has_scheduler():
                return f"lr {lr0:.4g} -> {_first(ap.get_lr()):.4g}"
            return f"lr {lr0:.4g} -> {_first(ap.get_lr()):.4g} (scale on the scheduler's LR now {self.lr_scale:.4g})"
        if isinstance(action, SetAggregator):
            ap.set_aggregator(action.spec)
            return f"aggregator -> {action.spec}"
        if isinstance(action, SetGossipPeers):
            ap.set_gossip_peers(int(action.peers))
            return f"gossip peers -> {int(action.peers)}"
        if isinstance(action, SetDataShares):
            _, mb, dp = ap.batch_geometry()
            before = ap.data_shares()
            shares = None if action.shares is None else check_shares(action.shares, dp, mb * dp,
                                                                      what=f"SetDataShares from '{action.source}'")
            if shares is not None and len(set(shares)) == 1:
                shares = None  # the equal split is DeepSpeed's own (bit for bit)
            if shares == before:
                return "no change"
            ap.set_data_shares(shares)
            return f"data shares {before or 'equal'} -> {shares or 'equal'} (micro-batches per replica)"
        if isinstance(action, Replan):
            report = ap.replan(list(action.boundaries), [list(r) for r in action.rank_mapping])
            self.last_move = report.to_dict() if hasattr(report, "to_dict") else report
            moved = self.last_move or {}
            return (f"pipeline moved to boundaries {list(action.boundaries)}, mapping "
                    f"{[list(r) for r in action.rank_mapping]} in {moved.get('seconds', float('nan')):.2f} s, "
                    f"{moved.get('bytes_moved', 0) / 1e6:.1f} MB moved" + (f" ({action.reason})" if action.reason else ""))
        raise TypeError(f"unknown action {action!r}")

    def sync_lr(self) -> None:
        """Call after every step (not only on agreement steps): an LR scheduler that moved the LR resets it
        to its own value, and the policies' scale must be on it before the next step uses it."""
        self._sync_lr()

    def _has_scheduler(self) -> bool:
        """Whether an LR scheduler sets the base LR the policies' scale multiplies: the applier says so
        (`has_lr_scheduler()`, or a DeepSpeed engine's `lr_scheduler`), or the LR was seen moved by someone else."""
        ap = self.applier
        if hasattr(ap, "has_lr_scheduler"):
            return bool(ap.has_lr_scheduler())
        engine = getattr(ap, "engine", None)
        return getattr(engine, "lr_scheduler", None) is not None or self._lr_moved

    def _sync_lr(self) -> None:
        """An LR scheduler (or the user) moved the LR since we last wrote it: that is the new base."""
        cur = self.applier.get_lr()
        if self.base_lrs is not None and cur != self._written:
            self._lr_moved = True
        if self.base_lrs is None or cur != self._written:
            self.base_lrs = list(cur)
            if self.lr_scale != 1.0:
                self._write_lr()
            else:
                self._written = list(cur)

    def _scale_lr(self, factor: float) -> None:
        if factor != 1.0:
            self.lr_scale *= factor
            self._write_lr()

    def _write_lr(self) -> None:
        assert self.base_lrs is not None
        lrs = [b * self.lr_scale for b in self.base_lrs]
        self.applier.set_lr(lrs)
        self._written = list(self.applier.get_lr())

    def _record_error(self, err: Dict[str, Any]) -> None:
        self.errors.append(err)
        i = err["index"]
        if i not in self.disabled:
            self.disabled[i] = err["error"]
            if self.comm.rank == 0:
                verb = "stopping the run" if self.on_error == "raise" else "disabled"
                log.error("policy '%s' failed at step %d: %s (%s)", err["policy"], err["step"], err["error"], verb)

    def _guard(self, i: int, step: int, fn: Any, *args: Any, local: bool = False) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            err = {"index": i, "policy": _name(self.policies[i]), "step": step,
                   "error": f"{type(exc).__name__}: {exc}"}
            if self.on_error == "raise":
                raise PolicyError(f"policy '{err['policy']}' failed at step {step}: {err['error']}") from exc
            self._record_error(err)
            return None

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"policies": [p.state_dict() for p in self.policies], "disabled": dict(self.disabled),
                "errors": list(self.errors), "action_log": list(self.action_log), "base_lrs": self.base_lrs,
                "lr_scale": self.lr_scale, "written": self._written, "step": self.step,
                "queue": list(self._queue), "queued_errors": list(self._queued_errors), "stop": self._stop,
                "geom": self._geom, "in_force": self._in_force}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if len(state["policies"]) != len(self.policies):
            raise ValueError(f"checkpoint has {len(state['policies'])} policies, the config {len(self.policies)}")
        for pol, ps in zip(self.policies, state["policies"]):
            pol.load_state_dict(ps)
        self.disabled = {int(k): v for k, v in state["disabled"].items()}
        self.errors = list(state["errors"])
        self.action_log = [tuple(x) for x in state["action_log"]]  # type: ignore[misc]
        self.base_lrs, self.lr_scale, self._written = state["base_lrs"], state["lr_scale"], state["written"]
        self.step = state["step"]
        self._queue, self._queued_errors = list(state.get("queue", [])), list(state.get("queued_errors", []))
        self._stop, self._geom = state.get("stop"), state.get("geom")
        self._in_force = state.get("in_force")  # compared with what runs now at the next on_train_begin


def _first(lrs: Sequence[float]) -> float:
    return float(lrs[0]) if lrs else float("nan")


def _action_text(action: Action) -> str:
    """`SetBatchSize(micro_batches=8, lr_rule='sqrt')`: the action's values that were given."""
    values = {k: v for k, v in action.to_dict().items()
              if k not in ("action", "source") and v is not None and not (k == "reason" and not v)}
    return f"{type(action).__name__}({', '.join(f'{k}={v!r}' for k, v in values.items())})"


def _or(value: Optional[int], default: int) -> int:
    return default if value is None else int(value)


def _name(pol: Policy) -> str:
    return getattr(pol, "plugin_name", None) or type(pol).__dict__.get("name") or type(pol).__name__
