"""median, trimmed_mean, suspicion and zeno on in-process ranks (ThreadComm)."""
import pytest
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.config import validate_pdv

from tests.threadcomm import run_threads

SHAPES = [(5, 3), (7,), (2, 2, 2)]


def grads_of(rank, seed=0, shift=None):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    base = torch.Generator().manual_seed(seed)
    out = []
    for s in SHAPES:
        honest = torch.randn(s, generator=base)  # the common "true" gradient
        out.append(honest + 0.1 * torch.randn(s, generator=g))
    return out


def flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def run(spec, m, make=grads_of, setup=None):
    def fn(comm):
        agg = build_aggregator(dict(spec))
        if setup:
            setup(agg, comm)
        out = agg(make(comm.rank), comm)
        return flat(out), agg.report
    return run_threads(m, fn)


def test_median_and_trimmed_mean_match_reference_and_replicas_agree():
    m = 5
    stack = torch.stack([flat(grads_of(r)) for r in range(m)])
    med = run({"type": "median"}, m)
    ref = stack.sort(0).values[m // 2]
    for out, _ in med:
        assert torch.equal(out, med[0][0])
        assert torch.allclose(out, ref)
    tm = run({"type": "trimmed_mean", "b": 1}, m)
    ref = stack.sort(0).values[1:-1].mean(0)
    for out, _ in tm:
        assert torch.allclose(out, ref, atol=1e-6)


def test_even_median_averages_middle_pair():
    out = run({"type": "median"}, 4, make=lambda r: [torch.tensor([float(r), -float(r)])])
    assert torch.allclose(out[0][0], torch.tensor([1.5, -1.5]))


@pytest.mark.parametrize("spec", [{"type": "median"}, {"type": "trimmed_mean", "b": 1}, {"type": "suspicion", "k": 1},
                                  {"type": "zeno", "b": 1}])
def test_nonfinite_rank_never_reaches_output(spec):
    m = 5

    def make(r):
        g = grads_of(r)
        if r == 2:
            g[0][0, 0] = float("nan")
            g[1][3] = float("inf")
        return g

    def setup(agg, comm):
        if spec["type"] == "zeno":
            agg.set_validation_grads(grads_of(0, seed=0))

    res = run(spec, m, make=make, setup=setup)
    for out, rep in res:
        assert torch.isfinite(out).all()
        assert 2 in rep["dropped"]
        assert torch.equal(out, res[0][0])
    honest = torch.stack([flat(grads_of(r)) for r in range(m) if r != 2]).mean(0)
    assert (res[0][0] - honest).norm() < 0.2 * honest.norm()


def test_trimmed_mean_too_few_ranks_clamps_b_with_one_warning():
    from pdv_ext.aggregation.groups import GroupSizeWarning

    with pytest.warns(GroupSizeWarning, match=r"pdv.aggregation.b=2 clamped to 1 for a data-parallel group of 4"):
        res = run({"type": "trimmed_mean", "b": 2}, 4)
    assert all(rep["trim"] == 1 for _, rep in res)
    assert torch.equal(res[0][0], run({"type": "trimmed_mean", "b": 1}, 4)[0][0])


def test_suspicion_replaces_outlier_and_weights_by_distance():
    m = 6

    def make(r):
        g = grads_of(r)
        return [x * -50 for x in g] if r == 4 else g

    res = run({"type": "suspicion", "k": 1}, m, make=make)
    out, rep = res[0]
    assert rep["dropped"] == [4]
    assert max(range(m), key=lambda i: rep["suspicion"][i]) == 4
    honest = torch.stack([flat(grads_of(r)) for r in range(m) if r != 4]).mean(0)
    assert (out - honest).norm() < 0.05 * honest.norm()
    # identical candidates: the output is the candidate itself
    same = run({"type": "suspicion", "k": 2}, 5, make=lambda r: grads_of(0))
    assert torch.allclose(same[0][0], flat(grads_of(0)), atol=1e-6)


def test_zeno_drops_attackers_by_validation_score():
    m, bad = 6, {1, 4}

    def make(r):
        g = grads_of(r)
        return [-3 * x for x in g] if r in bad else g

    def setup(agg, comm):
        agg.set_validation_grads(grads_of(99 + comm.rank, seed=0))  # each rank its own validation batch

    res = run({"type": "zeno", "byzantine": 2}, m, make=make, setup=setup)
    for out, rep in res:
        assert set(rep["dropped"]) == bad
        assert torch.equal(out, res[0][0])
    honest = torch.stack([flat(grads_of(r)) for r in range(m) if r not in bad]).mean(0)
    assert torch.allclose(res[0][0], honest, atol=1e-6)


def test_zeno_options_and_validation_refresh():
    assert validate_pdv({"aggregation": {"type": "zeno", "b": 1, "byzantine": 2}})[1]
    assert validate_pdv({"aggregation": {"type": "zeno", "rho": -1}})[1][0].startswith("pdv.aggregation.rho")
    calls = []

    def fn(comm):
        def vfn():
            calls.append(comm.rank)
            return grads_of(0)
        agg = build_aggregator({"type": "zeno", "b": 1, "refresh_every": 2})
        agg.validation_fn = vfn
        for _ in range(5):
            agg(grads_of(comm.rank), comm)
        return agg.step

    assert run_threads(3, fn) == [5, 5, 5]
    assert len(calls) == 3 * 3  # steps 0, 2, 4 on each of 3 ranks
    with pytest.raises(RuntimeError, match="validation"):
        run({"type": "zeno"}, 3)
    with pytest.warns(UserWarning, match="pdv.aggregation.b=3 clamped to 2 for a data-parallel group of 3"):
        res = run({"type": "zeno", "b": 3}, 3, setup=lambda a, c: a.set_validation_grads(grads_of(0)))
    assert len(res[0][1]["dropped"]) == 2


def test_finite_rows_sum_shortcut_is_exact():
    from pdv_ext.aggregation.robust import finite_rows

    big = torch.full((4,), 3e38)  # finite, but its float32 sum overflows to inf
    stack = torch.stack([torch.ones(4), big, torch.tensor([1.0, float("nan"), 0.0, 0.0]),
                         torch.tensor([float("-inf"), 0.0, 0.0, 0.0])])
    assert finite_rows(stack).tolist() == [True, True, False, False]
    assert finite_rows(torch.empty(3, 0)).tolist() == [True, True, True]


def test_suspicion_matches_the_unblocked_formula():
    from pdv_ext.aggregation import suspicion

    m = 5

    def make(r):
        g = grads_of(r)
        return [x * 4 for x in g] if r == 3 else g

    old = suspicion.BLOCK
    suspicion.BLOCK = 7  # many Gram blocks, and a ragged last one
    try:
        out, rep = run({"type": "suspicion", "k": 1}, m, make=make)[0]
    finally:
        suspicion.BLOCK = old
    stack = torch.stack([flat(make(r)) for r in range(m)]).double()
    s = (stack - stack.mean(0)).norm(dim=1)
    assert torch.allclose(torch.tensor(rep["suspicion"], dtype=torch.float64), s)
    rest = [i for i in range(m) if i != int(s.argmax())]
    w = s[rest].median() / (s[rest].median() + s[rest])
    want = ((w[:, None] * stack[rest]).sum(0) + w.mean() * stack[rest].mean(0)) / (w.sum() + w.mean())
    assert rep["dropped"] == [3]
    assert torch.allclose(out.double(), want, atol=1e-6)


@pytest.mark.parametrize("spec", [{"type": "median"}, {"type": "trimmed_mean", "b": 1}, {"type": "suspicion", "k": 1},
                                  {"type": "zeno", "b": 1}])
def test_fewer_coordinates_than_ranks(spec):
    """Slices of 0 or 1 coordinate (3 entries over 5 ranks): the sliced statistics still agree with the
    whole-vector reference and every replica ends identical."""
    m = 5

    def make(r):
        v = torch.tensor([1.0 + 0.01 * r, -2.0 - 0.02 * r, 0.5])
        return [v * (-20.0 if r == 1 else 1.0)]

    def setup(agg, comm):
        if spec["type"] == "zeno":
            agg.set_validation_grads([torch.tensor([1.0, -2.0, 0.5])])

    res = run(spec, m, make=make, setup=setup)
    for out, rep in res:
        assert torch.equal(out, res[0][0])
        assert rep == res[0][1]
    honest = torch.stack([flat(make(r)) for r in range(m) if r != 1])
    assert torch.allclose(res[0][0], honest.median(0).values if spec["type"] == "median" else honest.mean(0),
                          atol=0.05)
    if spec["type"] in ("suspicion", "zeno"):
        assert res[0][1]["dropped"] == [1]


def test_zeno_reuses_scattered_validation_until_any_rank_refreshes():
    """The validation slices are scattered again only when some rank's v changed (agreed collectively): a
    refresh on one rank alone neither hangs nor is missed, and stale steps score like a fresh aggregator."""
    m = 4
    v0, v1 = grads_of(0, seed=7), [-x for x in grads_of(0, seed=7)]

    def fn(comm):
        agg = build_aggregator({"type": "zeno", "b": 1})
        agg.set_validation_grads(v0)
        reps = []
        for step in range(3):
            if step == 2 and comm.rank == 0:
                agg.set_validation_grads(v1)
            agg(grads_of(comm.rank, seed=step), comm)
            reps.append(agg.report["scores"])
        fresh = build_aggregator({"type": "zeno", "b": 1})
        fresh.set_validation_grads(v1 if comm.rank == 0 else v0)
        fresh(grads_of(comm.rank, seed=2), comm)
        return reps, fresh.report["scores"]

    res = run_threads(m, fn)
    for reps, fresh_scores in res:
        assert reps == res[0][0]
        assert reps[2] == fresh_scores  # the refreshed v of rank 0 was used
    assert res[0][0][2] != res[0][0][1]


def test_docs_example_of_a_sliced_robust_aggregator_runs():
    """The `coordinate_min_abs` example in docs/aggregation.md, executed as written, gives the per-coordinate
    finite value closest to zero on every replica."""
    import pathlib
    import re

    from pdv_ext.aggregation import AGGREGATORS

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "aggregation.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "coordinate_min_abs" in c)
    try:
        exec(compile(code, "docs/aggregation.md", "exec"), {})
        m = 5

        def make(r):
            g = grads_of(r)
            if r == 3:
                g[0][1, 1] = float("nan")
            return g

        res = run({"type": "coordinate_min_abs"}, m, make=make)
        stack = torch.stack([flat(grads_of(r)) for r in range(m) if r != 3])
        want = stack.gather(0, stack.abs().argmin(0, keepdim=True)).squeeze(0)
        for out, _ in res:
            assert torch.equal(out, want)
    finally:
        AGGREGATORS._items.pop("coordinate_min_abs", None)  # registered by the example: leave the registry as found


@pytest.mark.parametrize("m", [3, 4])
@pytest.mark.parametrize("spec", [{"type": "median"}, {"type": "trimmed_mean", "b": 1}, {"type": "suspicion", "k": 1},
                                  {"type": "zeno", "b": 1}])
def test_device_code_paths_give_the_cpu_results(spec, m, monkeypatch):
    """The sync-free paths CUDA takes (min/max finite check, float64 dot products on the device, one batched
    host copy), run here on CPU tensors: same outputs bit for bit and the same decisions as the CPU paths,
    with and without a non-finite rank; zeno's scores agree to float64 rounding (their sums' order differs)."""
    from pdv_ext.aggregation import robust

    def make(r):
        g = grads_of(r, seed=3)
        if r == 1:
            g = [-4 * x for x in g]
        if bad and r == m - 1:
            g[2][1, 1, 1] = float("nan")
            g[1][0] = float("-inf")
        return g

    def setup(agg, comm):
        if spec["type"] == "zeno":
            agg.set_validation_grads(grads_of(7 + comm.rank))

    for bad in (False, True):
        want = run(spec, m, make=make, setup=setup)
        monkeypatch.setattr(robust, "PATHS", "device")
        got = run(spec, m, make=make, setup=setup)
        monkeypatch.setattr(robust, "PATHS", "auto")
        for (o1, r1), (o2, r2) in zip(want, got):
            assert torch.equal(o1, o2)
            assert r1["dropped"] == r2["dropped"] and r1["nonfinite"] == r2["nonfinite"]
            if "scores" in r1:
                assert torch.allclose(torch.tensor(r1["scores"]), torch.tensor(r2["scores"]), rtol=1e-12, atol=0)
            if bad:
                assert m - 1 in r1["nonfinite"]
