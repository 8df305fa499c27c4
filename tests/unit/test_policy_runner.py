"""PolicyRunner agreement logic on simulated ranks (threads sharing a fake Comm), LR handling, errors."""
import threading

import pytest
import torch

from pdv_ext.comm.base import Comm
from pdv_ext.policy import Policy, SetAggregator, SetBatchSize, SetGossipPeers, SetLearningRate
from pdv_ext.policy.runner import PolicyError, PolicyRunner


class ThreadComm(Comm):
    """N ranks as threads: broadcast and all_gather through a shared slot guarded by a barrier."""

    backend = "threads"

    def __init__(self, rank, shared):
        self.rank, self.size, self.shared = rank, shared["size"], shared

    def broadcast(self, tensor, src=0):
        b = self.shared["barrier"]
        if self.rank == src:
            self.shared["slot"] = tensor.clone()
        b.wait()
        tensor.copy_(self.shared["slot"])
        b.wait()
        return tensor

    def all_gather(self, tensor):
        b = self.shared["barrier"]
        self.shared.setdefault("gather", {})[self.rank] = tensor.clone()
        b.wait()
        out = [self.shared["gather"][r].clone() for r in range(self.size)]
        b.wait()
        return out

    def all_reduce(self, tensor, op="sum"):
        vals = self.all_gather(tensor)
        tensor.copy_(torch.stack(vals).sum(0))
        return tensor

    def barrier(self):
        self.shared["barrier"].wait()


class FakeApplier:
    def __init__(self):
        self.mbs, self.mb, self.dp = 4, 2, 2
        self.lrs = [0.1, 0.01]
        self.calls = []

    def batch_geometry(self):
        return self.mbs, self.mb, self.dp

    def set_batch_size(self, micro_batches, micro_batch_size):
        self.mb, self.mbs = micro_batches, micro_batch_size
        self.calls.append(("batch", micro_batches, micro_batch_size))

    def get_lr(self):
        return list(self.lrs)

    def set_lr(self, lrs):
        self.lrs = list(lrs)

    def set_aggregator(self, spec):
        self.calls.append(("aggregator", spec))

    def set_gossip_peers(self, peers):
        self.calls.append(("peers", peers))


