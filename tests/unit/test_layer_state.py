"""pdv_ext.placement.layer_state and pdv_ext.integrations.deepspeed.layer_state on their data structures, in one process: partitioned flat optimizer state
cut into whole parameters and re-cut for another partition (threads stand in for data-parallel ranks),
FP16_Optimizer's flat fp32 copies and loss scaler (DeepSpeed refuses fp16 on CPU engines, its optimizer
class builds fine), the aggregator's per-parameter state, names and layers."""
import threading
from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from torch import nn

from pdv_ext.aggregation import build_aggregator
from pdv_ext.integrations.deepspeed.layer_state import (FlatLayout, _Fragment, _int_view, apply_scaler_state,
                                                       join_aggregator_state, layers_of, layout_of, scaler_state,
                                                       split_aggregator_state)
from pdv_ext.placement.layer_state import ParamState, stages_owning
from pdv_ext.policy.data import ElasticBatches


class _ThreadAllReduce:
    """`complete` for n threads: an integer sum of everyone's buffer (what the data-parallel all-reduce does)."""

    def __init__(self, n):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

    def complete_for(self, rank):
        def complete(buf):
            self.slots[rank] = _int_view(buf).clone()
            self.barrier.wait()
            total = sum(s for s in self.slots)
            self.barrier.wait()
            _int_view(buf).copy_(total)

        return complete


def _partitioned(params, world, flat_values, states):
    """One FlatLayout per data-parallel rank over `params` laid out back to back and cut into `world` equal
    partitions (DeepSpeed's BF16 / ZeRO-1 layout, padding at the end)."""
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    part = -(-total // world)
    reducer = _ThreadAllReduce(world)
    layouts = []
    for r in range(world):
        lo, hi = r * part, (r + 1) * part
        frs, o = [], 0
        for j, n in enumerate(sizes):
            a, b = max(o, lo), min(o + n, hi)
            if a < b:
                frs.append(_Fragment(j, a - o, a - lo, b - a))
            o += n
        flat = torch.zeros(part)
        flat[: max(0, min(hi, total) - lo)] = flat_values[lo:min(hi, total)]
        base = SimpleNamespace(state={}, param_groups=[{"params": [flat]}])
        if states is not None:
            base.state[flat] = {}
            for k, v in states.items():
                if v.dim():
                    v, padded = v[lo:min(hi, total)], torch.zeros(part)
                    padded[: v.numel()] = v
                    v = padded
                base.state[flat][k] = v.clone()
        layouts.append(FlatLayout(SimpleNamespace(optimizer=base), [params], [flat], [frs],
                                  reducer.complete_for(r), lambda keys, r=r: [keys] * world))
    return layouts


def _run(fns):
    out = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fns[i]())) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_partitions_are_gathered_bit_for_bit_and_recut_for_another_width():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    names = {id(p): n for p, n in zip(params, ["0.weight", "0.bias", "1.weight"])}
    total = sum(p.numel() for p in params)
    master = torch.randn(total)
    master[4] = -0.0  # a float sum over the ranks would return +0.0
    states = {"exp_avg": torch.randn(total), "exp_avg_sq": torch.rand(total), "step": torch.tensor(7.0)}
    whole = _run([lambda l=l: l.collect(names) for l in _partitioned(params, 2, master, states)])
    for got in whole:  # both ranks hold every parameter whole
        o = 0
        for p in params:
            s = got[names[id(p)]]
            n = p.numel()
            assert s.master.shape == p.shape and torch.equal(s.master.reshape(-1), master[o:o + n])
            assert torch.equal(s.optim["exp_avg"].reshape(-1), states["exp_avg"][o:o + n])
            assert torch.equal(s.optim["exp_avg_sq"].reshape(-1), states["exp_avg_sq"][o:o + n])
            assert float(s.optim["step"]) == 7.0 and s.group == 0
            o += n
    assert torch.signbit(whole[1]["0.weight"].master.reshape(-1)[4])  # -0.0 survived
    # re-cut for 3 ranks, the parameters in another order (another stage layout): each keeps its fragments
    order = [params[2], params[0], params[1]]
    targets = _partitioned(order, 3, torch.zeros(total), None)
    for t in targets:
        t.apply(whole[0], names)
    flat = torch.cat([t.flats[0] for t in targets])
    state = {k: torch.cat([t.base.state[t.flats[0]][k] for t in targets]) for k in ("exp_avg", "exp_avg_sq")}
    o = 0
    for p in order:
        n, s = p.numel(), whole[0][names[id(p)]]
        assert torch.equal(flat[o:o + n], s.master.reshape(-1))
        assert torch.equal(state["exp_avg"][o:o + n], s.optim["exp_avg"].reshape(-1))
        o += n
    assert all(float(t.base.state[t.flats[0]]["step"]) == 7.0 for t in targets)


