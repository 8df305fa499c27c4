"""What an older DeepSpeed of the supported range cannot carry is refused with one ConfigError naming the
release (docs/deepspeed.md, supported versions). DeepSpeed 0.16's pipeline engine sums each replica's
micro-batch gradients instead of averaging them, so unequal data shares, `rebalance` and a move that changes
the data-parallel width are refused there. Checked here against the refusal logic with the release's behaviour
switched off; the compat run (`make test-compat`) meets it on the real release (test_data_shares, test_move)."""
from types import SimpleNamespace

import pytest

from pdv_ext.config import ConfigError, PDVConfig
from pdv_ext.integrations.deepspeed import PDVPipelineEngine, internals
from pdv_ext.integrations.deepspeed import move as move_module


@pytest.fixture
def summing_release(monkeypatch):
    monkeypatch.setattr(internals, "gradients_are_micro_batch_means", lambda: False)
    monkeypatch.setattr(internals, "deepspeed_version", lambda: "0.16.9")


def _engine(**kw):
    grid = SimpleNamespace(get_data_parallel_id=lambda: 0, get_data_parallel_world_size=lambda: 2)
    return SimpleNamespace(dp_world_size=2, total_micro_batches=6, grid=grid, **kw)


def test_unequal_shares_are_refused(summing_release):
    eng = _engine()
    with pytest.raises(ConfigError, match=r"unequal shares \[5, 1\] need DeepSpeed >= 0.19.3: the pipeline engine of "
                                          r"DeepSpeed 0.16.9 sums"):
        PDVPipelineEngine.set_data_shares(eng, [5, 1])


def test_rebalance_is_refused_at_start_up(summing_release):
    eng = _engine(pdv_config=PDVConfig.model_validate({"policy": {"plugins": [{"name": "rebalance"}]}}))
    with pytest.raises(ConfigError, match=r"pdv.policy.plugins: 'rebalance' needs DeepSpeed >= 0.19.3"):
        PDVPipelineEngine._check_release(eng)
    ok = _engine(pdv_config=PDVConfig.model_validate({"policy": {"plugins": [{"name": "gns_batch_size"}]}}))
    PDVPipelineEngine._check_release(ok)  # what does not weigh replicas is not refused


def test_a_move_that_changes_the_width_is_refused(summing_release, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(internals, "num_layers", lambda m: 8)
    eng = _engine(module=SimpleNamespace(), pdv_runtime=SimpleNamespace(build={"config": {}}), reduction_grads=None,
                  train_batch_size=lambda: 24, train_micro_batch_size_per_gpu=lambda: 4,
                  aggregator=SimpleNamespace(name="mean"))
    with pytest.raises(ConfigError, match=r"rank_mapping: 2 -> 1 replicas per stage needs DeepSpeed >= 0.19.3"):
        move_module._checked_plan(eng, [0, 2, 4, 6, 8], [[0], [1], [2], [3]])
    assert move_module._checked_plan(eng, [0, 3, 8], [[0, 2], [1, 3]])["rank_mapping"] == [[0, 2], [1, 3]]


def test_a_move_of_replicas_that_differ_is_refused(summing_release, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(internals, "num_layers", lambda m: 8)
    monkeypatch.setattr(move_module, "replicas_differ", lambda engine: True)  # gossip in fp32
    eng = _engine(module=SimpleNamespace(), pdv_runtime=SimpleNamespace(build={"config": {}}), reduction_grads=None,
                  train_batch_size=lambda: 24, train_micro_batch_size_per_gpu=lambda: 4,
                  aggregator=SimpleNamespace(name="gossip"))
    with pytest.raises(ConfigError, match=r"moving replicas that hold different weights \('gossip'\) needs DeepSpeed"):
        move_module._checked_plan(eng, [0, 3, 8], [[0, 2], [1, 3]])
