"""Latency predictor for collectives, point-to-point and matmul.

Why this shape: a collective's time has two physically different parts.

* **Inside a host** (NVLink / PCIe / shared memory) the achievable bandwidth depends on the local group
  shape (how many devices, which ones, how many groups run at once) in ways a single alpha-beta pair does
  not capture (NCCL uses several rings over a cube-mesh). We keep a measured curve per
  (collective, local group size, stride, concurrent groups) and interpolate it piecewise-linearly in
  log(size) / log(time) - this covers the launch-overhead plateau (the small-message "saturation" part)
  and the bandwidth regime. Unseen shapes fall back to a fitted alpha-beta model with the
  algorithm's byte factor (ring all-reduce moves 2(n-1)/n of the buffer per device, etc.).
* **Across hosts** the host's network link is the bottleneck and is shared by every group that crosses
  it (contention). Bytes crossing one host's link per group, S = buffer bytes as the database counts them:

  ============== ======================= ===========================================================
  collective     bytes on a host's link   why
  ============== ======================= ===========================================================
  all_reduce     2 (N-1)/N * S            hierarchical / tree all-reduce over N hosts (NCCL)
  all_gather     (n-1)/n * S              ring over n devices: one ring edge leaves every host
  reduce_scatter (n-1)/n * S              same ring, reversed
  all_to_all     k (n-k) / n^2 * S        S is the total; k local devices send S/n^2 to each remote one
  p2p            S                        one message
  ============== ======================= ===========================================================

  times the number G of groups crossing the same host link at once, divided by the inter-host
  bandwidth, plus per-step latency. The inter-host link parameters come from the cluster (probe output
  or YAML); when the training data has multi-host meshes they are fitted from it instead.

The model is a JSON-serialisable dict (`fit` -> `save`/`load` -> `predict`).
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
DEFAULT_DB = os.path.join(DATA_DIR, "alpa_prof_database.json")
# The Alpa OSDI'22 cluster: AWS p3.16xlarge, 25 Gbit/s between hosts (Alpa paper, sec. 8). Used only when
# the training data has no multi-host mesh from which the inter-host link could be fitted.
DEFAULT_INTER_HOST = {"bandwidth": 25e9 / 8, "latency": 30e-6}


def ring_factor(coll: str, n: int) -> float:
    """Bytes each device moves per byte of buffer, for the bandwidth-optimal (ring) algorithm."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n ** 2, "p2p": 1.0}.get(coll, 1.0)


def inter_host_bytes(coll: str, n: int, hosts: int, local: int, nbytes: float) -> float:
    """Bytes one group pushes through one host's link (see the module table)."""
    if hosts <= 1:
        return 0.0
    if coll == "all_reduce":
        return 2 * (hosts - 1) / hosts * nbytes
    if coll in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if coll == "all_to_all":
        return local * (n - local) / n ** 2 * nbytes
    return nbytes  # p2p


MIN_ELEMENT_BYTES = 2  # smallest element (f16): a chunk smaller than this is empty


def _chunk_bytes(coll: str, n: int, nbytes: float) -> float:
    """Bytes of the per-peer chunk of one round (the all-reduce buffer is not split below one element)."""
    if coll in ("all_gather", "reduce_scatter"):
        return nbytes / n
    if coll == "all_to_all":
        return nbytes / n ** 2
    return nbytes


def inter_host_steps(coll: str, n: int, hosts: int) -> int:
    """Latency-bound message rounds that cross hosts."""
    if hosts <= 1:
        return 0
    return {"all_reduce": 2 * (hosts - 1), "all_gather": n - 1, "reduce_scatter": n - 1,
            "all_to_all": 1}.get(coll, 1)


