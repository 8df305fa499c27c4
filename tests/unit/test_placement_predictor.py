"""Latency predictor: held-out error on the shared Alpa data, and recovery of a known inter-host link."""
import json

import pytest

from pdv_ext.placement import predictor as P
from pdv_ext.placement.cli import predict_main


@pytest.fixture(scope="module")
def held_out():
    db = P.load_db()
    train, test = P.split_meshes(db)
    return P.Predictor.fit(train), train, test


def test_split_holds_out_the_largest_mesh(held_out):
    _, train, test = held_out
    assert [P.mesh_name(m) for m in test] == ["2x8"]
    assert all(m["mesh_shape"][0] * m["mesh_shape"][1] < 16 for m in train)


def test_held_out_error_on_larger_mesh(held_out):
    pred, _, test = held_out
    res = P.evaluate(pred, test)
    assert res["points"] > 2000
    # host-local groups of the unseen mesh: the measured curves transfer
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert res["by_kind"][kind]["median"] < 0.05
    # inter-host groups come from the a-priori link (25 Gbit/s): within a factor of two at the median
    for kind in ("all_reduce|inter", "all_gather|inter"):
        assert res["by_kind"][kind]["median"] < 0.5
    assert res["median_rel_error"] < 0.1


def test_inter_host_link_fitted_from_multi_host_data(held_out):
    """Synthetic multi-host measurements made with a known link are fitted back."""
    pred, _, _ = held_out
    link = {"bandwidth": 2e9, "latency": 5e-5}
    groups = [[0, 8], [1, 9]]
    shape = P.group_shape(groups, 8)
    points = [[2 ** k, pred.collective("all_reduce", 4 * 2 ** k, shape, inter_host=link)] for k in range(10, 28, 2)]
    mesh = {"mesh_shape": [2, 8], "collectives": {"all_reduce": [
        {"replica_groups": groups, "dtype": "f32", "points": points}]}, "dot": []}
    fitted = P.Predictor.fit(P.split_meshes(P.load_db())[0] + [mesh])
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


def test_cli_fit_eval(tmp_path, capsys):
    model = tmp_path / "m.json"
    assert predict_main(["fit", "-o", str(model)]) == 0
    assert json.load(open(model))["trained_on"] == ["1x8", "1x4", "1x2", "1x1"]
    capsys.readouterr()
    assert predict_main(["eval", "--model", str(model), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"median_rel_error", "p90_rel_error", "points"} <= set(res) and res["meshes"] == ["2x8"]
    assert predict_main(["fit", "--all", "-o", str(model)]) == 0
    assert predict_main(["eval", "--model", str(model)]) == 2  # nothing held out
