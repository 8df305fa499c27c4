"""Rank-side functions for the in-memory snapshot tests (run through pdv_ext.spawn.run_ranks)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from tests.integration.move_workers import build, train, whole_state


def _config(root: str, job: str, every: int = 1) -> Dict[str, Any]:
    return {"snapshots": {"root": root, "job": job, "every": every, "keep": 2, "resume": False}}


def before_loss(mode: str, plan: Dict[str, Any], hosts: List[str], root: str, job: str, ckpt: str,
                k: int) -> Dict[str, Any]:
    """Ranks on `hosts` (by rank) train k steps under `plan`, a snapshot after each, and write a disk checkpoint
    ("k") at the end: the reference a resume must equal."""
    os.environ["PDV_HOST"] = hosts[int(os.environ["RANK"])]
    eng, data = build(mode, plan, _config(root, job))
    out = {"first": train(eng, data, k)}
    eng.pdv_snapshots.wait()  # (written in the background) step k sealed on every host
    eng.save_checkpoint(ckpt, tag="k")
    out["state_k"] = whole_state(eng)
    out["snapshot"] = dict(eng.pdv_snapshots.last)
    out["step"] = int(eng.global_steps)
    return out


def after_loss(mode: str, plan: Dict[str, Any], hosts: List[str], root: str, job: str, ckpt: str, n: int,
               placement: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """On the survivors (`hosts` by rank) under `plan` (or, with `placement`, the plan pdv's start-up makes
    for the devices left: `plan` then gives only the pipeline depth): resume from the snapshots and train n
    steps; then a fresh engine under the same plan loads the disk checkpoint "k" and trains n steps (the
    reference)."""
    from pdv_ext.config_base import ConfigError
    from pdv_ext.integrations.deepspeed.checkpoint import plan_of

    os.environ["PDV_HOST"] = hosts[int(os.environ["RANK"])]
    eng, data = build(mode, plan, {**_config(root, job), **({"placement": placement} if placement else {})})
    out: Dict[str, Any] = {"plan": plan_of(eng)}
    try:
        out["resumed_step"] = eng.resume_from_snapshots()
    except ConfigError as exc:
        out["error"] = str(exc)
        return out
    out["resumed_state"] = whole_state(eng)
    out["resumed"] = train(eng, data, n)
    del eng
    eng, data = build(mode, out["plan"], None)
    eng.load_checkpoint(ckpt, tag="k")
    out["reference_state"] = whole_state(eng)
    out["reference"] = train(eng, data, n)
    return out


def auto_every(plan: Dict[str, Any], hosts: List[str], root: str, job: str, k: int) -> Dict[str, Any]:
    """`every: auto`: k steps; after each, the step the next snapshot is due at (what every rank must agree
    on, or their snapshots' collectives cross)."""
    os.environ["PDV_HOST"] = hosts[int(os.environ["RANK"])]
    cfg = _config(root, job)
    cfg["snapshots"]["every"] = "auto"
    eng, data = build("fp32", plan, cfg)
    due = []
    for _ in range(k):
        train(eng, data, 1)
        due.append(eng.pdv_snapshots.next_due)
    eng.pdv_snapshots.wait()
    return {"due": due, "interval": eng.pdv_snapshots.interval, "step": int(eng.global_steps),
            "complete": sorted(eng.pdv_snapshots.store.complete())}
