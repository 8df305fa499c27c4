"""Latency predictor for collectives, point-to-point and matmul.

Why this shape: a collective's time has physically different parts.

* **Inside a host** (NVLink / PCIe) the achievable bandwidth depends on the local group shape (how many
  devices, which ones, how many groups run at once) in ways a single alpha-beta pair does not capture
  (NCCL uses several rings over a cube-mesh). We keep a measured curve per
  (collective, local group size, stride, concurrent groups) and interpolate it piecewise-linearly in
  log(size) / log(time): the small-message plateau (per-step software latency) and the bandwidth regime.
  Unseen shapes fall back to a fitted alpha-beta model with the algorithm's byte factor.
* **Steps.** NCCL's algorithms are chains of steps: a ring all-gather / reduce-scatter over n devices has
  n-1 steps on its critical path, all-to-all exchanges with its n-1 peers one after another, a multi-host
  all-reduce is a local reduce, a tree across the hosts (up and down) and a local broadcast. A group that
  spans hosts has more steps than its local part; each costs what a step costs inside a host (the
  single-host plateau per group size, fitted), and a step that crosses hosts also pays the link latency.
* **Across hosts** the host's network link is shared by every group that crosses it. Bytes crossing one
  host's link per group, S = buffer bytes as the database counts them:

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
  bandwidth. Latency is not shared: concurrent groups wait for their messages in parallel. The link
  parameters come from the cluster (probe output or YAML); when the training data has multi-host meshes
  they are fitted from it instead.
* **Element granularity.** Alpa's profiler splits the buffer into whole elements: an all-gather /
  reduce-scatter with fewer elements than devices (all-to-all: fewer than n^2) runs no collective at all
  and costs only the empty loop iteration - decided in elements, so f16 and f32 differ.
* **The database is bandwidth-monotone.** Alpa stores `size / max_{s' <= s} (s' / t(s'))` over the
  profiled power-of-two sizes (`MeshProfilingResult.make_monotonic`); that is why tiny messages show
  times doubling per size step from the empty-loop time. Fitting undoes it (clipped points are dropped, so
  curves hold raw times); `as_profiled` re-applies it so predictions are compared like for like.

The model is a JSON-serialisable dict (`fit` -> `save`/`load` -> `predict`).
"""
from __future__ import annotations

import bisect
import json
import math
import os
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..registry import did_you_mean

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
DEFAULT_DB = os.path.join(DATA_DIR, "alpa_prof_database.json")
# The Alpa OSDI'22 cluster: AWS p3.16xlarge, 25 Gbit/s between hosts (Alpa paper, sec. 8), TCP sockets
# (no GPUDirect RDMA). Latency: one TCP message through the host's network stack, ~30 us on top of a
# host-local NCCL step (nccl-tests over TCP between two V100 hosts: ~40 us for an 8-byte broadcast, of
# which ~10 us is the NCCL step itself). Used only when the training data has no multi-host mesh.
DEFAULT_INTER_HOST = {"bandwidth": 25e9 / 8, "latency": 30e-6}
MIN_ELEMENT_BYTES = 2  # element size assumed when a shape does not say (f16)
MODEL_KEYS = ("curves", "alpha_beta", "steps", "dot", "inter_host")  # what `Predictor.load` requires


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


def extra_steps(coll: str, n: int, hosts: int, local: int) -> Tuple[int, int]:
    """(steps beyond the local group's own, how many of them cross hosts) on the critical path.

    Ring (all-gather / reduce-scatter): n-1 steps instead of local-1; of the ring's n edges one leaves
    each host, and the n-1 consecutive steps a chunk travels miss only one edge - a host-local one unless
    every device is alone on its host. All-to-all: one exchange per remote peer. All-reduce: a tree
    across the hosts, up then down."""
    if hosts <= 1:
        return 0, 0
    if coll == "all_reduce":
        tree = 2 * math.ceil(math.log2(hosts))
        return tree, tree
    if coll in ("all_gather", "reduce_scatter"):
        return n - local, hosts if local >= 2 else hosts - 1
    if coll == "all_to_all":
        return n - local, n - local
    return 1, 1  # p2p


def is_empty(coll: str, n: int, elements: float) -> bool:
    """Alpa's profiler skips the collective when a device's piece has no whole element."""
    if coll in ("all_gather", "reduce_scatter"):
        return elements < n
    if coll == "all_to_all":
        return elements < n * n
    return False  # all-reduce runs even on zero elements


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
        db = json.load(f)
    check_db(db)
    return db