# ---------------------------------------------------------------------------------------------------
# Group shapes
# ---------------------------------------------------------------------------------------------------
def group_shape(groups: Sequence[Sequence[int]], per_host: int) -> Dict[str, int]:
    """Describe concurrent replica groups: size n, hosts spanned N, devices per host k, local stride,
    and how many groups share one host (G, the contention on its link and on its local fabric)."""
    g0 = sorted(groups[0])
    n = len(g0)
    hosts0 = sorted({d // per_host for d in g0})
    local = [d for d in g0 if d // per_host == hosts0[0]]
    stride = (local[1] - local[0]) if len(local) > 1 else 0
    share = max(sum(1 for g in groups if any(d // per_host == h for d in g)) for h in hosts0)
    return {"n": n, "hosts": len(hosts0), "local": len(local), "stride": stride, "groups_per_host": share}


def _key(coll: str, local: int, stride: int, share: int) -> str:
    return f"{coll}|{local}|{stride}|{share}"


# ---------------------------------------------------------------------------------------------------
# Database reading
# ---------------------------------------------------------------------------------------------------
def load_db(path: Optional[str] = None) -> Dict[str, Any]:
    with open(path or DEFAULT_DB, encoding="utf-8") as f:
        return json.load(f)


def iter_points(mesh: Dict[str, Any]) -> Iterable[Tuple[str, Dict[str, int], float, float]]:
    """(kind, shape, size_bytes_or_flops, seconds) for every non-null point of a mesh."""
    per_host = int(mesh["mesh_shape"][1])
    for coll, series in mesh.get("collectives", {}).items():
        for s in series:
            shape = group_shape(s["replica_groups"], per_host)
            shape["per_host"] = per_host
            b = DTYPE_BYTES.get(s.get("dtype", "f32"), 4)
            for size, t in s["points"]:
                if t is not None and math.isfinite(t):
                    yield coll, shape, float(size) * b, float(t)
    for s in mesh.get("dot", []):
        for flops, t in s["points"]:
            if t is not None and math.isfinite(t):
                yield "dot:" + s.get("dtype", "f32"), {}, float(flops), float(t)


# ---------------------------------------------------------------------------------------------------
# Curves: piecewise linear in log(size) -> log(time)
# ---------------------------------------------------------------------------------------------------
def _curve(points: List[Tuple[float, float]]) -> Dict[str, List[float]]:
    agg: Dict[float, List[float]] = defaultdict(list)
    for x, t in points:
        agg[x].append(t)
    xs = sorted(agg)
    return {"x": xs, "t": [float(np.median(agg[x])) for x in xs]}


def _interp(curve: Dict[str, List[float]], x: float) -> float:
    xs = np.log2(np.asarray(curve["x"], dtype=float) + 1.0)
    ts = np.log(np.asarray(curve["t"], dtype=float))
    lx = math.log2(x + 1.0)
    if lx <= xs[0]:
        return float(math.exp(ts[0]))
    if lx >= xs[-1]:  # beyond the data: linear in size from the last point (bandwidth regime)
        return float(math.exp(ts[-1]) * (x + 1.0) / (curve["x"][-1] + 1.0))
    return float(math.exp(np.interp(lx, xs, ts)))


def _fit_alpha_beta(points: List[Tuple[float, float]], factor: float) -> Dict[str, float]:
    """t = max(floor, alpha + factor * bytes / bw): floor from the small sizes, (alpha, bw) by least
    squares on relative error over the large sizes."""
    pts = sorted(points)
    floor = float(np.median([t for _, t in pts[: max(1, len(pts) // 4)]]))
    big = [(x, t) for x, t in pts if x > 0 and t > 2 * floor] or pts[-3:]
    x = np.array([factor * b for b, _ in big]) + 1e-9
    t = np.array([t for _, t in big])
    a = np.stack([np.ones_like(x) / t, x / t], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return {"floor": floor, "alpha": max(float(alpha), 0.0), "inv_bw": max(float(inv_bw), 1e-15)}


class Predictor:
    """Collective / p2p / matmul latency. Build with `fit(meshes)` or `load(path)`."""

    def __init__(self, model: Dict[str, Any]):
        self.model = model

    # -- fitting ------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, meshes: Sequence[Dict[str, Any]], inter_host: Optional[Dict[str, float]] = None) -> "Predictor":
        curves: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        by_n: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        dots: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        multi_host: List[Tuple[str, Dict[str, int], float, float]] = []
        for mesh in meshes:
            for kind, shape, x, t in iter_points(mesh):
                if kind.startswith("dot:"):
                    dots[kind[4:]].append((x, t))
                elif shape["hosts"] > 1:
                    multi_host.append((kind, shape, x, t))
                else:
                    curves[_key(kind, shape["n"], shape["stride"], shape["groups_per_host"])].append((x, t))
                    by_n[f"{kind}|{shape['n']}"].append((x, t))
        model: Dict[str, Any] = {
            "version": 1,
            "curves": {k: _curve(v) for k, v in curves.items()},
            "alpha_beta": {k: _fit_alpha_beta(v, ring_factor(k.split("|")[0], int(k.split("|")[1])) or 1.0)
                           for k, v in by_n.items()},
            "dot": {k: _curve(v) for k, v in dots.items()},
            "inter_host": dict(inter_host or DEFAULT_INTER_HOST),
            "inter_host_source": "given" if inter_host else "default (Alpa cluster: 25 Gbit/s)",
        }
        pred = cls(model)
        if multi_host and not inter_host:
            pred._fit_inter_host(multi_host)
        return pred

    def _fit_inter_host(self, pts: List[Tuple[str, Dict[str, int], float, float]]) -> None:
        """Least squares (relative error) of latency and 1/bandwidth on multi-host training points."""
        rows, ys = [], []
        for coll, sh, x, t in pts:
            base = self._intra(coll, sh, x)
            steps = inter_host_steps(coll, sh["n"], sh["hosts"])
            nbytes = sh["groups_per_host"] * inter_host_bytes(coll, sh["n"], sh["hosts"], sh["local"], x)
            if t > 1.5 * base:
                rows.append([steps / t, nbytes / t])
                ys.append(1.0 - base / t)
        if len(rows) >= 2:
            (lat, inv_bw), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
            self.model["inter_host"] = {"latency": max(float(lat), 1e-7), "bandwidth": 1.0 / max(float(inv_bw), 1e-15)}
            self.model["inter_host_source"] = "fitted on multi-host training meshes"

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.model, f)

    @classmethod
    def load(cls, path: str) -> "Predictor":
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    # -- prediction ---------------------------------------------------------------------------------
    def _intra(self, coll: str, shape: Dict[str, int], nbytes: float) -> float:
        """Time of the host-local part: the local sub-group (k devices) with the same stride/concurrency."""
        k = shape.get("local", shape["n"])
        if k <= 1 and shape.get("hosts", 1) > 1:
            k = 1
        curve = self.model["curves"].get(_key(coll, k, shape.get("stride", 1 if k > 1 else 0),
                                              shape.get("groups_per_host", 1)))
        if curve is None:  # nearest measured concurrency for this (collective, size), else alpha-beta
            cands = [(abs(int(key.split("|")[3]) - shape.get("groups_per_host", 1)), key)
                     for key in self.model["curves"] if key.startswith(f"{coll}|{k}|")]
            if cands:
                curve = self.model["curves"][min(cands)[1]]
        if curve is not None:
            return _interp(curve, nbytes)
        ab = self.model["alpha_beta"].get(f"{coll}|{k}")
        if ab is None:  # unseen group size: the largest measured one, bytes scaled by the ring factor
            sizes = [int(key.split("|")[1]) for key in self.model["alpha_beta"] if key.startswith(coll + "|")]
            if not sizes:
                return 0.0
            m = max(sizes)
            ab = self.model["alpha_beta"][f"{coll}|{m}"]
        return max(ab["floor"], ab["alpha"] + (ring_factor(coll, k) or 1.0) * nbytes * ab["inv_bw"])

    def collective(self, coll: str, nbytes: float, shape: Dict[str, int],
                   inter_host: Optional[Dict[str, float]] = None) -> float:
        """Seconds for `coll` on `nbytes` (buffer as the database counts it) over groups of `shape`
        (see `group_shape`; a dict with n, hosts, local, stride, groups_per_host)."""
        if coll == "p2p":
            return self.p2p(nbytes, shape.get("hosts", 1) > 1, inter_host)
        t = self._intra(coll, shape, nbytes)
        if shape.get("hosts", 1) > 1:
            link = inter_host or self.model["inter_host"]
            steps = inter_host_steps(coll, shape["n"], shape["hosts"])
            if _chunk_bytes(coll, shape["n"], nbytes) < MIN_ELEMENT_BYTES:
                steps = 0  # every per-peer chunk is empty: nothing crosses the link
            crossing = shape.get("groups_per_host", 1) * inter_host_bytes(
                coll, shape["n"], shape["hosts"], shape.get("local", 1), nbytes)
            t += steps * link["latency"] + crossing / link["bandwidth"]
        return t

    def p2p(self, nbytes: float, inter: bool, link: Optional[Dict[str, float]] = None,
            intra: Optional[Dict[str, float]] = None) -> float:
        if inter:
            link = link or self.model["inter_host"]
        else:
            link = intra or link or {"latency": 1e-5, "bandwidth": 1e10}
        return link["latency"] + nbytes / link["bandwidth"]

    def matmul(self, flops: float, dtype: str = "f32") -> float:
        curve = self.model["dot"].get(dtype) or next(iter(self.model["dot"].values()), None)
        if curve is None:
            raise ValueError("the predictor was fitted without matmul ('dot') data")
        return _interp(curve, flops)

    def predict_point(self, kind: str, shape: Dict[str, int], x: float) -> float:
        if kind.startswith("dot:"):
            return self.matmul(x, kind[4:])
        return self.collective(kind, x, shape)


# ---------------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------------
def mesh_name(mesh: Dict[str, Any]) -> str:
    return "x".join(str(v) for v in mesh["mesh_shape"])


def split_meshes(db: Dict[str, Any], held_out: Optional[Sequence[str]] = None):
    """(train, test): by default test = the largest mesh (by device count), train = the others."""
    meshes = db["meshes"]
    if held_out is None:
        big = max(meshes, key=lambda m: (m["mesh_shape"][0] * m["mesh_shape"][1], m["mesh_shape"][0]))
        held_out = [mesh_name(big)]
    test = [m for m in meshes if mesh_name(m) in held_out]
    train = [m for m in meshes if mesh_name(m) not in held_out]
    return train, test


def evaluate(pred: Predictor, meshes: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Relative error |pred - true| / true over every non-null point of `meshes`."""
    errs: List[float] = []
    per_kind: Dict[str, List[float]] = defaultdict(list)
    for mesh in meshes:
        for kind, shape, x, t in iter_points(mesh):
            if t <= 0:
                continue
            e = abs(pred.predict_point(kind, shape, x) - t) / t
            errs.append(e)
            tag = kind.split(":")[0] + ("|inter" if shape.get("hosts", 1) > 1 else "")
            per_kind[tag].append(e)
    arr = np.array(errs) if errs else np.array([float("nan")])
    return {"median_rel_error": float(np.median(arr)), "p90_rel_error": float(np.percentile(arr, 90)),
            "points": len(errs),
            "by_kind": {k: {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)), "points": len(v)}
                        for k, v in sorted(per_kind.items())}}
