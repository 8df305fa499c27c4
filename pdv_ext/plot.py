"""`pdv plot metrics runs/X/metrics.csv --out metrics.png`: loss, batch size, GNS and step time over steps.
`pdv plot adapt build/bench-adapt/<scenario>.json --out adapt.png`: samples/s over time of the static,
adaptive and oracle runs of `pdv bench adapt`, with the events marked.

Reads the Monitor's CSV (any CSV with a `step` column works); panels whose columns are absent or empty
are skipped, so the same command plots a plain loss log or a full adaptive run.
"""
from __future__ import annotations

import argparse
import csv
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: (title, columns drawn in the panel, log scale)
PANELS: Sequence[Tuple[str, Sequence[str], bool]] = (
    ("loss", ("loss", "val_loss"), False),
    ("batch size (samples/step)", ("batch_size",), False),
    ("gradient noise scale", ("gns",), True),
    ("step time (s)", ("step_time", "compute_max", "compute_min"), False),
    ("learning rate", ("lr",), False),
)


def read_columns(path: str) -> Dict[str, List[Tuple[float, float]]]:
    """CSV -> {column: [(step, value), ...]} keeping only numeric, non-empty cells.

    A row with more cells than the header (a hand-edited or concatenated file) is skipped, with one
    warning on stderr naming the file and lines: which column a cell belongs to is unknown there, and a
    plot of shifted values would mislead more than a gap. Short rows just lack the missing cells.
    """
    cols: Dict[str, List[Tuple[float, float]]] = {}
    too_long: List[int] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{path}: no 'step' column (expected the Monitor's metrics.csv)")
        for row in reader:
            if None in row:  # DictReader files the surplus cells under the key None
                too_long.append(reader.line_num)
                continue
            try:
                step = float(row["step"])
            except (TypeError, ValueError):
                continue
            for k, v in row.items():
                if k == "step" or v in (None, ""):
                    continue
                try:
                    cols.setdefault(k, []).append((step, float(v)))
                except ValueError:
                    pass
    if too_long:
        lines = ", ".join(map(str, too_long[:5])) + (", ..." if len(too_long) > 5 else "")
        print(f"pdv plot: {path}: skipped {len(too_long)} row(s) with more fields than the header "
              f"({len(reader.fieldnames)}): line {lines}", file=sys.stderr)
    return cols


def plot_metrics(csv_path: str, out: str, title: Optional[str] = None) -> List[str]:
    """Draw the panels that have data; returns their titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = read_columns(csv_path)
    panels = [(t, [c for c in cs if cols.get(c)], lg) for t, cs, lg in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        raise ValueError(f"{csv_path}: none of the columns {sorted({c for _, cs, _ in PANELS for c in cs})} has data")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, cs, logy) in zip(axes[:, 0], panels):
        for c in cs:
            xs, ys = zip(*cols[c])
            style = "o-" if len(xs) < 40 and c == "val_loss" else "-"
            ax.plot(xs, ys, style, label=c, linewidth=1.2, markersize=3)
        if logy and all(y > 0 for c in cs for _, y in cols[c]):
            ax.set_yscale("log")
        ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
        if len(cs) > 1:
            ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or csv_path, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [p[0] for p in panels]


#: colours of the three runs of `pdv bench adapt`
RUN_STYLE = {"static": ("tab:gray", "static (the start-up choice, no policy)"), "adaptive": ("tab:blue", "adaptive"),
             "oracle": ("tab:green", "oracle (the best static choice in hindsight)")}


def _event_label(e: Dict[str, Any]) -> str:
    if "device" in e:
        return f"{e['device']} x{e['throughput']:g}"
    what = e.get("link") or (f"{e['pair']['a']}-{e['pair']['b']}" if "pair" in e else "event")
    return f"{what} {e.get('bandwidth', 0) * 8 / 1e6:g} Mbit/s"


def _rolling(values: List[float], k: int) -> List[float]:
    """The mean of each value and the up to k - 1 before it."""
    k = max(1, int(k))
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def event_lines(series: Dict[str, Any], kinds: Sequence[str]) -> List[Tuple[str, int, float]]:
    """(run, event index, seconds since that run started) of every event each run met."""
    out = []
    for kind in kinds:
        run = series[kind]
        for n, e in enumerate(run.get("events_log", [])):
            if e.get("applied") and e.get("wall") is not None:
                out.append((kind, int(e.get("index", n)), float(e["wall"]) - float(run["start"])))
    return out


def plot_adapt(result_path: str, out: str, smooth: int = 3) -> List[str]:
    """samples/s over training time for the static, adaptive and oracle runs of `pdv bench adapt` (a rolling
    mean over `smooth` steps), the events as vertical lines in each run's colour (where that run met them:
    an event placed by training step comes later in a slower run), and the adaptive run's decisions as
    markers. Returns the runs drawn."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(result_path, encoding="utf-8") as f:
        res = json.load(f)
    series = res.get("series") or {}
    if not series:
        raise ValueError(f"{result_path}: no per-step series (expected the JSON `pdv bench adapt` writes)")
    fig, ax = plt.subplots(figsize=(10, 4.8))
    drawn = []
    for kind in ("static", "oracle", "adaptive"):
        run = series.get(kind)
        if not run:
            continue
        colour, label = RUN_STYLE[kind]
        t = [end - run["start"] for end in run["ends"]]
        rate = [run["global_batch"] / d for d in run["durations"]]
        smoothed = _rolling(rate, smooth)
        wall = res.get(kind, {}).get("wall_seconds")
        ax.plot(t, smoothed, color=colour, lw=1.6,
                label=f"{label}: {wall:.0f} s" if isinstance(wall, (int, float)) else label)
        drawn.append(kind)
        if kind == "adaptive":
            for d in run.get("decisions", []):
                i = min(max(int(d["step"]) - 1, 0), len(t) - 1)
                ax.plot(t[i], smoothed[i], marker="v", color=colour, ms=8)
                shares = d.get("shares")
                rows = d.get("rank_mapping") or [[]]
                text = (f"re-plan pipe {len(rows)}x{len(rows[0])}: " + "/".join(str(b) for b in d["boundaries"])
                        if d.get("replan") else "equal" if not shares else "/".join(map(str, shares)))
                ax.annotate(text, (t[i], smoothed[i]),
                            textcoords="offset points", xytext=(6, 8), fontsize=8, color=colour, zorder=5,
                            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
    # each run met each event at its own time (events placed by training step arrive later in a slower run):
    # a line per run in its colour where it did, the event named once, at the first of them
    firsts: Dict[int, float] = {}
    for kind, key, x in event_lines(series, drawn):
        ax.axvline(x, color=RUN_STYLE[kind][0], ls="--", lw=1, alpha=0.8)
        firsts[key] = min(x, firsts.get(key, x))
    events = res.get("events", [])
    for key, x in sorted(firsts.items()):
        text = _event_label(events[key]) if isinstance(key, int) and key < len(events) else "event"
        step = next((e.get("applied_step") for e in (series.get(drawn[0]) or {}).get("events_log", [])
                     if e.get("index", None) == key and e.get("applied_step") is not None), None)
        ax.text(x, ax.get_ylim()[1], f" {text}" + (f" (step {step})" if step is not None else ""),
                color="tab:red", va="top", fontsize=9)
    ratio = res.get("adaptive_vs_static")
    title = f"pdv bench adapt: {res.get('scenario', '')}"
    if isinstance(ratio, (int, float)):
        title += f" (adaptive / static wall time {ratio:.2f}"
        if isinstance(res.get("adaptive_vs_oracle"), (int, float)):
            title += f", / oracle {res['adaptive_vs_oracle']:.2f}"
        title += ")"
    ax.set_title(title)
    ax.set_xlabel("seconds since training started")
    ax.set_ylabel(f"samples/s (mean of {max(1, int(smooth))} steps)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


FAULT_STYLE = {"recovered": ("tab:green", "recovered (in-memory snapshots)"),
               "disk_restart": ("tab:orange", "disk restart")}


def plot_faults(result_path: str, out: str, smooth: int = 3) -> List[str]:
    """samples/s over time of `pdv bench faults --out` (a rolling mean over `smooth` steps): each way from its
    first start, the failure as a vertical line, the first step finished after it as a marker with the
    recovery time, and the steps trained twice shaded. Returns the ways drawn."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(result_path, encoding="utf-8") as f:
        res = json.load(f)
    series = res.get("series") or {}
    if not series:
        raise ValueError(f"{result_path}: no per-step series (expected the JSON `pdv bench faults --out` writes)")
    batch = float(res.get("global_batch") or 1)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    drawn = []
    k = max(1, int(smooth))
    for kind, (colour, label) in FAULT_STYLE.items():
        run = series.get(kind)
        if not run or len(run["t"]) < 2:
            continue
        t0, kill = run["start"], run.get("t_kill")
        # a step's rate from its own duration, within one attempt (the gap of a restart is not a step)
        xs: List[float] = []
        ys: List[float] = []
        for attempt in sorted(set(run["attempt"])):  # one line per attempt: no line across a restart
            ts = [t for t, a in zip(run["t"], run["attempt"]) if a == attempt]
            pts = [(b - t0, batch / (b - a)) for a, b in zip(ts, ts[1:]) if b > a]
            if xs and pts:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs += [x for x, _ in pts]
            ys += _rolling([r for _, r in pts], k)
        summary = res.get(kind, {})
        ax.plot(xs, ys, color=colour, lw=1.6, label=f"{label}: {summary.get('wall_s', 0):.0f} s, "
                                                    f"{summary.get('steps_lost', '?')} step(s) lost")
        drawn.append(kind)
        if kill is not None:
            ax.axvline(kill - t0, color=colour, ls="--", lw=1)
            after = [x for x, a in zip(run["t"], run["attempt"]) if x > kill and a == run["attempt"][-1]]
            if after:
                x = after[0] - t0
                ax.axvspan(kill - t0, x, color=colour, alpha=0.12)
                y = next((v for u, v in zip(xs, ys) if u == u and u >= x), 0.0)  # the first point after it
                ax.plot([x], [y], marker="o", color=colour, ms=6)
                ax.annotate(f"first step {x - (kill - t0):.1f} s after the loss", (x, y),
                            textcoords="offset points", xytext=(6, -14), fontsize=8, color=colour)
    title = f"pdv bench faults: {res.get('scenario') or 'host B lost on one machine'}"
    if isinstance(res.get("recovered_vs_disk_restart"), (int, float)):
        title += f" (recovered / disk restart wall time {res['recovered_vs_disk_restart']:.2f})"
    ax.set_title(title)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel(f"samples/s (mean of {k} steps)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)  # from the job's start: the start-up (imports, engine) shows as the blank before the first step
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def plot_batch(result_path: str, out: str) -> List[str]:
    """A batch regime of `pdv bench adaptive --scenario`: each run's held-out loss over its training seconds
    (the target as a line: the first run to cross it wins); below, over the same seconds, the micro-batches
    per replica each run used (a schedule's or the adaptive run's changes), its samples/s between
    evaluations, and the noise scale where a policy measured it (the adaptive run). The middle round of each
    run. With an LR grid for the fixed batches (`fixed_lr`) only each batch's best LR is drawn; a teacher task
    (`task: teacher`) draws its excess loss on a log scale. Returns the runs drawn."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    with open(result_path, encoding="utf-8") as f:
        res = json.load(f)
    traces = res.get("traces") or {}
    if not traces:
        raise ValueError(f"{result_path}: no traces (expected the JSON `pdv bench adaptive --scenario` writes)")
    middle = {label: rounds[len(rounds) // 2] for label, rounds in traces.items() if rounds and rounds[len(rounds) // 2]}
    best_lr = res.get("best_lr_per_batch")
    if best_lr is not None:  # an LR grid: each batch at its best LR (a batch that never reached the target: none)
        keep = {f"fixed-{b}@{v['lr_scale']:g}" for b, v in best_lr.items()}
        middle = {k: v for k, v in middle.items() if not k.startswith("fixed-") or k in keep}
    noisy = any(len(r) > 5 and r[5] is not None for rows in middle.values() for r in rows)
    ratios = [3, 1.2, 1.4] + ([1.2] if noisy else [])
    fig, axes = plt.subplots(len(ratios), 1, figsize=(10, 9 if noisy else 8), sharex=True,
                             gridspec_kw={"height_ratios": ratios})
    ax, bx, sx = axes[:3]
    drawn = []
    for label, rows in middle.items():
        secs = [r[2] for r in rows]
        style = "-" if label.startswith("fixed") else ("--" if label.startswith("schedule") else "-.")
        line, = ax.plot(secs, [r[3] for r in rows], style, label=label, linewidth=1.4)
        color = line.get_color()
        bx.step(secs, [r[4] for r in rows], where="post", color=color, linestyle=style, linewidth=1.2)
        # samples/s between consecutive evaluations (the first from the start)
        prev = [(0, 0.0)] + [(r[1], r[2]) for r in rows[:-1]]
        rate = [(r[1] - p[0]) / (r[2] - p[1]) if r[2] > p[1] else float("nan") for r, p in zip(rows, prev)]
        sx.step(secs, rate, where="pre", color=color, linestyle=style, linewidth=1.0)
        if noisy:
            g = [(r[2], r[5]) for r in rows if len(r) > 5 and r[5] is not None]
            if g:
                axes[3].plot([x for x, _ in g], [y for _, y in g], style, color=color, linewidth=1.2, label=label)
        drawn.append(label)
    ax.axhline(res["target_loss"], color="black", linewidth=0.8, linestyle=":")
    ax.text(0.99, res["target_loss"], f" target {res['target_loss']}", transform=ax.get_yaxis_transform(),
            ha="right", va="bottom", fontsize=8)
    lo = res["target_loss"]
    if res.get("task") == "teacher":  # an excess loss going to zero: orders of magnitude
        ax.set_yscale("log")
        ax.set_ylabel("held-out excess loss (MSE)")
        ax.set_ylim(lo / 3, lo * 300)
    else:
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_ylim(lo - 0.15, lo + 0.9)
    head = f"{res.get('scenario', '')}: time to held-out {res['target_loss']}\n"
    if res.get("best_fixed"):
        head += f"best fixed {res['best_fixed']['micro_batches']} micro-batches {res['best_fixed']['seconds_to_target']:.1f} s"
    if res.get("headroom") is not None:
        head += f"; best schedule {res['schedule_vs_best_fixed']:.2f}x (headroom {res['headroom']:.0%})"
    if res.get("ratio") is not None:
        head += f"; adaptive {res['ratio']:.2f}x"
    ax.set_title(head, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    bx.set_yscale("log", base=2)
    bx.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    bx.yaxis.set_minor_formatter(NullFormatter())
    bx.set_ylabel("micro-batches\nper replica")
    sx.set_ylabel("samples/s")
    sx.set_ylim(bottom=0)
    if noisy:
        axes[3].set_ylabel("noise scale\n(samples)")
        axes[3].set_yscale("log")
        axes[3].yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axes[3].yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
    axes[-1].set_xlabel("training seconds (held-out evaluations not counted)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pdv plot", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("metrics", help="plot a Monitor metrics.csv")
    m.add_argument("csv")
    m.add_argument("--out", default=None, help="PNG path (default: next to the CSV, metrics.png)")
    m.add_argument("--title", default=None)
    ad = sub.add_parser("adapt", help="plot samples/s over time of a `pdv bench adapt` result")
    ad.add_argument("result", help="the JSON `pdv bench adapt` wrote (build/bench-adapt/<scenario>.json)")
    ad.add_argument("--out", default=None, help="PNG path (default: next to the JSON, <scenario>.png)")
    ad.add_argument("--smooth", type=int, default=3, help="rolling mean over this many steps")
    ba = sub.add_parser("batch", help="plot held-out loss and batch over time of a `pdv bench adaptive --scenario` result")
    ba.add_argument("result", help="the JSON `pdv bench adaptive --scenario` wrote (build/bench-adaptive/<scenario>.json)")
    ba.add_argument("--out", default=None, help="PNG path (default: next to the JSON, <scenario>.png)")
    fa = sub.add_parser("faults", help="plot samples/s over time of a `pdv bench faults --out` result")
    fa.add_argument("result", help="the JSON `pdv bench faults --out FILE` wrote")
    fa.add_argument("--out", default=None, help="PNG path (default: next to the JSON, same name .png)")
    fa.add_argument("--smooth", type=int, default=3, help="rolling mean over this many steps")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    import os

    try:
        if a.what == "batch":
            out = a.out or os.path.splitext(os.path.abspath(a.result))[0] + ".png"
            drawn = plot_batch(a.result, out)
        elif a.what in ("adapt", "faults"):
            out = a.out or os.path.splitext(os.path.abspath(a.result))[0] + ".png"
            drawn = (plot_adapt if a.what == "adapt" else plot_faults)(a.result, out, a.smooth)
        else:
            out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.csv)), "metrics.png")
            drawn = plot_metrics(a.csv, out, a.title)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pdv plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(drawn)})")
    return 0
