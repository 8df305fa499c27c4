"""Unit tests of the parallel random-initialization search (single process, LocalComm)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pdv_ext.comm import LocalComm
from pdv_ext.config import ConfigError, validate_pdv
from pdv_ext.init_search import Candidate, _Builder, _draw, _state, apply_scheme, search_init, select
from pdv_ext.init_search_config import InitSearchConfig


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def batches(seed: int = 0, n: int = 16):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(8, 3, generator=g)
    while True:
        x = torch.randn(n, 8, generator=g)
        yield x, (x @ teacher).argmax(-1)


CFG = {"candidates": 4, "rounds": 3, "probe_steps": 3, "keep_fraction": 0.5, "spread": 0.4, "shrink": 0.5}


def test_select_keeps_best_fraction_in_a_fixed_order():
    mk = lambda i, s: {"candidate": Candidate(f"c{i}", "default", 1.0, i, 0, 0), "score": s}
    entries = [mk(0, 3.0), mk(1, float("inf")), mk(2, 1.0), mk(3, 1.0), mk(4, 2.0)]
    kept = select(entries, 3)
    assert [e["candidate"].id for e in kept] == ["c2", "c3", "c4"]  # tie broken by id, inf last
    assert [e["candidate"].id for e in select(list(reversed(entries)), 3)] == ["c2", "c3", "c4"]
    assert len(select(entries, 0)) == 1  # always a winner


def test_round_zero_covers_schemes_and_scales_and_includes_model_as_given():
    cfg = InitSearchConfig(candidates=3, schemes=["default", "xavier"], scales=[1.0, 0.5])
    drawn = _draw(cfg, 0, 0, [], 0.0) + _draw(cfg, 0, 1, [], 0.0)
    assert drawn[0].seed is None and drawn[0].scheme == "default"  # the baseline
    assert {(c.scheme, c.scale) for c in drawn} == {("default", 1.0), ("xavier", 1.0), ("default", 0.5),
                                                     ("xavier", 0.5)}
    assert len({c.id for c in drawn}) == len(drawn)
    assert len({c.seed for c in drawn}) == len(drawn)  # every draw has its own seed


def test_children_spread_shrinks_with_rounds():
    model = tiny_model()
    builder = _Builder(model, _state(model))
    cfg = InitSearchConfig(candidates=6, spread=0.4, shrink=0.5)
    parent = _draw(cfg, 0, 0, [], 0.0)[1]
    dist = []
    for rnd, spread in [(1, 0.4), (2, 0.2), (3, 0.1)]:
        kids = _draw(cfg, rnd, 0, [parent], spread)
        assert all(k.parent is parent and k.spread == spread for k in kids)
        p = builder.state(parent)["0.weight"]
        d = [float((builder.state(k)["0.weight"] - p).norm() / p.norm()) for k in kids]
        dist.append(sum(d) / len(d))
    assert dist[0] > dist[1] > dist[2] > 0
    assert dist[0] == pytest.approx(0.4, rel=0.3)  # relative noise of about `spread`


def test_schemes_are_seeded_and_scaled():
    a, b = tiny_model(1), tiny_model(2)
    apply_scheme(a, "kaiming", seed=5, scale=0.5)
    apply_scheme(b, "kaiming", seed=5, scale=0.5)
    assert torch.equal(a[0].weight, b[0].weight) and float(a[0].bias.detach().abs().sum()) == 0.0
    c = tiny_model(1)
    apply_scheme(c, "kaiming", seed=5, scale=1.0)
    assert torch.allclose(c[0].weight * 0.5, a[0].weight)
    with pytest.raises(ValueError):
        apply_scheme(c, "nope", seed=1)


def test_standalone_search_is_deterministic_and_loads_the_winner():
    m1 = tiny_model()
    rng_before = torch.get_rng_state()
    r1 = search_init(m1, nn.functional.cross_entropy, batches(), LocalComm(), CFG)
    assert torch.equal(torch.get_rng_state(), rng_before)  # caller's RNG untouched
    m2 = tiny_model()
    r2 = search_init(m2, nn.functional.cross_entropy, batches(), None, CFG)
    assert r1["winner"] == r2["winner"]
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert r1["candidates"] == 12 and [r["spread"] for r in r1["rounds"]] == [0.0, 0.4, 0.2]
    assert r1["winner"]["score"] <= r1["default_score"]
    assert r1["winner"]["score"] == min(r["best_score"] for r in r1["rounds"])
    r3 = search_init(tiny_model(), nn.functional.cross_entropy, batches(), None, {**CFG, "seed": 1})
    assert r3["winner"]["id"] != r1["winner"]["id"] or r3["winner"]["seed"] != r1["winner"]["seed"]


def test_loaded_weights_are_the_winners_initial_weights():
    m = tiny_model()
    cfg = InitSearchConfig(**{**CFG, "rounds": 1})
    rep = search_init(m, nn.functional.cross_entropy, batches(), None, cfg)
    index = int(rep["winner"]["id"].split(".")[-1])
    fresh = tiny_model()
    expected = _Builder(fresh, _state(fresh)).state(_draw(cfg, 0, 0, [], 0.0)[index])
    for k, v in m.state_dict().items():
        assert torch.equal(v, expected[k])


def test_start_from_probed_loads_trained_weights():
    m = tiny_model()
    rep = search_init(m, nn.functional.cross_entropy, batches(), None, {**CFG, "rounds": 1, "start_from": "probed"})
    with torch.no_grad():
        probe_batches = [b for _, b in zip(range(3), batches())]
        loss = sum(float(nn.functional.cross_entropy(m(a), b)) for a, b in probe_batches) / 3
    assert loss == pytest.approx(rep["winner"]["score"], rel=1e-5)


def test_diverging_candidates_are_disqualified():
    m = tiny_model()
    rep = search_init(m, nn.functional.cross_entropy, batches(), None,
                      {"candidates": 4, "rounds": 1, "probe_steps": 3, "schemes": ["default", "xavier"],
                       "scales": [1.0, 1e30]})  # scale 1e30 overflows float32: inf loss
    assert rep["rounds"][0]["diverged"] == 2
    assert math.isfinite(rep["winner"]["score"]) and rep["winner"]["scale"] == 1.0
    assert all(math.isfinite(float(p.detach().abs().max())) for p in m.parameters())


def test_config_errors_name_the_key():
    _, errors = validate_pdv({"init_search": {"keep_fraction": 0, "candiates": 3, "schemes": ["lecun"]}})
    text = "\n".join(errors)
    assert "pdv.init_search.keep_fraction" in text and "pdv.init_search.candiates" in text
    assert "pdv.init_search.schemes" in text
    with pytest.raises(ConfigError, match="pdv.init_search.rounds"):
        search_init(tiny_model(), nn.functional.cross_entropy, batches(), None, {"rounds": 0})


def test_short_data_iterator_is_a_clear_error():
    with pytest.raises(ValueError, match="probe_steps"):
        search_init(tiny_model(), nn.functional.cross_entropy, iter([next(batches())]), None, CFG)


def test_score_batches_are_held_out_of_probing():
    m = tiny_model()
    cfg = {**CFG, "rounds": 1, "score_batches": 2, "start_from": "probed"}
    rep = search_init(m, nn.functional.cross_entropy, batches(), None, cfg)
    held = [b for _, b in zip(range(5), batches())][3:]  # 3 probe batches, then the 2 scored ones
    with torch.no_grad():
        loss = sum(float(nn.functional.cross_entropy(m(a), b)) for a, b in held) / 2
    assert loss == pytest.approx(rep["winner"]["score"], rel=1e-5)


def test_frozen_parameters_are_kept():
    m = tiny_model()
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    builder = _Builder(m, _state(m))
    cfg = InitSearchConfig(candidates=4, schemes=["default", "kaiming"])
    drawn = _draw(cfg, 0, 0, [], 0.0)
    for cand in drawn[1:] + _draw(cfg, 1, 0, drawn[1:2], 0.5):
        state = builder.state(cand)
        assert torch.equal(state["0.weight"], frozen), cand.id
        assert not torch.equal(state["2.weight"], builder.base["2.weight"]), cand.id
    search_init(m, nn.functional.cross_entropy, batches(), None, CFG)
    assert torch.equal(m[0].weight, frozen)


def test_all_diverged_never_loads_diverged_weights():
    m = tiny_model()
    rep = search_init(m, nn.functional.cross_entropy, batches(), None,
                      {**CFG, "rounds": 1, "scales": [1e30], "schemes": ["xavier"], "start_from": "probed"})
    assert rep["rounds"][0]["diverged"] == 4 and not math.isfinite(rep["winner"]["score"])
    assert all(math.isfinite(float(p.detach().abs().max())) for p in m.parameters())


def test_the_whole_model_must_fit_on_every_rank_or_all_refuse(monkeypatch):
    """Every rank searches over the whole model on its GPU: one rank short of memory is a ConfigError on
    every rank (agreed before anything moves), not an out-of-memory there and a hang elsewhere."""
    import threading

    from pdv_ext import init_search
    from pdv_ext.config_base import ConfigError
    from tests.threadcomm import run_threads

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    need = init_search.SEARCH_BYTES_PER_PARAM_BYTE * sum(p.numel() * 4 for p in model.parameters())
    free = {}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[threading.get_ident()], 1 << 40))

    def fn(comm):
        free[threading.get_ident()] = need - 1 if comm.rank == 1 else need
        try:
            init_search._agree_it_fits(model, torch.device("cuda"), comm)
            return None
        except ConfigError as exc:
            return str(exc)

    errors = run_threads(3, fn)
    assert all(e is not None and "pdv.init_search" in e for e in errors), errors
    assert "on rank 1" in errors[1] and "another rank is short" in errors[0]

    def fits(comm):
        free[threading.get_ident()] = need
        init_search._agree_it_fits(model, torch.device("cuda"), comm)
        return True

    assert all(run_threads(3, fits))