def check_db(db: Any) -> None:
    """Fail on anything but a profiling database (`{}`, a list, a layer profile, a model) with what is
    expected, instead of a KeyError or an empty max() later."""
    expected = ("expected a profiling database {'meshes': [{'mesh_shape': [hosts, devices_per_host], "
                "'collectives': {...}, 'dot': [...]}, ...]} like pdv_ext/data/alpa_prof_database.json")
    meshes = db.get("meshes") if isinstance(db, dict) else None
    if not isinstance(meshes, list) or not meshes:
        raise ValueError(f"no non-empty 'meshes' list; {expected}")
    for i, m in enumerate(meshes):
        shape = m.get("mesh_shape") if isinstance(m, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape)):
            raise ValueError(f"meshes[{i}].mesh_shape: must be [hosts, devices_per_host], positive integers; "
                             f"{expected}")
        if not isinstance(m.get("collectives", {}), dict) or not isinstance(m.get("dot", []), list):
            raise ValueError(f"meshes[{i}]: 'collectives' must be a mapping and 'dot' a list; {expected}")


def iter_points(mesh: Dict[str, Any]) -> Iterable[Tuple[str, Dict[str, int], float, float]]:
    """(kind, shape, size_bytes_or_flops, seconds) for every non-null point of a mesh; collective shapes
    carry `elem_bytes` (the dtype's element size)."""
    per_host = int(mesh["mesh_shape"][1])
    for coll, series in mesh.get("collectives", {}).items():
        for s in series:
            shape = group_shape(s["replica_groups"], per_host)
            shape["per_host"] = per_host
            shape["elem_bytes"] = b = DTYPE_BYTES.get(s.get("dtype", "f32"), 4)
            for size, t in s["points"]:
                if t is not None and math.isfinite(t):
                    yield coll, shape, float(size) * b, float(t)
    for s in mesh.get("dot", []):
        for flops, t in s["points"]:
            if t is not None and math.isfinite(t):
                yield "dot:" + s.get("dtype", "f32"), {}, float(flops), float(t)


def raw_points(coll: str, n: int, points: Sequence[Sequence[Any]]) -> Tuple[List[Tuple[float, float]], List[float]]:
    """Split one profiled series (sizes in elements) into (raw non-empty points, empty-loop times).

    A point whose bandwidth equals the running maximum of the smaller sizes was rewritten by Alpa's
    make_monotonic: its raw time is unknown, so it is dropped (size 0 is never rewritten)."""
    raw, empty, best = [], [], 0.0
    for size, t in sorted((p for p in points if p[1] is not None and math.isfinite(p[1])), key=lambda p: p[0]):
        clipped = size > 0 and size / t <= best * (1 + 1e-9)
        best = max(best, size / t)
        if is_empty(coll, n, size):
            empty.append(t)
        elif not clipped:
            raw.append((float(size), float(t)))
    return raw, empty


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
    """Log-log interpolation; flat below the first point (latency plateau), linear in size beyond the last."""
    xs, ts = curve["x"], curve["t"]
    if x <= xs[0]:
        return ts[0]
    if x >= xs[-1]:  # beyond the data: bandwidth regime
        return ts[-1] * (x + 1.0) / (xs[-1] + 1.0)
    i = bisect.bisect_right(xs, x)
    x0, x1 = math.log2(xs[i - 1] + 1.0), math.log2(xs[i] + 1.0)
    w = (math.log2(x + 1.0) - x0) / (x1 - x0)
    return math.exp((1 - w) * math.log(ts[i - 1]) + w * math.log(ts[i]))


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


def _step_curve(plateaus: Dict[int, List[float]]) -> Dict[str, List[float]]:
    """Small-message time per group size on one host (the software cost of its steps)."""
    ns = sorted(plateaus)
    return {"n": ns, "t": [float(np.median(plateaus[n])) for n in ns]}


def _step_latency(curve: Dict[str, List[float]], n: float) -> float:
    """Piecewise linear in group size; beyond the largest measured size, the least-squares slope over
    sizes >= 2 (every further step costs about the same)."""
    ns, ts = curve["n"], curve["t"]
    if n <= ns[-1]:
        return float(np.interp(n, ns, ts))
    big = [(m, t) for m, t in zip(ns, ts) if m >= 2]
    slope = float(np.polyfit([m for m, _ in big], [t for _, t in big], 1)[0]) if len(big) >= 2 else 0.0
    return ts[-1] + max(slope, 0.0) * (n - ns[-1])


