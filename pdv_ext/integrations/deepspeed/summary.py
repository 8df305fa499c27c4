"""What `pdv_ext.initialize` logs at start-up: that pdv_ext took over, one line per capability in use.

A user who printed `type(engine)` could not tell whether the aggregator, the placement or the policies were
active. At the end of `initialize` every rank hands rank 0 its stage and its aggregator (one small
`all_gather_object` over the world: aggregators are built per stage and a plugin factory may build a
different one per stage), and rank 0 logs, at INFO through pdv_ext's own logger (`pdv_ext.log`: shown by
default, quiet with `"log_level": "warning"` in the DeepSpeed config):

    pdv_ext: engine PDVPipelineEngine: 2 stages x 2 data-parallel replicas (4 ranks)
    pdv_ext: aggregator adasum() on every stage's data-parallel group
    pdv_ext: placement boundaries [0, 3, 8], rank mapping [[0, 3], [1, 2]] (plan plan.json, solver dp; predicted step 161.6 ms)
    pdv_ext: data shares by_throughput on cluster.yaml: [5, 3] micro-batches per data-parallel replica (8 a step)
    pdv_ext: policies gns_batch_size(...) (agreed every 1 step; monitor -> runs/demo)
    pdv_ext: init search: 16 candidates on 4 ranks in 12.3 s; winner ... (score 2.1, default 2.4)
    pdv_ext: faults sign_flip from ranks [3]

Lines for capabilities not in use (no placement given, no policy, ...) are left out.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from ...log import logger

PREFIX = "pdv_ext: "


def plugin_label(plugin: Any) -> str:
    """The name a user knows a plug-in by: the one the config gave (`plugin_name`, e.g.
    `"my_policy:PlateauLR"`), else the `name` its own class sets (registration sets it), else its
    class's name: an unregistered subclass would otherwise show its base's placeholder (`policy(...)`,
    `base(...)`)."""
    own = getattr(plugin, "__dict__", {}).get("name") or vars(type(plugin)).get("name")
    return getattr(plugin, "plugin_name", None) or own or type(plugin).__name__


def describe(plugin: Any) -> str:
    """`name(option=value, ...)`: an aggregator or a policy as configured on this rank."""
    opts = getattr(plugin, "options", None)
    dump = opts.model_dump() if hasattr(opts, "model_dump") else dict(opts or {})
    return f"{plugin_label(plugin)}({', '.join(f'{k}={v!r}' for k, v in dump.items())})"


def describe_in_force(agg: Any) -> str:
    """`describe(agg)`, plus the options its data-parallel group clamped (`SmallGroups`), as in force."""
    text = describe(agg)
    size, clamps = getattr(agg, "group_size", None), getattr(agg, "clamps", None)
    if size and callable(clamps):
        held = [f"{key}={got}" for key, _want, got, _why in clamps(size)]
        if held:
            text += f" [clamped for a group of {size}: {', '.join(held)}]"
    return text


def local_facts(engine: Any) -> Dict[str, Any]:
    """What this rank contributes to rank 0's summary: its stage and its aggregator."""
    agg = getattr(engine, "aggregator", None)
    return {"stage": int(getattr(engine, "stage_id", 0)),
            "aggregator": describe_in_force(agg) if agg is not None else None,
            "native_reduce": bool(getattr(engine, "_native_reduce", False)),
            "reduce_mode": getattr(engine, "reduce_mode", None)}


