"""Latency predictor: held-out error on the shared Alpa data, recovery of a known inter-host link, and the
profiler effects (element granularity, bandwidth-monotone database) it models."""
import json
import math

import pytest

from pdv_ext.placement import predictor as P
from pdv_ext.placement.cli import predict_main


@pytest.fixture(scope="module")
def held_out():
    db = P.load_db()
    train, test = P.split_meshes(db, ["2x8"])  # the one-host meshes, tested on the two-host one
    return P.Predictor.fit(train), train, test


def test_split_holds_out_only_what_is_asked():
    db = P.load_db()
    train, test = P.split_meshes(db)  # the default: every mesh is fitted on, nothing held out
    assert [P.mesh_name(m) for m in train] == [P.mesh_name(m) for m in db["meshes"]] and test == []
    assert P.largest_mesh(db) == "2x8"
    train, test = P.split_meshes(db, [])  # `--hold-out` with no name: the largest mesh
    assert [P.mesh_name(m) for m in test] == ["2x8"]
    assert all(m["mesh_shape"][0] * m["mesh_shape"][1] < 16 for m in train)


def test_held_out_error_on_larger_mesh(held_out):
    pred, _, test = held_out
    res = P.evaluate(pred, test)
    # every non-null point of the held-out mesh, matmul included
    assert res["points"] == sum(1 for m in test for kind in ("collectives", "dot")
                                for series in (m[kind].values() if kind == "collectives" else [m[kind]])
                                for s in series for _, t in s["points"] if t is not None and math.isfinite(t))
    # host-local groups of the unseen mesh: the measured curves transfer
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert res["by_kind"][kind]["median"] < 0.05
    # inter-host groups use the a-priori link (25 Gbit/s, 30 us): measured medians 0.19-0.26, all-reduce 0.43
    for kind in ("all_gather|inter", "reduce_scatter|inter", "all_to_all|inter"):
        assert res["by_kind"][kind]["median"] < 0.3
    assert res["by_kind"]["all_reduce|inter"]["median"] < 0.5
    assert res["median_rel_error"] < 0.04 and res["p90_rel_error"] < 0.45  # measured 0.033 / 0.40


def test_inter_host_link_fitted_from_multi_host_data(held_out):
    """Synthetic multi-host measurements made with a known link are fitted back."""
    pred, _, _ = held_out
    link = {"bandwidth": 2e9, "latency": 5e-5}
    groups = [[0, 8], [1, 9]]
    shape = P.group_shape(groups, 8)
    points = [[2 ** k, pred.collective("all_reduce", 4 * 2 ** k, shape, inter_host=link)] for k in range(10, 28, 2)]
    mesh = {"mesh_shape": [2, 8], "collectives": {"all_reduce": [
        {"replica_groups": groups, "dtype": "f32", "points": points}]}, "dot": []}
    fitted = P.Predictor.fit(P.split_meshes(P.load_db(), ["2x8"])[0] + [mesh])
    assert fitted.model["inter_host_source"].startswith("fitted")
    assert fitted.model["inter_host"]["bandwidth"] == pytest.approx(2e9, rel=0.05)


def test_contention_and_byte_factors(held_out):
    pred, _, _ = held_out
    one = P.group_shape([[0, 8]], 8)
    eight = P.group_shape([[i, i + 8] for i in range(8)], 8)
    assert eight["groups_per_host"] == 8 and one["groups_per_host"] == 1
    big = 4 * 2 ** 28
    assert pred.collective("all_gather", big, eight) > 4 * pred.collective("all_gather", big, one)
    assert P.ring_factor("all_reduce", 4) == pytest.approx(1.5)
    assert pred.p2p(1e6, True) > pred.p2p(1e6, False)


def test_empty_collectives_are_counted_in_elements(held_out):
    """Alpa skips an all-gather whose per-device piece has no whole element: 4 bytes is one f32 element
    (empty for 2 devices) but two f16 elements (not empty)."""
    pred, _, _ = held_out
    pair = P.group_shape([[0, 8]], 8)
    f32, f16 = dict(pair, elem_bytes=4), dict(pair, elem_bytes=2)
    assert P.is_empty("all_gather", 2, 1) and not P.is_empty("all_gather", 2, 2)
    assert P.is_empty("all_to_all", 4, 15) and not P.is_empty("all_to_all", 4, 16)
    assert pred.collective("all_gather", 4, f32) == pred.model["empty_op"]
    assert pred.collective("all_gather", 4, f16) > 3 * pred.model["empty_op"]