class Predictor:
    """Collective / p2p / matmul latency. Build with `fit(meshes)` or `load(path)`."""

    def __init__(self, model: Dict[str, Any]):
        self.model = model

    # -- fitting ------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, meshes: Sequence[Dict[str, Any]], inter_host: Optional[Dict[str, float]] = None) -> "Predictor":
        curves: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        by_n: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        plateaus: Dict[str, Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
        empty: List[float] = []
        dots: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        multi_host: List[Tuple[str, Dict[str, int], float, float]] = []
        for mesh in meshes:
            for coll, series in mesh.get("collectives", {}).items():
                for s in series:
                    shape = group_shape(s["replica_groups"], int(mesh["mesh_shape"][1]))
                    shape["elem_bytes"] = b = DTYPE_BYTES.get(s.get("dtype", "f32"), 4)
                    raw, emp = raw_points(coll, shape["n"], s["points"])
                    empty += emp
                    pts = [(size * b, t) for size, t in raw]
                    if shape["hosts"] > 1:
                        multi_host += [(coll, shape, x, t) for x, t in pts]
                        continue
                    curves[_key(coll, shape["n"], shape["stride"], shape["groups_per_host"])] += pts
                    by_n[f"{coll}|{shape['n']}"] += pts
                    small = [t for x, t in pts if x > 0][:3]
                    if small:
                        plateaus[coll][shape["n"]].append(float(np.median(small)))
            for s in mesh.get("dot", []):
                dots[s.get("dtype", "f32")] += [(x, t) for x, t in s["points"] if t is not None and math.isfinite(t)]
        model: Dict[str, Any] = {
            "version": 2,
            "curves": {k: _curve(v) for k, v in curves.items()},
            "alpha_beta": {k: _fit_alpha_beta(v, ring_factor(k.split("|")[0], int(k.split("|")[1])) or 1.0)
                           for k, v in by_n.items()},
            "steps": {k: _step_curve(v) for k, v in plateaus.items()},
            "empty_op": float(np.median(empty)) if empty else 0.0,
            "dot": {k: _curve(v) for k, v in dots.items()},
            "inter_host": dict(inter_host or DEFAULT_INTER_HOST),
            "inter_host_source": "given" if inter_host else "default (Alpa cluster: 25 Gbit/s, TCP)",
        }
        pred = cls(model)
        if multi_host and not inter_host:
            pred._fit_inter_host(multi_host)
        return pred

    def _fit_inter_host(self, pts: List[Tuple[str, Dict[str, int], float, float]]) -> None:
        """Least squares (relative error) of latency and 1/bandwidth on multi-host training points."""
        rows, ys = [], []
        for coll, sh, x, t in pts:
            base = self._intra(coll, sh, x) + self._step_time(coll, sh)
            crossing = extra_steps(coll, sh["n"], sh["hosts"], sh["local"])[1]
            nbytes = sh["groups_per_host"] * inter_host_bytes(coll, sh["n"], sh["hosts"], sh["local"], x)
            if x > 0 and t > 1.5 * base:
                rows.append([crossing / t, nbytes / t])
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
        """A model written by `save`; anything else (a profile, a database, `{}`) is a ValueError saying so."""
        with open(path, encoding="utf-8") as f:
            model = json.load(f)
        bad = [k for k in MODEL_KEYS if not isinstance(model, dict) or not isinstance(model.get(k), dict)]
        if bad:
            raise ValueError(f"not a predictor model written by `pdv predict fit` ({', '.join(bad)} missing or "
                             "not a mapping)")
        if not model["alpha_beta"]:
            raise ValueError("the model has no fitted collectives (fitted on a database without any?)")
        bw, lat = model["inter_host"].get("bandwidth"), model["inter_host"].get("latency")
        if not (isinstance(bw, (int, float)) and isinstance(lat, (int, float)) and 0 < bw < math.inf
                and 0 <= lat < math.inf):
            raise ValueError(f"inter_host: needs a finite bandwidth > 0 and latency >= 0 (got {model['inter_host']!r})")
        return cls(model)

    # -- prediction ---------------------------------------------------------------------------------
    def _intra(self, coll: str, shape: Dict[str, int], nbytes: float) -> float:
        """Time of the host-local part: the local sub-group (k devices) with the same stride/concurrency."""
        k = shape.get("local", shape["n"])
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
            ab = self.model["alpha_beta"][f"{coll}|{max(sizes)}"]
        return max(ab["floor"], ab["alpha"] + (ring_factor(coll, k) or 1.0) * nbytes * ab["inv_bw"])

    def _step_time(self, coll: str, shape: Dict[str, int]) -> float:
        """Software time of the steps a multi-host group has beyond its local part (see `extra_steps`)."""
        curve = self.model.get("steps", {}).get(coll)
        k = shape.get("local", shape["n"])
        extra = extra_steps(coll, shape["n"], shape.get("hosts", 1), k)[0]
        if curve is None or extra == 0:
            return 0.0
        return max(_step_latency(curve, k + extra) - _step_latency(curve, k), 0.0)

    def collective(self, coll: str, nbytes: float, shape: Dict[str, int],
                   inter_host: Optional[Dict[str, float]] = None) -> float:
        """Seconds for `coll` on `nbytes` (buffer as the database counts it) over groups of `shape`
        (see `group_shape`; a dict with n, hosts, local, stride, groups_per_host, optional elem_bytes)."""
        if coll == "p2p":
            return self.p2p(nbytes, shape.get("hosts", 1) > 1, inter_host)
        n, hosts, k = shape["n"], shape.get("hosts", 1), shape.get("local", shape["n"])
        if is_empty(coll, n, nbytes / shape.get("elem_bytes", MIN_ELEMENT_BYTES)):
            return self.model.get("empty_op", 0.0)
        t = self._intra(coll, shape, nbytes)
        if hosts > 1 and nbytes > 0:
            link = inter_host or self.model["inter_host"]
            crossing = extra_steps(coll, n, hosts, k)[1]
            t += self._step_time(coll, shape) + crossing * link["latency"]
            t += shape.get("groups_per_host", 1) * inter_host_bytes(coll, n, hosts, k, nbytes) / link["bandwidth"]
        return t

    def as_profiled(self, coll: str, nbytes: float, shape: Dict[str, int]) -> float:
        """`collective` as Alpa's database records it: bandwidth made monotone over the power-of-two
        element counts up to this size (make_monotonic)."""
        elem = shape.get("elem_bytes", MIN_ELEMENT_BYTES)
        count = nbytes / elem
        if count < 1:
            return self.collective(coll, nbytes, shape)
        sizes = [2.0 ** i for i in range(int(math.log2(count)) + 1)]
        if sizes[-1] < count:
            sizes.append(count)
        best = max(s / self.collective(coll, s * elem, shape) for s in sizes)
        return count / best

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
        """A database point: matmul, or a collective as profiled (see `as_profiled`)."""
        if kind.startswith("dot:"):
            return self.matmul(x, kind[4:])
        return self.as_profiled(kind, x, shape)


# ---------------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------------
def mesh_name(mesh: Dict[str, Any]) -> str:
    return "x".join(str(v) for v in mesh["mesh_shape"])


def largest_mesh(db: Dict[str, Any]) -> str:
    """The name of the database's largest mesh (by device count, then host count)."""
    big = max(db["meshes"], key=lambda m: (m["mesh_shape"][0] * m["mesh_shape"][1], m["mesh_shape"][0]))
    return mesh_name(big)


def split_meshes(db: Dict[str, Any], held_out: Optional[Sequence[str]] = None):
    """(train, test): the meshes named in `held_out` are the test set, the others the training set.

    `held_out=None` holds nothing out (train = every mesh, test = []): a user fitting on their own data
    keeps all of it, its largest mesh included. An empty list means the largest mesh (`largest_mesh`),
    what `pdv predict fit --hold-out` with no name does."""
    meshes = db["meshes"]
    if held_out is None:
        return list(meshes), []
    held_out = list(held_out) or [largest_mesh(db)]
    names = [mesh_name(m) for m in meshes]
    for h in held_out:
        if h not in names:
            raise ValueError(f"unknown held-out mesh '{h}'{did_you_mean(h, names)}; the database has "
                             f"{', '.join(names)}")
    test = [m for m in meshes if mesh_name(m) in held_out]
    train = [m for m in meshes if mesh_name(m) not in held_out]
    if not train:
        raise ValueError(f"every mesh ({', '.join(names)}) is held out: nothing left to fit on")
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
