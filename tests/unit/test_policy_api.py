"""Policy API: registry and plugins, config schema and cross-checks, the built-in policies' decisions."""
import pytest

from pdv_ext.config import validate_pdv
from pdv_ext.policy import POLICIES, Policy, SetAggregator, SetBatchSize, SetGossipPeers, SetLearningRate, TrainContext
from pdv_ext.policy.base import action_from_dict, build_policy, register_policy
from pdv_ext.registry import RegistryError


def errors(policy):
    return validate_pdv({"policy": policy})[1]


def test_builtins_registered_and_buildable():
    p = build_policy({"name": "gns_batch_size", "max_batch_size": 64})
    assert p.options.max_batch_size == 64 and p.plugin_name == "gns_batch_size"
    assert {"gns_batch_size", "straggler_topology", "schedule"} <= set(POLICIES.names())


def test_module_class_plugin_and_template():
    p = build_policy({"name": "launch.my_policy:PlateauLR", "patience": 2, "factor": 0.5})
    acts = [p.after_step({"step": s, "loss": 1.0}) for s in range(1, 5)]
    assert [a for step in acts for a in step] == [SetLearningRate(scale=0.5)]
    q = build_policy({"name": "launch.my_policy:PlateauLR", "patience": 2})
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict()


def test_register_policy_decorator():
    @register_policy("test_only_policy")
    class Mine(Policy):
        pass

    try:
        assert isinstance(build_policy("test_only_policy"), Mine)
        assert errors({"plugins": [{"name": "test_only_policy"}]}) == []
    finally:
        POLICIES.unregister("test_only_policy")


def test_unknown_names_and_options_name_their_key():
    errs = errors({"plugins": [{"name": "gns_batchsize"}, {"name": "schedule", "chnges": []},
                               {"name": "gns_batch_size", "max_batch_size": 0}, {"max": 1}]})
    assert any(e.startswith("pdv.policy.plugins") and "needs a 'name'" in e for e in errs)
    errs = errors({"plugins": [{"name": "gns_batchsize"}, {"name": "schedule", "chnges": []},
                               {"name": "gns_batch_size", "max_batch_size": 0}]})
    assert errs[0].startswith("pdv.policy.plugins.0.name: unknown policy 'gns_batchsize' (did you mean 'gns_batch_size'")
    assert errs[1].startswith("pdv.policy.plugins.1.chnges: unknown key (did you mean 'changes'")
    assert errs[2].startswith("pdv.policy.plugins.2.max_batch_size:")
    assert errors({"on_error": "ignore"})[0].startswith("pdv.policy.on_error")
    assert errors({"monitor": {"ema": 1.5}})[0].startswith("pdv.policy.monitor.ema")
    with pytest.raises(RegistryError):
        build_policy({"name": "no.such.module:Policy"})


def test_cross_check_unknown_aggregator():
    errs = errors({"plugins": [{"name": "straggler_topology", "gossip": {"type": "gosip", "peers": 1}},
                               {"name": "schedule", "changes": [{"step": 5, "aggregator": "adasm"}]}]})
    assert errs[0].startswith("pdv.policy.plugins.0.gossip: unknown aggregator 'gosip'")
    assert errs[1].startswith("pdv.policy.plugins.1.changes.0.aggregator: unknown aggregator 'adasm'")


def test_actions_roundtrip():
    for a in [SetBatchSize(4, None, "sqrt", "x"), SetLearningRate(lr=0.1), SetAggregator({"type": "mean"}),
              SetGossipPeers(2)]:
        assert action_from_dict(a.to_dict()) == a


def test_schedule_policy():
    p = build_policy({"name": "schedule", "changes": [
        {"step": 3, "micro_batches": 4, "lr_rule": "linear"},
        {"step": 5, "aggregator": "mean", "gossip_peers": 2, "lr": 0.1}]})
    assert p.after_step({"step": 2}) == []
    assert p.after_step({"step": 3}) == [SetBatchSize(4, None, "linear")]
    assert p.after_step({"step": 5}) == [SetLearningRate(lr=0.1), SetAggregator("mean"), SetGossipPeers(2)]