#: what FP16_Optimizer reads of its engine (DeepSpeed <= 0.17.0 reads `pipeline_parallelism` from it)
_NO_ENGINE = SimpleNamespace(pipeline_parallelism=False)


def _scaler_of(opt):
    """FP16_Optimizer's scale state: `loss_scale_config` (DeepSpeed >= 0.19), on the optimizer itself before."""
    return getattr(opt, "loss_scale_config", None) or getattr(opt, "loss_scaler", None) or opt


def test_fp16_optimizer_flat_copies_and_loss_scaler_travel():
    torch.manual_seed(1)
    old = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    opt = FP16_Optimizer(torch.optim.AdamW(old.parameters(), lr=1e-3), deepspeed=_NO_ENGINE, dynamic_loss_scale=True,
                         verbose=False)
    flat = opt.fp32_groups_flat[0]
    flat.data.copy_(torch.randn(flat.numel()))  # masters that are not the fp16 weights
    opt.optimizer.state[flat] = {"step": torch.tensor(3.0), "exp_avg": torch.randn(flat.numel()),
                                 "exp_avg_sq": torch.rand(flat.numel())}
    cfg = _scaler_of(opt)
    cfg.cur_scale, cfg.cur_iter, cfg.last_overflow_iter = 1024.0, 57, 41
    engine = SimpleNamespace(optimizer=opt, module=old)
    names = {id(p): n for n, p in old.named_parameters()}
    whole = layout_of(engine).collect(names)
    o = 0
    for n, p in old.named_parameters():
        k = p.numel()
        assert torch.equal(whole[n].master.reshape(-1), flat[o:o + k])
        assert torch.equal(whole[n].optim["exp_avg"].reshape(-1), opt.optimizer.state[flat]["exp_avg"][o:o + k])
        o += k
    scaler = scaler_state(opt)
    assert scaler["values"]["cur_scale"] == 1024.0 and scaler["values"]["cur_iter"] == 57
    # a new stage holding only the second layer, named as in the pipeline (layer 1)
    new = nn.Sequential(nn.Identity(), nn.Linear(4, 2)).half()
    new_opt = FP16_Optimizer(torch.optim.AdamW(new.parameters(), lr=1e-3), deepspeed=_NO_ENGINE,
                             dynamic_loss_scale=True, verbose=False)
    layout_of(SimpleNamespace(optimizer=new_opt, module=new)).apply(whole, {id(p): n for n, p in new.named_parameters()})
    apply_scaler_state(new_opt, scaler)
    nflat = new_opt.fp32_groups_flat[0]
    assert torch.equal(nflat, torch.cat([whole["1.weight"].master.reshape(-1), whole["1.bias"].master.reshape(-1)]))
    assert torch.equal(new_opt.optimizer.state[nflat]["exp_avg_sq"],
                       torch.cat([whole["1.weight"].optim["exp_avg_sq"].reshape(-1),
                                  whole["1.bias"].optim["exp_avg_sq"].reshape(-1)]))
    assert float(new_opt.optimizer.state[nflat]["step"]) == 3.0
    c = _scaler_of(new_opt)
    assert (c.cur_scale, c.cur_iter, c.last_overflow_iter) == (1024.0, 57, 41)


def test_zero_loss_scaler_round_trip():
    src = SimpleNamespace(loss_scaler=DynamicLossScaler(2 ** 16, 1000, 1, 2, False))
    src.loss_scaler.cur_scale, src.loss_scaler.cur_hysteresis, src.loss_scaler.cur_iter = 512.0, 1, 99
    dst = SimpleNamespace(loss_scaler=DynamicLossScaler(2 ** 16, 1000, 1, 2, False))
    apply_scaler_state(dst, scaler_state(src))
    assert (dst.loss_scaler.cur_scale, dst.loss_scaler.cur_hysteresis, dst.loss_scaler.cur_iter) == (512.0, 1, 99)
    apply_scaler_state(SimpleNamespace(), scaler_state(src))  # bf16 / fp32 run: no scaler, nothing to do