def gather_facts(facts: Dict[str, Any]) -> Optional[List[Dict[str, Any]]]:
    """Every rank's facts on rank 0 (None elsewhere). Collective over the world when one is initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [facts]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, facts)
    return out if dist.get_rank() == 0 else None


def _ms(seconds: Any) -> Optional[str]:
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return None
    return f"{s * 1e3:.1f} ms" if s == s and s > 0 else None  # NaN: the plan predicted nothing


def _placement_line(engine: Any, cfg: Any) -> Optional[str]:
    applied = getattr(engine, "placement", None)
    if not applied:
        return None
    pl = cfg.placement
    plan: Dict[str, Any] = getattr(engine.module, "_pdv_plan", None) or {}
    if pl.plan is not None:
        source = f"plan {pl.plan}"
        try:
            with open(pl.plan, encoding="utf-8") as f:
                plan = json.load(f)
        except (OSError, ValueError):
            plan = {}
    elif pl.cluster is not None:
        source = f"planned at start-up on {pl.cluster}"
    else:
        source = "explicit " + " and ".join(k for k in ("boundaries", "rank_mapping") if getattr(pl, k) is not None)
    details = [source]
    if plan.get("solver"):
        details.append(f"solver {plan['solver']}")
    predicted = _ms(plan.get("predicted_step_time"))
    if predicted:
        mb = plan.get("micro_batches")
        details.append(f"predicted step {predicted}" + (f" at {mb} micro-batches" if mb else ""))
    return (f"placement boundaries {applied['boundaries']}, rank mapping {applied['rank_mapping']} "
            f"({'; '.join(details)})")


def _policy_line(engine: Any) -> Optional[str]:
    glue = getattr(engine, "pdv_policy", None)
    if glue is None:
        return None
    runner = getattr(glue, "runner", None)
    policies = [describe(p) for p in getattr(runner, "policies", [])] if runner is not None else []
    cfg = glue.cfg
    where = cfg.monitor.output_dir or "in memory"
    head = f"policies {', '.join(policies)}" if policies else "policies none"
    return f"{head} (agreed every {cfg.every} step{'s' if cfg.every != 1 else ''}; monitor -> {where})"


def _shares_line(engine: Any, cfg: Any, dp: int) -> Optional[str]:
    """The data shares in force (micro-batches per data-parallel replica) when `pdv.data_shares` is not
    `equal`: the configured list, or `by_throughput` with the list it gave (an equal split included)."""
    asked = getattr(cfg, "data_shares", "equal")
    if asked is None or asked == "equal":
        return None
    total = getattr(engine, "total_micro_batches", None)
    shares = getattr(engine, "data_shares", None)
    if shares is None and total:  # an equal split: the engine keeps None (DeepSpeed's own)
        shares = [int(total) // dp] * dp
    shares = [int(x) for x in shares] if shares is not None else None
    notes = ([f"{int(total)} a step"] if total else []) + (["an equal split"] if shares and len(set(shares)) == 1 else [])
    if isinstance(asked, str):  # by_throughput
        cluster = getattr(getattr(cfg, "placement", None), "cluster", None)
        head = f"data shares {asked}" + (f" on {cluster}" if cluster else "") + f": {shares}"
    else:
        head = f"data shares {shares}"
    return f"{head} micro-batches per data-parallel replica" + (f" ({'; '.join(notes)})" if notes else "")


def _init_search_line(engine: Any) -> Optional[str]:
    rep = getattr(engine, "init_search_report", None)
    if not rep:
        return None
    win = rep.get("winner", {})
    secs = rep.get("probe_seconds")
    who = ", ".join(f"{k} {win[k]}" for k in ("scheme", "scale", "seed") if win.get(k) is not None) or "the default"
    return (f"init search: {rep.get('candidates', '?')} candidates on {rep.get('ranks', '?')} ranks"
            + (f" in {secs:.1f} s" if isinstance(secs, (int, float)) else "")
            + f"; winner {who} (score {win.get('score')!s}, default {rep.get('default_score')!s})")


def startup_lines(engine: Any, facts: List[Dict[str, Any]], cfg: Any) -> List[str]:
    """The summary from every rank's `local_facts` (in rank order) and the validated `pdv` section."""
    stages = int(getattr(engine, "num_stages", 1))
    world = len(facts)
    dp = max(world // max(stages, 1), 1)
    lines = [f"engine {type(engine).__name__}: {stages} stage{'s' if stages != 1 else ''} x {dp} data-parallel "
             f"replica{'s' if dp != 1 else ''} ({world} rank{'s' if world != 1 else ''})"]
    per_stage: Dict[int, str] = {}
    for f in facts:  # each stage's first rank: the stage's data-parallel group shares one configuration
        if f.get("aggregator") is not None:
            per_stage.setdefault(int(f["stage"]), f["aggregator"])
    native = any(f.get("native_reduce") for f in facts)
    mode = next((f.get("reduce_mode") for f in facts if f.get("reduce_mode") not in (None, "engine")), None)
    how = (" (ZeRO / BF16 optimizer: DeepSpeed's own reduction inside its optimizer)" if native else
           f" (on the gradients of DeepSpeed's {mode} optimizer)" if mode else "")
    if len(set(per_stage.values())) == 1:
        lines.append(f"aggregator {next(iter(per_stage.values()))} on every stage's data-parallel group{how}")
    elif per_stage:
        lines.append("aggregator per stage: " + "; ".join(f"stage {s}: {a}" for s, a in sorted(per_stage.items())) + how)
    for line in (_placement_line(engine, cfg), _shares_line(engine, cfg, dp), _policy_line(engine),
                 _init_search_line(engine)):
        if line:
            lines.append(line)
    faults = getattr(cfg, "faults", None)
    if faults is not None and getattr(faults, "byzantine_ranks", None):
        lines.append(f"faults {faults.attack} from ranks {list(faults.byzantine_ranks)}")
    return [PREFIX + line for line in lines]


def log_startup(engine: Any, cfg: Any = None) -> List[str]:
    """Collective (every rank calls it once, at the end of `initialize`): rank 0 logs the summary at INFO
    through pdv_ext's logger (`pdv_ext.log`: visible by default without reading as a warning; the DeepSpeed
    config's `"log_level": "warning"` silences it) and keeps the lines as `engine.pdv_startup_summary`;
    other ranks log nothing and keep []. Returns the lines."""
    cfg = cfg if cfg is not None else engine.pdv_config
    facts = gather_facts(local_facts(engine))
    lines = [] if facts is None else startup_lines(engine, facts, cfg)
    for line in lines:
        logger.info(line[len(PREFIX):])  # the handler's format names the logger: "[pdv_ext] engine ..."
    engine.pdv_startup_summary = lines
    return lines
