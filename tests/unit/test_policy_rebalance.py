"""The `rebalance` policy: acts on a persistent slowdown, not on noise, and goes back when it ends."""
import random

from pdv_ext.policy.base import SetDataShares, build_policy


class Replicas:
    """Synthetic metrics of 4 one-stage replicas: compute time = micro-batches x seconds per micro-batch."""

    def __init__(self, speeds, total=16, noise=0.0, seed=0):
        self.speeds, self.total, self.noise = list(speeds), total, noise
        self.shares = [total // len(speeds)] * len(speeds)
        self.step = 0
        self.rng = random.Random(seed)

    def metrics(self):
        self.step += 1
        compute = [n * 0.01 / s * (1 + self.rng.uniform(-self.noise, self.noise))
                   for n, s in zip(self.shares, self.speeds)]
        return {"step": self.step, "compute_times": compute, "data_shares": list(self.shares),
                "replica_of_rank": list(range(len(compute))), "stage_of_rank": [0] * len(compute),
                "step_time": max(compute) + 0.005}

    def apply(self, actions):
        for a in actions:
            assert isinstance(a, SetDataShares)
            self.shares = list(a.shares) if a.shares is not None else [self.total // len(self.speeds)] * len(self.speeds)


def run(pol, reps, steps):
    changes = []
    for _ in range(steps):
        acts = pol.after_step(reps.metrics())
        if acts:
            changes.append((reps.step, acts[0].shares))
        reps.apply(acts)
    return changes


def test_no_change_on_a_calm_noisy_cluster():
    pol = build_policy({"name": "rebalance"})
    assert run(pol, Replicas([1, 1, 1, 1], noise=0.15), 300) == []


def test_slowdown_is_rebalanced_quickly_and_undone_when_it_ends():
    pol = build_policy({"name": "rebalance"})
    reps = Replicas([1, 1, 1, 1], noise=0.05)
    assert run(pol, reps, 10) == []
    reps.speeds[3] = 1 / 3  # one replica slowed 3x
    changes = run(pol, reps, 10)
    assert changes and changes[0][0] - 10 <= 10  # first adaptation within 10 agreement steps
    assert reps.shares == [5, 5, 5, 1]
    assert run(pol, reps, 30) == []  # stays put while the slowdown lasts
    reps.speeds[3] = 1.0
    back = run(pol, reps, 20)
    assert back and back[-1][1] is None and reps.shares == [4, 4, 4, 4]
    assert [d["shares"] for d in pol.decisions] == [[5, 5, 5, 1], [4, 4, 4, 4]]


def test_gains_below_the_threshold_are_not_taken():
    """A replica 1.3x slower: [5, 4, 4, 3] instead of [4, 4, 4, 4] gains about 4% of the step."""
    pol = build_policy({"name": "rebalance"})
    assert run(pol, Replicas([1, 1, 1, 1 / 1.3]), 50) == []
    pol = build_policy({"name": "rebalance", "threshold": 0.02})
    assert run(pol, Replicas([1, 1, 1, 1 / 1.3]), 50) == [(4, (5, 4, 4, 3))]


def test_state_round_trip():
    pol = build_policy({"name": "rebalance"})
    reps = Replicas([1, 1, 1, 0.25])
    run(pol, reps, 6)
    again = build_policy({"name": "rebalance"})
    again.load_state_dict(pol.state_dict())
    assert again.times == pol.times and again.decisions == pol.decisions
    assert pol.times and pol.rest is not None and pol.decisions
    for name in set(vars(pol)) - {"options", "plugin_name"}:  # every field, the smoothed step's rest included
        assert getattr(again, name) == getattr(pol, name), name