def test_straggler_policy_switches_and_recovers():
    p = build_policy({"name": "straggler_topology", "patience": 3, "recover_patience": 2})
    slow = {"compute_times": [1.0, 1.0, 3.0, 1.0]}
    ok = {"compute_times": [1.0, 1.1, 1.0, 1.0]}
    out = [p.after_step(slow) for _ in range(3)]
    assert out[:2] == [[], []] and out[2] == [SetAggregator({"type": "gossip", "peers": 1})]
    assert p.straggler == 2 and p.after_step(slow) == []
    assert p.after_step(ok) == [] and p.after_step(ok) == [SetAggregator("mean")]
    q = build_policy({"name": "straggler_topology", "mode": "peers", "patience": 1, "recover_patience": 1})
    assert q.after_step(slow) == [SetGossipPeers(1)] and q.after_step(ok) == [SetGossipPeers(2)]


def metrics(step, batch=16, gns=None, step_time=1.0, mb=2, mbs=4, dp=2):
    return {"step": step, "batch_size": batch, "gns": gns, "step_time": step_time, "micro_batches": mb,
            "micro_batch_size": mbs, "dp_size": dp}


def test_gns_batch_size_grows_with_noise_scale_and_respects_max():
    p = build_policy({"name": "gns_batch_size", "max_batch_size": 48, "interval": 5, "warmup_steps": 5,
                      "prior_overhead": 0.5})
    p.on_train_begin(TrainContext(world_size=4, dp_size=2, micro_batch_size=4, micro_batches=2, lr=0.1,
                                  extra={"stages": 2}))
    # low noise scale: a bigger batch wastes samples, no change
    assert all(p.after_step(metrics(s, gns=1.0)) == [] for s in range(1, 11))
    # high noise scale: grow, at most 2x per decision
    out = p.after_step(metrics(15, gns=1e4))
    assert out == [SetBatchSize(micro_batches=4, micro_batch_size=4, lr_rule=None)]
    assert p.after_step(metrics(16, batch=32, mb=4, gns=1e4)) == []  # within interval of the change
    for s in range(17, 30):
        out = p.after_step(metrics(s, batch=32, mb=4, gns=1e4, step_time=1.6))
        if out:
            break
    assert out == [SetBatchSize(micro_batches=6, micro_batch_size=4, lr_rule=None)]  # 48 = max


def test_gns_batch_size_fits_measured_times():
    p = build_policy({"name": "gns_batch_size", "max_batch_size": 1024, "warmup_steps": 0, "interval": 1})
    p.base_batch = 16
    p.times = {16: 1.0, 32: 2.0}  # no fixed cost: throughput flat, growing never pays
    a, b = p._fit(16, 2)
    assert a == pytest.approx(0.0, abs=1e-9) and b == pytest.approx(1 / 16)
    assert p.goodput(32, 1e3, a, b) < p.goodput(16, 1e3, a, b)


def test_gns_batch_size_does_not_fit_close_batch_sizes():
    """16 and 26 samples with noisy times (T(26) looks proportional): the prior is used until the
    measured sizes span fit_span, so the fixed cost is not fitted away."""
    p = build_policy({"name": "gns_batch_size", "warmup_steps": 0, "interval": 1, "grow": "micro_batch_size"})
    p.base_batch = 16
    p.times = {16: 0.0175, 26: 0.0270}
    a, b = p._fit(26, 1)
    assert a == pytest.approx(0.5 * 0.0270) and b == pytest.approx(0.5 * 0.0270 / 26)
    p.times[52] = 0.0400  # now 52 / 16 >= 2: least squares over the three
    a, b = p._fit(52, 1)
    assert a == pytest.approx(0.0094, rel=0.05) and b == pytest.approx(6.0e-4, rel=0.05)
