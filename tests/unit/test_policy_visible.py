"""Saying what a policy did (issue #27 item 5): one INFO line on rank 0 per applied action (step, policy,
action and values, what changed), and `metrics.csv`'s `lr` is the LR the step used - the policies' scale on
the scheduler's LR included, also between agreement steps. The DeepSpeed glue runs here on a fake engine
(one process, a LocalComm as its world)."""
import logging
from types import SimpleNamespace

import pytest
from deepspeed.runtime.pipe import schedule

from pdv_ext.comm.base import LocalComm
from pdv_ext.log import logger
from pdv_ext.policy import Policy, SetBatchSize, SetLearningRate
from pdv_ext.integrations.deepspeed import glue as glue_module
from pdv_ext.placement.config import PlacementConfig
from pdv_ext.policy.config import PolicyConfig
from pdv_ext.policy.runner import PolicyRunner


class HalveAt(Policy):
    """SetLearningRate(scale=0.5) once, at the first step from 3 on that it sees (with `every` = 2 the
    policies see the agreement steps only)."""

    done = False

    def after_step(self, metrics):
        if self.done or metrics["step"] < 3:
            return []
        self.done = True
        return [SetLearningRate(scale=0.5)]


@pytest.fixture
def lines():
    seen = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append((record.name, record.levelno, record.getMessage()))

    handler = Capture()
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


class Applier:
    def __init__(self):
        self.mbs, self.mb, self.dp, self.lrs = 4, 2, 2, [0.1]

    def batch_geometry(self):
        return self.mbs, self.mb, self.dp

    def set_batch_size(self, micro_batches, micro_batch_size):
        self.mb, self.mbs = micro_batches, micro_batch_size

    def get_lr(self):
        return list(self.lrs)

    def set_lr(self, lrs):
        self.lrs = list(lrs)


class Grow(Policy):
    def after_step(self, metrics):
        return [SetBatchSize(micro_batches=4, lr_rule="linear")] if metrics["step"] == 1 else []


def test_each_applied_action_is_one_info_line_naming_step_policy_values_and_effect(lines):
    pol = Grow()
    pol.plugin_name = "my_pkg:Grow"
    runner = PolicyRunner([pol], LocalComm(), Applier())
    runner.after_step({"step": 1})
    runner.after_step({"step": 2})  # nothing to do: no line
    assert lines == [("pdv_ext.policy", logging.INFO,
                      "step 1: policy 'my_pkg:Grow' applied SetBatchSize(micro_batches=4, lr_rule='linear'): "
                      "batch 16 -> 32 (micro_batches 2 -> 4, micro_batch_size 4 -> 4), lr 0.1 -> 0.2")]


def test_only_rank_0_logs(lines):
    import threading

    from tests.unit.test_policy_runner import ThreadComm

    shared = {"size": 2, "barrier": threading.Barrier(2)}
    appliers = [Applier(), Applier()]

    def rank(r):
        PolicyRunner([Grow()], ThreadComm(r, shared), appliers[r]).after_step({"step": 1})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(a.mb == 4 for a in appliers)  # both ranks applied it
    assert len(lines) == 1 and lines[0][2].startswith("step 1: policy 'Grow' applied SetBatchSize")


class FakeEngine(SimpleNamespace):
    """What PolicyGlue reads of a PipelineEngine. `step()` is one train_batch: the optimizer update uses the
    param groups' LR, then the LR scheduler (WarmupLR-like: 0.01 * steps done) sets the next step's LR."""

    def __init__(self, every):
        imap = {schedule.ForwardPass: lambda self: None, schedule.BackwardPass: lambda self: None}
        super().__init__(device="cpu", num_stages=1, grad_hooks=[], _INSTRUCTION_MAP=imap, global_steps=0,
                         optimizer=SimpleNamespace(param_groups=[{"lr": 0.0}]), aggregator=SimpleNamespace(),
                         micro_batches=2, total_micro_batches=2, data_shares=None, data_iterator=None,
                         grid=SimpleNamespace(get_data_parallel_world_size=lambda: 1,
                                              _topo=SimpleNamespace(get_coord=lambda r: SimpleNamespace(pipe=0, data=r),
                                                                    get_dim=lambda axis: 1,
                                                                    get_rank=lambda pipe, data: 0)),
                         module=SimpleNamespace(parts=[0, 1]),
                         pdv_config=SimpleNamespace(placement=PlacementConfig(), policy=PolicyConfig(
                             plugins=[{"name": "tests.unit.test_policy_visible:HalveAt"}], every=every,
                             monitor={"gns": False})))
        self.used = {}

    def train_micro_batch_size_per_gpu(self):
        return 4

    def train_batch(self):
        glue = glue_module.begin_step(self)
        self.used[self.global_steps + 1] = self.optimizer.param_groups[0]["lr"]  # the optimizer update
        self.global_steps += 1
        self.optimizer.param_groups[0]["lr"] = 0.01 * self.global_steps  # the scheduler's step
        glue.end(1.0)


@pytest.mark.parametrize("every", [1, 2])
def test_metrics_lr_is_the_lr_the_step_used_with_the_policies_scale(monkeypatch, lines, every):
    monkeypatch.setattr(glue_module, "world_comm", LocalComm)
    eng = FakeEngine(every)
    eng.pdv_policy = glue_module.build_glue(eng)
    for _ in range(8):
        eng.train_batch()
    decided = 4 if every == 2 else 3  # the first agreement step from step 3 on
    expected = {s: 0.01 * (s - 1) * (0.5 if s > decided else 1.0) for s in range(1, 9)}
    assert eng.used == pytest.approx(expected)  # the scale stays on between agreement steps too
    rows = {r["step"]: r["lr"] for r in eng.pdv_policy.monitor.rows}
    assert rows == pytest.approx(eng.used)  # metrics.csv's lr column: what each step used
    assert [m for _, _, m in lines] == [f"step {decided}: policy 'tests.unit.test_policy_visible:HalveAt' applied "
                                        f"SetLearningRate(scale=0.5): lr {0.01 * decided:.4g} -> "
                                        f"{0.005 * decided:.4g} (scale on the scheduler's LR now 0.5)"]
