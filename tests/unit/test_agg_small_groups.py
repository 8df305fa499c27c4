"""One rule for small data-parallel groups (docs/aggregation.md, "Small groups"): the same aggregation
section runs at group sizes 1, 2, 3 and 4; identity at 1; an option the group cannot support is clamped
with ONE warning naming the key; `pdv check-config --world-size N --stages S` says the same before launch."""
import json
import warnings

import pytest
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.aggregation.groups import GroupSizeWarning
from pdv_ext.config_cli import main as check_config

from tests.threadcomm import run_threads

SIZES = [1, 2, 3, 4]
#: the most demanding options users write for a width-4 group, run unchanged at every width
SPECS = [{"type": "mean"}, {"type": "adasum"}, {"type": "median"},
         {"type": "trimmed_mean", "b": 1}, {"type": "trimmed_mean", "b": 2},
         {"type": "zeno", "b": 1}, {"type": "zeno", "byzantine": 3},
         {"type": "suspicion", "k": 1}, {"type": "suspicion", "k": 2},
         {"type": "gossip"}, {"type": "gossip", "peers": 3, "ratio": 0.5}]
#: (option key as written) -> largest value a group of m ranks supports
LIMITS = {"trimmed_mean": {"b": lambda m: (m - 1) // 2}, "suspicion": {"k": lambda m: (m - 1) // 2},
          "zeno": {"b": lambda m: m - 1, "byzantine": lambda m: m - 1}, "gossip": {"peers": lambda m: m - 1}}
DEFAULTS = {"trimmed_mean": {"b": 1}, "suspicion": {"k": 1}, "zeno": {"b": 1}, "gossip": {"peers": 2}}


def grads(rank, step=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    base = torch.Generator().manual_seed(step)
    return [torch.randn(6, 5, generator=base) + 0.2 * torch.randn(6, 5, generator=g),
            torch.randn(9, generator=base) + 0.2 * torch.randn(9, generator=g)]


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def expected_clamps(spec, m):
    """[(key, want, got)] the rule predicts for `spec` on a group of m."""
    typ = spec["type"]
    out = []
    if m == 1:  # the identity: nothing clamped, nothing said
        return out
    for key, largest in LIMITS.get(typ, {}).items():
        if key in spec or (key in DEFAULTS.get(typ, {}) and not any(k in spec for k in LIMITS[typ])):
            want = spec.get(key, DEFAULTS[typ].get(key))
            if want is not None and want > largest(m):
                out.append((key, want, largest(m)))
    return out


def run(spec, m, steps=2):
    def fn(comm):
        agg = build_aggregator(dict(spec))
        if spec["type"] == "zeno":
            agg.set_validation_grads(grads(0, 9))
        outs = []
        for s in range(steps):
            outs.append(flat(agg([t.clone() for t in grads(comm.rank, s)], comm)))
        return outs, agg
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_threads(m, fn)
    return res, [w for w in caught if issubclass(w.category, GroupSizeWarning)]


@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_same_section_runs_at_every_group_size(spec, m):
    res, warned = run(spec, m)
    clamps = expected_clamps(spec, m)
    # ONE warning per clamped option per group (group rank 0 warns, once, not every step), naming the key
    assert sorted(str(w.message).split(" (")[0] for w in warned) == sorted(
        f"pdv.aggregation.{k}={want} clamped to {got} for a data-parallel group of {m}" for k, want, got in clamps)
    if m == 1:  # identity
        for s, out in enumerate(res[0][0]):
            assert torch.equal(out, flat(grads(0, s))), spec
        return
    if spec["type"] != "gossip":  # every replica applies the same update
        for outs, _ in res:
            assert all(torch.equal(a, b) for a, b in zip(outs, res[0][0]))
    assert all(torch.isfinite(o).all() for outs, _ in res for o in outs)
    honest = torch.stack([flat(grads(r, 1)) for r in range(m)]).mean(0)
    if spec["type"] in ("mean", "trimmed_mean", "median", "suspicion", "zeno"):
        assert (res[0][0][1] - honest).norm() < 0.5 * honest.norm()


@pytest.mark.parametrize("spec", [{"type": "trimmed_mean", "b": 1}, {"type": "suspicion", "k": 1}, {"type": "median"}])
def test_two_ranks_is_the_mean(spec):
    """At 2 ranks trimming / replacing is clamped to 0: the (weighted, equally) mean of the two; the median of two
    is their mean too."""
    res, _ = run(spec, 2, steps=1)
    want = (flat(grads(0)) + flat(grads(1))) / 2
    assert torch.allclose(res[0][0][0], want, atol=1e-6)


def test_zeno_keeps_the_better_of_two():
    res, warned = run({"type": "zeno", "b": 1}, 2, steps=1)
    assert not warned  # b = 1 < 2: nothing clamped
    agg = res[0][1]
    kept = 1 - agg.report["dropped"][0]
    assert torch.equal(res[0][0][0], flat(grads(kept)))


def test_zeno_alone_needs_no_validation_data():
    def fn(comm):
        agg = build_aggregator({"type": "zeno"})
        out = agg(grads(0), comm)
        return agg.needs_refresh(), flat(out)
    needs, out = run_threads(1, fn)[0]
    assert not needs and torch.equal(out, flat(grads(0)))


def test_alone_with_nonfinite_input_still_raises():
    bad = grads(0)
    bad[1][2] = float("nan")
    for typ in ("median", "trimmed_mean", "suspicion", "zeno"):
        with pytest.raises(FloatingPointError, match="non-finite"):
            run_threads(1, lambda comm: build_aggregator({"type": typ})([t.clone() for t in bad], comm))


def test_gossip_alone_applies_what_it_held_back():
    """A gossip replica that was in a group of 4 and is now alone applies its gradient plus its error feedback
    (nothing is lost), then is the identity."""
    def fn(comm):
        return build_aggregator({"type": "gossip", "peers": 2, "ratio": 0.1})
    aggs = run_threads(1, fn)
    agg = aggs[0]
    agg.residual = torch.full((39,), 0.5)
    agg.applied = torch.zeros(39)
    out = run_threads(1, lambda comm: flat(agg(grads(0), comm)))[0]
    assert torch.equal(out, flat(grads(0)) + 0.5) and not agg.residual.any()
    out = run_threads(1, lambda comm: flat(agg(grads(0, 1), comm)))[0]
    assert torch.equal(out, flat(grads(0, 1)))


def test_set_peers_beyond_the_group_is_clamped_and_warned_once():
    def fn(comm):
        agg = build_aggregator({"type": "gossip", "peers": 1, "ratio": 0.3})
        agg(grads(comm.rank), comm)
        agg.set_peers(5)
        for s in range(3):
            agg(grads(comm.rank, s), comm)
        return agg.report["peers"], agg.effective("peers")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_threads(3, fn)
    assert [str(w.message).split(" (")[0] for w in caught if issubclass(w.category, GroupSizeWarning)] == [
        "pdv.aggregation.peers=5 clamped to 2 for a data-parallel group of 3"]
    assert all(len(p) == 2 and eff == 2 for p, eff in res)


def test_bind_warns_before_the_first_step():
    agg = build_aggregator({"type": "trimmed_mean", "b": 2})
    with pytest.warns(GroupSizeWarning, match=r"^pdv.aggregation.b=2 clamped to 0 for a data-parallel group of 2"):
        assert agg.bind(2) == {"b": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agg.bind(2)  # once
        agg.bind(2, rank=1)
        assert build_aggregator({"type": "trimmed_mean", "b": 2}).bind(3, rank=1) == {"b": 1}  # rank 0 warns


# ---- pdv check-config --world-size N --stages S ------------------------------------------------------------------
def _write(tmp_path, section, name="ds.json"):
    """The config file; a `"cluster": "c.yaml"` in it becomes a real cluster YAML of 8 devices (what the
    launch, and so check-config, reads) with a profile input shape."""
    placement = section.get("placement", {})
    if placement.get("cluster") == "c.yaml":
        c = tmp_path / "c.yaml"
        c.write_text("hosts: [{name: h, devices: 8, throughput: 1.0}]\n"
                     "links: {intra_host: {bandwidth: 1 GB/s, latency: 10us}}\n")
        section = {**section, "placement": {**placement, "cluster": str(c), "input_shape": [4, 16]}}
    p = tmp_path / name
    p.write_text(json.dumps({"train_batch_size": 8, "pdv": section}))
    return str(p)


def test_check_config_topology_warns_clamps_and_exits_0(tmp_path, capsys):
    p = _write(tmp_path, {"aggregation": {"type": "trimmed_mean", "b": 2}})
    assert check_config([p]) == 0
    assert capsys.readouterr().out.splitlines() == ["ok"]  # without the flags: as before
    assert check_config([p, "--world-size", "4", "--stages", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "ok" and len(out) == 2
    assert out[0].startswith("warning: pdv.aggregation.b=2 clamped to 0 for a data-parallel group of 2")
    assert check_config([p, "--world-size", "10", "--stages", "2"]) == 0  # 5 ranks: b = 2 fits
    assert capsys.readouterr().out.splitlines() == ["ok"]


@pytest.mark.parametrize("section, argv, line", [
    ({}, ["--world-size", "6", "--stages", "4"], "--stages: 6 ranks do not split into 4 pipeline stages"),
    ({}, ["--world-size", "0"], "--world-size: must be at least 1 (got 0)"),
    ({}, ["--stages", "2"], "--stages: needs --world-size N"),
    ({"placement": {"num_stages": 4, "cluster": "c.yaml"}}, ["--world-size", "8", "--stages", "2"],
     "pdv.placement.num_stages: 4 stages in the config, but --stages 2"),
    ({"placement": {"boundaries": [0, 3, 6, 9]}}, ["--world-size", "4", "--stages", "2"],
     "pdv.placement.boundaries: 3 stages in the config, but --stages 2"),
])
def test_check_config_topology_errors_name_the_key_and_exit_2(tmp_path, capsys, section, argv, line):
    assert check_config([_write(tmp_path, section)] + argv) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(line), out


def test_check_config_stages_default_to_the_placement_section(tmp_path, capsys):
    p = _write(tmp_path, {"aggregation": {"type": "gossip", "peers": 2},
                          "placement": {"num_stages": 2, "cluster": "c.yaml"}})
    assert check_config([p, "--world-size", "8"]) == 0  # the cluster's 8 devices, 2 stages: groups of 4
    assert capsys.readouterr().out.splitlines() == ["ok"]
    p = _write(tmp_path, {"aggregation": {"type": "gossip", "peers": 2}, "placement": {"boundaries": [0, 2, 4]}})
    assert check_config([p, "--world-size", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["warning: pdv.aggregation.peers=2 clamped to 1 for a data-parallel group of 2 "
                   "(a rank has at most m - 1 peers)", "ok"]


def test_check_config_schema_errors_come_first(tmp_path, capsys):
    p = _write(tmp_path, {"aggregation": {"type": "trimmed_mean", "bb": 2}})
    assert check_config([p, "--world-size", "2"]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("pdv.aggregation.bb: unknown key")


def test_check_config_via_the_pdv_command(tmp_path, capsys):
    from pdv_ext.cli import main as pdv

    p = _write(tmp_path, {"aggregation": {"type": "suspicion", "k": 1}})
    assert pdv(["check-config", p, "--world-size", "2", "--stages", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(
        "warning: pdv.aggregation.k=1 clamped to 0 for a data-parallel group of 2")
