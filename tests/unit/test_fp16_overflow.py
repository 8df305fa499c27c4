"""fp16 loss scaling with aggregators that would not pass an overflow on (docs/deepspeed.md): the replicas
agree, and on an overflow anywhere every replica gets inf gradients (DeepSpeed's scaler then skips the step
and lowers the scale on all of them) while the aggregator and its state are left alone. DeepSpeed has no
fp16 on CPU, so the engine's path is called here on a stand-in engine over in-process ranks."""
import types

import pytest
import torch

from pdv_ext.aggregation import build_aggregator
from pdv_ext.aggregation.faults import loss_scale_overflow
from pdv_ext.integrations.deepspeed import PDVPipelineEngine
from tests.threadcomm import run_threads


def _grads(rank, bad):
    g = [torch.full((5, 3), 0.1 * (rank + 1), dtype=torch.float16), torch.ones(4, dtype=torch.float16)]
    if rank == bad:
        g[0][2, 1] = float("inf")
    return g


@pytest.mark.parametrize("spec", [{"type": "median"}, {"type": "trimmed_mean", "b": 1},
                                  {"type": "gossip", "peers": 1, "ratio": 0.5}])
@pytest.mark.parametrize("bad", [None, 2])
def test_an_overflow_on_one_replica_skips_the_step_on_all(spec, bad):
    def fn(comm):
        agg = build_aggregator(dict(spec))
        engine = types.SimpleNamespace(fp16_enabled=lambda: True, aggregator=agg, grad_hooks=[], dp_comm=comm,
                                       group_samples=lambda: None)
        grads = _grads(comm.rank, bad)
        out = PDVPipelineEngine.aggregate_gradients(engine, grads)
        return out, agg.step, getattr(agg, "residual", None)

    res = run_threads(4, fn)
    for out, steps, residual in res:
        if bad is None:
            assert all(torch.isfinite(t).all() for t in out) and steps == 1
        else:  # every replica: all inf, and the aggregator never ran (gossip's residual untouched)
            assert all(torch.isinf(t).all() for t in out) and steps == 0 and residual is None


def test_mean_and_adasum_carry_the_overflow_themselves():
    """No extra agreement for them: the inf reaches every replica through the reduction, as in DeepSpeed."""
    for name in ("mean", "adasum"):
        assert loss_scale_overflow(build_aggregator({"type": name}), [torch.full((2,), float("inf"))], None) is False