def test_make_monotonic_is_undone_and_reapplied():
    """Raw times (empty loop below 8 elements, then latency + bandwidth) stored the way Alpa stores them:
    fitting recovers the raw curve and `as_profiled` reproduces the stored, monotone values."""
    n, elem = 8, 4
    raw = {s: (1.75e-5 if s < n else 2e-4 + s * elem / 1e11) for s in [2 ** i for i in range(31)]}
    best, stored = 0.0, []
    for s in sorted(raw):
        best = max(best, s / raw[s])
        stored.append([s, s / best])
    assert stored[3] == [8, pytest.approx(2 * raw[4])]  # the doubling ramp of tiny sizes
    points, empty = P.raw_points("all_gather", n, stored)
    assert len(empty) == 3 and all(t == pytest.approx(raw[s]) for s, t in points)
    mesh = {"mesh_shape": [1, 8], "collectives": {"all_gather": [
        {"replica_groups": [list(range(8))], "dtype": "f32", "points": stored}]}, "dot": []}
    pred = P.Predictor.fit([mesh])
    shape = dict(P.group_shape([list(range(8))], 8), elem_bytes=elem)
    for s, t in stored:
        assert pred.predict_point("all_gather", shape, s * elem) == pytest.approx(t, rel=0.02)
    assert pred.collective("all_gather", 16 * elem, shape) == pytest.approx(raw[16], rel=0.02)


def test_multi_host_critical_path():
    # 16-device ring over 2 hosts x 8: 8 steps beyond the local 7, two of them cross the hosts
    assert P.extra_steps("all_gather", 16, 2, 8) == (8, 2)
    assert P.extra_steps("reduce_scatter", 2, 2, 1) == (1, 1)  # one device per host: every step crosses
    assert P.extra_steps("all_to_all", 16, 2, 8) == (8, 8)  # one exchange per remote peer
    assert P.extra_steps("all_reduce", 16, 2, 8) == (2, 2)  # tree across hosts: up and down
    assert P.extra_steps("all_gather", 8, 1, 8) == (0, 0)


def test_latency_is_not_shared_between_concurrent_groups(held_out):
    """Eight pairs crossing the link at once share its bandwidth (tested above) but not its latency."""
    pred, _, _ = held_out
    one = dict(P.group_shape([[0, 8]], 8), elem_bytes=2)
    eight = dict(P.group_shape([[i, i + 8] for i in range(8)], 8), elem_bytes=2)
    small = 2 * 64
    assert pred.collective("all_gather", small, eight) < 1.3 * pred.collective("all_gather", small, one)


def test_cli_fit_eval_held_out(tmp_path, capsys):
    model = tmp_path / "m.json"
    assert predict_main(["fit", "--hold-out", "-o", str(model)]) == 0  # no name: the largest mesh
    saved = json.load(open(model))
    assert saved["trained_on"] == ["1x8", "1x4", "1x2", "1x1"] and saved["held_out"] == ["2x8"]
    assert "held out: 2x8;" in capsys.readouterr().out
    assert predict_main(["eval", "--model", str(model), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"median_rel_error", "p90_rel_error", "points"} <= set(res) and res["meshes"] == ["2x8"]
    assert res["in_sample"] is False and res["evaluated_on"] == "held-out meshes"
    assert predict_main(["eval", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("held-out meshes: 2x8") and "in-sample" not in out
    assert predict_main(["fit", "--hold-out", "2x8", "1x1", "-o", str(model)]) == 0
    assert json.load(open(model))["held_out"] == ["2x8", "1x1"]  # in the database's order


def test_cli_fit_uses_every_mesh_by_default_and_eval_says_in_sample(tmp_path, capsys):
    """A user fitting "on my data" keeps all of it; `eval` then reports an in-sample figure and says so."""
    model = tmp_path / "m.json"
    assert predict_main(["fit", "-o", str(model)]) == 0
    saved = json.load(open(model))
    assert saved["trained_on"] == ["2x8", "1x8", "1x4", "1x2", "1x1"] and saved["held_out"] == []
    assert "held out: none (every mesh" in capsys.readouterr().out
    assert predict_main(["eval", "--model", str(model), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["in_sample"] is True and res["meshes"] == saved["trained_on"]
    assert res["evaluated_on"].startswith("every mesh, in-sample")
    assert predict_main(["eval", "--model", str(model)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("in-sample: the model was fitted on every mesh") and "--hold-out" in out
    assert predict_main(["fit", "--all", "-o", str(model)]) == 0  # the old spelling of the default
    assert json.load(open(model))["held_out"] == []
    assert predict_main(["fit", "--all", "--hold-out", "2x8", "-o", str(model)]) == 2
    assert "contradict" in capsys.readouterr().err