class _Stage(nn.Module):
    """Parameters named like a pipeline stage's (global layer indices)."""

    def __init__(self, layers):
        super().__init__()
        for i, n in layers:
            self.add_module(str(i), nn.Linear(n, n))


def test_aggregator_state_is_cut_by_parameter_and_joined_in_another_order():
    old = _Stage([(2, 2), (3, 3)])
    agg = build_aggregator({"type": "gossip", "peers": 1})
    n = sum(p.numel() for p in old.parameters())
    agg.residual, agg.applied, agg.step = torch.arange(n, dtype=torch.float32), -torch.arange(n, dtype=torch.float32), 5
    state, per = split_aggregator_state(SimpleNamespace(module=old, aggregator=agg, reduce_mode="engine", optimizer=None))
    assert state["step"] == 5 and "residual" not in state and set(per) == {n for n, _ in old.named_parameters()}
    assert torch.equal(per["3.weight"]["residual"], torch.arange(6, 15, dtype=torch.float32))
    # a new stage: layer 1 (new: zeros), layer 3 (kept), not layer 2
    new = _Stage([(1, 1), (3, 3)])
    fresh = build_aggregator({"type": "gossip", "peers": 1})
    joined = join_aggregator_state(SimpleNamespace(module=new, aggregator=fresh, reduce_mode="engine", optimizer=None), state, per)
    assert torch.equal(joined["residual"], torch.cat([torch.zeros(2), torch.arange(6, 18, dtype=torch.float32)]))
    assert torch.equal(joined["applied"][2:], -torch.arange(6, 18, dtype=torch.float32))
    fresh.load_state_dict(joined)
    assert fresh.step == 5 and fresh.residual.numel() == sum(p.numel() for p in new.parameters())
    with pytest.raises(ValueError, match="'residual' has 3 elements"):
        agg.residual = torch.zeros(3)
        split_aggregator_state(SimpleNamespace(module=old, aggregator=agg, reduce_mode="engine", optimizer=None))


def test_names_map_to_layers_and_stages():
    specs = [LayerSpec(nn.Linear, 2, 2), TiedLayerSpec("emb", nn.Linear, 2, 2), LayerSpec(nn.Linear, 2, 2),
             TiedLayerSpec("emb", nn.Linear, 2, 2)]
    module = SimpleNamespace(_layer_specs=specs)
    assert layers_of(module, "2.weight") == [2]
    assert layers_of(module, "tied_modules.emb.weight") == [1, 3]
    assert stages_owning([1, 3], [0, 2, 4]) == [0, 1] and stages_owning([2], [0, 1, 3, 4]) == [1]
    with pytest.raises(ValueError, match="'loss_fn.weight' is not a pipeline layer's parameter"):
        layers_of(module, "loss_fn.weight")


def test_param_state_round_trips_through_named_parts():
    st = ParamState(weight=torch.ones(2, dtype=torch.bfloat16), master=torch.ones(2), group=1,
                    optim={"exp_avg": torch.zeros(2), "step": torch.tensor(4.0), "note": 3},
                    aggregator={"residual": torch.ones(2), "v": None})
    back = ParamState.from_parts(st.tensors(), st.scalars())
    assert back.group == 1 and back.optim["note"] == 3 and back.aggregator["v"] is None
    assert torch.equal(back.optim["step"], st.optim["step"]) and back.weight.dtype == torch.bfloat16
    assert back.nbytes() == st.nbytes() == 2 * 2 + 2 * 4 + 2 * 4 + 4 + 2 * 4


def test_elastic_batches_follow_a_replica_to_another_width():
    data = (torch.arange(100),)
    two = [ElasticBatches(data, 2, d, 2, shuffle=False) for d in range(2)]
    for _ in range(3):  # 3 micro-batches per replica: positions 0..11
        for it in two:
            next(it)
    one = ElasticBatches(data, 2, 0, 1, shuffle=False)
    one.load_state_dict(two[0].state_dict())
    one.set_replica(0, 1)
    assert one.position == 12 and next(one)[0].tolist() == [12, 13] and next(one)[0].tolist() == [14, 15]
    two[1].set_replica(1, 4)  # the same rank now serves replica 1 of 4
    assert next(two[1])[0].tolist() == [14, 15]
