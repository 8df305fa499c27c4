"""Data shares: the split itself (best_shares), the iterator's slices, the action's validation."""
import pytest
import torch

from pdv_ext.policy.base import SetDataShares, action_from_dict
from pdv_ext.policy.shares import best_shares, check_shares, equal_shares, predicted_step, shares_by_throughput
from tests.unit.test_policy_data import _replicas


def test_best_shares_balances_the_replicas():
    assert best_shares([1.0, 1.0, 1.0, 1.0], 16) == [4, 4, 4, 4]
    assert best_shares([1.0, 1.0, 1.0, 3.0], 16) == [5, 5, 5, 1]
    assert predicted_step([5, 5, 5, 1], [1, 1, 1, 3]) == 5.0
    assert predicted_step([4, 4, 4, 4], [1, 1, 1, 3]) == 12.0
    # exhaustive check of optimality on small cases, with pipeline stages
    import itertools

    for times in ([1.0, 2.0, 3.5], [0.3, 0.3, 1.0], [1.0, 1.0, 1.0]):
        for stages in (1, 2, 4):
            total = 10
            best = min(predicted_step(c, times, stages) for c in itertools.product(range(1, 9), repeat=3)
                       if sum(c) == total)
            assert predicted_step(best_shares(times, total, stages), times, stages) == best


def test_best_shares_keeps_everyone_and_checks_input():
    assert best_shares([1.0, 100.0], 4) == [3, 1]  # even a very slow replica keeps its minimum of one
    with pytest.raises(ValueError, match="at least 1"):
        best_shares([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match="positive and finite"):
        best_shares([1.0, 0.0], 4)
    assert shares_by_throughput([1.0, 1.0, 0.5, 0.25], 8) == [3, 3, 1, 1]
    assert equal_shares(10, 4) == [3, 3, 2, 2]


def test_check_shares_names_the_problem():
    assert check_shares([3, 1], 2, 4) == [3, 1]
    with pytest.raises(ValueError, match="add up to 5 micro-batches but the global batch has 4"):
        check_shares([3, 2], 2, 4)
    with pytest.raises(ValueError, match="3 values for 2 data-parallel replicas"):
        check_shares([1, 1, 2], 2)
    with pytest.raises(ValueError, match=">= 1"):
        check_shares([4, 0], 2)


def test_action_round_trips():
    a = SetDataShares([3, 1], source="p")
    assert a.shares == (3, 1)
    assert action_from_dict(a.to_dict()) == a


def _step(its, shares):
    out = []
    for it, n in zip(its, shares):
        for _ in range(n):
            xb, yb = next(it)
            assert torch.equal(yb, xb * 10)
            out.extend(xb.tolist())
    return out


def test_iterator_hands_every_position_once_whatever_the_shares():
    n, dp, mbs = 101, 4, 3
    its = _replicas(n, mbs, dp)
    plan = [None, None, [5, 5, 5, 1], [5, 5, 5, 1], [4, 4, 4, 4], [2, 6, 4, 4], None, [1, 1, 1, 13]]
    for shares in plan:
        for it in its:
            it.set_shares(shares)
        _step(its, shares or [4] * dp)
    total = its[0].position
    assert all(it.position == total for it in its)
    assert total == len(plan) * 16 * mbs
    assert sorted(p for it in its for p in it.seen) == list(range(total))
    assert sorted(its[0].indices(0, n).tolist()) == list(range(n))  # within an epoch: each sample once


def test_equal_shares_are_the_plain_interleaving():
    a, b = _replicas(64, 2, 4), _replicas(64, 2, 4)
    for it in b:
        it.set_shares([3, 3, 3, 3])
    assert _step(a, [3] * 4) == _step(b, [3] * 4)
    assert all(it.shares is None for it in b)


def test_checkpoint_with_unequal_shares_resumes_exactly():
    its = _replicas(60, 2, 3)
    _step(its, [2, 2, 2])
    for it in its:
        it.set_shares([4, 1, 1])
    _step(its, [4, 1, 1])
    states = [it.state_dict() for it in its]
    expected = _step(its, [4, 1, 1]) + _step(its, [4, 1, 1])
    fresh = _replicas(60, 5, 3)
    for it, st in zip(fresh, states):
        it.load_state_dict(st)
    assert fresh[0].shares == [4, 1, 1]
    assert _step(fresh, [4, 1, 1]) + _step(fresh, [4, 1, 1]) == expected


def test_set_shares_checks_its_input():
    it = _replicas(10, 2, 2)[0]
    with pytest.raises(ValueError, match="need 2 counts"):
        it.set_shares([1, 1, 1])


def test_rescale_shares_keeps_the_proportions_and_one_each():
    from pdv_ext.policy.shares import rescale_shares

    assert rescale_shares([1, 3], 8) == [2, 6]
    assert rescale_shares([5, 5, 5, 1], 32) == [10, 10, 10, 2]
    assert rescale_shares([10, 10, 10, 2], 16) == [5, 5, 5, 1]
    assert rescale_shares([1, 7], 4) == [1, 3]  # the slow replica keeps one
    assert rescale_shares([1, 1, 6], 3) == [1, 1, 1]
    for shares, total in [([3, 2, 2], 11), ([1, 1, 1, 9], 5), ([4, 1], 9)]:
        out = rescale_shares(shares, total)
        assert sum(out) == total and min(out) >= 1
    with pytest.raises(ValueError, match="cannot give each of 3 replicas one"):
        rescale_shares([1, 1, 1], 2)