class RankDependent(Policy):
    """Decides differently on every rank: only rank 0's decision may be applied anywhere."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def after_step(self, m):
        if m["step"] == 2:
            return [SetBatchSize(micro_batches=3 + self.rank, lr_rule="linear")]
        if m["step"] == 3:
            return [SetAggregator({"type": "gossip", "peers": 1}), SetGossipPeers(1 + self.rank)]
        return []


class Raiser(Policy):
    def after_step(self, m):
        if m["step"] == 2:
            raise ValueError("bad plugin")
        return [SetLearningRate(scale=1.0)] if m["step"] == 1 else []


def run_ranks(n, make_policies, steps=4, on_error="disable", every=1):
    shared = {"size": n, "barrier": threading.Barrier(n, timeout=20)}
    results, errors = [None] * n, [None] * n

    def worker(rank):
        ap = FakeApplier()
        runner = PolicyRunner(make_policies(rank), ThreadComm(rank, shared), ap, on_error=on_error, every=every)
        runner.on_train_begin()
        try:
            for step in range(1, steps + 1):
                runner.after_step({"step": step, "gns": 10.0})
        except PolicyError as exc:
            errors[rank] = str(exc)
        results[rank] = (runner, ap)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors


def test_every_rank_applies_rank0_decisions():
    results, errors = run_ranks(3, lambda r: [RankDependent(r)])
    assert errors == [None] * 3
    logs = [runner.action_log for runner, _ in results]
    assert logs[0] == logs[1] == logs[2]
    assert [s for s, _ in logs[0]] == [2, 3, 3]
    for _, ap in results:
        assert ap.calls == [("batch", 3, 4), ("aggregator", {"type": "gossip", "peers": 1}), ("peers", 1)]
        assert ap.lrs == pytest.approx([0.1 * 1.5, 0.01 * 1.5])  # linear rule: 16 -> 24 samples


def test_failing_plugin_disabled_on_every_rank():
    results, errors = run_ranks(2, lambda r: [Raiser(), RankDependent(r)])
    assert errors == [None, None]
    for runner, ap in results:
        assert runner.disabled == {0: "ValueError: bad plugin"}
        assert runner.errors[0]["step"] == 2 and runner.errors[0]["policy"] == "Raiser"
        assert ("batch", 3, 4) in ap.calls  # the healthy plugin kept running


def test_failing_plugin_stops_every_rank_with_raise():
    results, errors = run_ranks(2, lambda r: [Raiser()], on_error="raise")
    assert all(e is not None and "Raiser" in e and "step 2" in e and "bad plugin" in e for e in errors)


def test_non_action_return_is_an_error():
    class Wrong(Policy):
        def after_step(self, m):
            return ["grow please"]

    results, _ = run_ranks(1, lambda r: [Wrong()], steps=1)
    assert "not an Action" in results[0][0].errors[0]["error"]


def test_lr_scale_survives_a_scheduler():
    ap = FakeApplier()
    from pdv_ext.comm import LocalComm

    runner = PolicyRunner([], LocalComm(), ap)
    runner.after_step({"step": 1})
    runner._apply(SetBatchSize(micro_batches=4), {"lr_factor": 2.0})
    assert ap.lrs == [0.2, 0.02]
    runner.after_step({"step": 2})
    assert ap.lrs == [0.2, 0.02]  # no scheduler: not compounded
    ap.lrs = [0.05, 0.005]  # a scheduler sets a new base LR
    runner.after_step({"step": 3})
    assert ap.lrs == pytest.approx([0.1, 0.01])
    runner._apply(SetLearningRate(lr=0.3), {})
    assert ap.lrs == [0.3, 0.3] and runner.lr_scale == 1.0
    state = runner.state_dict()
    other = PolicyRunner([], LocalComm(), FakeApplier())
    other.load_state_dict(state)
    assert other.lr_scale == runner.lr_scale and other.base_lrs == runner.base_lrs


def test_bad_sizes_rejected():
    from pdv_ext.comm import LocalComm

    runner = PolicyRunner([], LocalComm(), FakeApplier())
    with pytest.raises(ValueError, match="must be >= 1"):
        runner._apply(SetBatchSize(micro_batches=0), {})


def test_invalid_action_is_a_plugin_error_not_a_hang():
    class Zero(Policy):
        def after_step(self, m):
            return [SetBatchSize(micro_batches=0)]

    results, errors = run_ranks(2, lambda r: [Zero()], steps=2)
    assert errors == [None, None]
    for runner, ap in results:
        assert "must be >= 1" in runner.errors[0]["error"] and ap.calls == []


def test_agreement_every_n_steps_queues_decisions():
    class Grow(Policy):
        def after_step(self, m):
            return [SetBatchSize(micro_batches=m["step"] + 2, lr_rule="linear")] if m["step"] in (1, 2) else []

    results, errors = run_ranks(2, lambda r: [Grow(), Raiser()], steps=5, every=3)
    assert errors == [None, None]
    for runner, ap in results:
        # both decisions (steps 1 and 2) applied together at step 3, in order; the error reached rank 1 too
        assert [s for s, _ in runner.action_log] == [3, 3, 3]  # + Raiser's step-1 SetLearningRate
        assert ap.calls == [("batch", 3, 4), ("batch", 4, 4)]
        assert ap.lrs == pytest.approx([0.1 * 2, 0.01 * 2])  # 16 -> 24 -> 32 samples, linear
        # what a benchmark reports: the batch decisions alone, each with its step and fields
        assert [(d["step"], d["micro_batches"]) for d in runner.applied("SetBatchSize")] == [(3, 3), (3, 4)]
        assert "action" not in runner.applied("SetBatchSize")[0] and runner.applied("Replan") == []
        assert runner.disabled == {1: "ValueError: bad plugin"}
