"""The picture of a plan (`pdv plan --plot`): its training step as the schedule replay sees it.

What is drawn is `placement.simulate.replay` of the plan under its schedule (DeepSpeed's 1F1B, or GPipe's
all-forwards-then-all-backwards order): per device row, every forward and backward pass (coloured by
micro-batch), the device's own send/recv work, the stage's gradient reduction and the device's update; per
link row, every activation and gradient on the wire until it arrives - the gaps in a device row are the
waits for those. The title's predicted step is that replay's step time, so it is where the drawing ends;
the cost model's closed form (what the solver minimises, the `pdv plan` table's number) is given beside
it, as it overlaps link transfers with the devices' work more freely than DeepSpeed's blocking sends do.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .cluster import Cluster
from .plan import Plan
from .profile import Profile
from .simulate import Replay, replay

#: rows beyond which each stage shows only its slowest device's replica (the one whose update ends last)
MAX_DEVICE_ROWS = 16


def replay_plan(plan: Plan, profile: Profile, cluster: Cluster) -> Replay:
    """The plan's step replayed under its own schedule, with every span and message kept."""
    return replay(profile, cluster, plan.boundaries, plan.rank_mapping, plan.micro_batches,
                  aggregator=plan.meta.get("aggregator", "mean"), keep_trace=True, schedule=plan.schedule)


def drawn_replicas(plan: Plan, rep: Replay) -> List[List[int]]:
    """Per stage, the replicas that get a row: all of them on small plans, else the slowest device's."""
    width = len(plan.rank_mapping[0])
    if plan.num_stages * width <= MAX_DEVICE_ROWS:
        return [list(range(width)) for _ in range(plan.num_stages)]
    assert rep.update is not None
    return [[max(range(width), key=lambda r: rep.update[s][r])] for s in range(plan.num_stages)]


def draw(plan: Plan, rep: Replay) -> Tuple[Any, float]:
    """(matplotlib Figure, where the drawing ends in ms). Bars carry a gid naming what they are:
    `F3`/`B3` (forward/backward of micro-batch 3), `io` (send/recv work), `act3`/`grad3` (a message on a
    link), `reduce`, `update`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    assert rep.spans is not None and rep.messages is not None and rep.reduce is not None and rep.update is not None
    ms = 1e3
    S = plan.num_stages
    replicas = drawn_replicas(plan, rep)
    rows: List[Tuple[str, Any]] = []  # (label, ("device", s, r) | ("link", s, r))
    for s in range(S):
        for r in replicas[s]:
            lo, hi = plan.boundaries[s], plan.boundaries[s + 1]
            rows.append((f"stage {s} layers [{lo}, {hi}) dev {plan.rank_mapping[s][r]}", ("device", s, r)))
        if s < S - 1:
            for r in replicas[s]:
                a, b = plan.rank_mapping[s][r], plan.rank_mapping[s + 1][r]
                rows.append((f"link dev {a} <-> {b}", ("link", s, r)))
    fig, ax = plt.subplots(figsize=(13, 0.42 * len(rows) + 2.2))
    cmap = plt.get_cmap("tab10")
    y_of = {what: len(rows) - 1 - i for i, (_, what) in enumerate(rows)}
    end = 0.0

    def bar(y: float, start: float, stop: float, gid: str, height: float = 0.8, **style: Any) -> None:
        nonlocal end
        patch = ax.barh(y, (stop - start) * ms, left=start * ms, height=height, edgecolor="black", linewidth=0.3,
                        **style).patches[0]
        patch.set_gid(gid)
        end = max(end, stop * ms)

    for s in range(S):
        for r in replicas[s]:
            y = y_of[("device", s, r)]
            for name, mb, start, stop in rep.spans[s][r]:
                if stop <= start:
                    continue
                if name == "ForwardPass":
                    bar(y, start, stop, f"F{mb}", color=cmap(mb % 10))
                elif name == "BackwardPass":
                    bar(y, start, stop, f"B{mb}", color=cmap(mb % 10), alpha=0.5)
                else:  # the device's own work on a message (Send*/Recv*)
                    bar(y, start, stop, "io", height=0.35, color="black")
            if rep.reduce[s] > 0:
                bar(y, rep.finish[s], rep.finish[s] + rep.reduce[s], "reduce", color="grey", hatch="//")
            bar(y, rep.reduced, rep.reduced + rep.update[s][r], "update", color="lightgrey", hatch="xx")
    for m in rep.messages:
        s, r = min(m.src[0], m.dst[0]), m.src[1]
        if ("link", s, r) not in y_of:
            continue
        y = y_of[("link", s, r)] + (0.2 if m.kind == "act" else -0.2)
        bar(y, m.wire_start, m.arrives, f"{m.kind}{m.mb}", height=0.38, color=cmap(m.mb % 10),
            alpha=1.0 if m.kind == "act" else 0.5, hatch=">>" if m.kind == "act" else "<<")
    ax.axvline(rep.step_time * ms, color="red", linestyle="--", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows][::-1], fontsize=7)
    ax.set_xlabel("ms since the step's start")
    ax.set_title(f"{plan.solver}: predicted step {rep.step_time * ms:.2f} ms: replay of the {plan.schedule} schedule, "
                 f"{plan.micro_batches} micro-batches\n(cost model's closed form, which the solver minimises: "
                 f"{plan.predicted_step_time * ms:.2f} ms)", fontsize=9)
    legend = [Patch(facecolor=cmap(0), edgecolor="black", label="forward (colour: micro-batch)"),
              Patch(facecolor=cmap(0), alpha=0.5, edgecolor="black", label="backward"),
              Patch(facecolor="black", label="send/recv work"),
              Patch(facecolor=cmap(0), hatch=">>", edgecolor="black", label="activation on the link (until it arrives)"),
              Patch(facecolor=cmap(0), alpha=0.5, hatch="<<", edgecolor="black", label="gradient on the link"),
              Patch(facecolor="grey", hatch="//", edgecolor="black", label="gradient reduction"),
              Patch(facecolor="lightgrey", hatch="xx", edgecolor="black", label="parameter update")]
    ax.legend(handles=legend, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(rows), 1)),
              ncol=4, frameon=False)
    fig.tight_layout()
    return fig, end


def plot_plan(plan: Plan, profile: Profile, cluster: Cluster, path: str) -> Replay:
    """Replay the plan, draw it to `path` (PNG); returns the replay (its `step_time` is the title's)."""
    import matplotlib.pyplot as plt

    rep = replay_plan(plan, profile, cluster)
    fig, _ = draw(plan, rep)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return rep
