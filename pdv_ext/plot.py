"""`pdv plot metrics runs/X/metrics.csv --out metrics.png`: loss, batch size, GNS and step time over steps.

Reads the Monitor's CSV (any CSV with a `step` column works); panels whose columns are absent or empty
are skipped, so the same command plots a plain loss log or a full adaptive run.
"""
from __future__ import annotations

import argparse
import csv
import sys
from typing import Dict, List, Optional, Sequence, Tuple

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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="pdv plot", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("metrics", help="plot a Monitor metrics.csv")
    m.add_argument("csv")
    m.add_argument("--out", default=None, help="PNG path (default: next to the CSV, metrics.png)")
    m.add_argument("--title", default=None)
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    import os

    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.csv)), "metrics.png")
    try:
        drawn = plot_metrics(a.csv, out, a.title)
    except (OSError, ValueError) as exc:
        print(f"pdv plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(drawn)})")
    return 0
