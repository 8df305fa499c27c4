"""follow_rebuild: parameters taken before a re-partition point at the rebuilt layers afterwards."""
import pytest
import torch
from torch import nn

from pdv_ext.config_base import ConfigError
from pdv_ext.integrations.deepspeed.engine import follow_rebuild, parameter_names


def stage(indices):
    """A stand-in for a pipeline stage: layers named by their global index, as DeepSpeed names them."""
    m = nn.Module()
    for i in indices:
        m.add_module(str(i), nn.Linear(3, 3))
    return m


def rebuild(m, indices):
    for name in list(m._modules):
        del m._modules[name]
    for i in indices:
        m.add_module(str(i), nn.Linear(3, 3))


def test_full_list_follows_the_new_layers_including_arrivals():
    m = stage([0, 1])
    params = list(m.parameters())
    before = parameter_names(m)
    rebuild(m, [0, 1, 2])
    out = follow_rebuild(m, before, params)
    assert [id(p) for p in out] == [id(p) for p in m.parameters()]


def test_untouched_module_returns_the_same_object():
    m = stage([0])
    params = list(m.parameters())
    assert follow_rebuild(m, parameter_names(m), params) is params


def test_groups_map_by_name_and_arrivals_must_be_covered():
    m = stage([0, 1])
    groups = [{"params": list(m._modules["0"].parameters()), "weight_decay": 0.0},
              {"params": list(m._modules["1"].parameters())}]
    before = parameter_names(m)
    rebuild(m, [1])  # layer 0 left, nothing arrived
    out = follow_rebuild(m, before, groups)
    assert out[0]["params"] == [] and out[0]["weight_decay"] == 0.0
    assert [id(p) for p in out[1]["params"]] == [id(p) for p in m._modules["1"].parameters()]
    before = parameter_names(m)
    rebuild(m, [1, 2])  # layer 2 arrived: in no group
    with pytest.raises(ConfigError, match=r"model_parameters: .*2\.weight"):
        follow_rebuild(m, before, [{"params": list(m._modules["1"].parameters())}])


def test_optimizer_groups_are_updated_in_place():
    m = stage([0, 1])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = parameter_names(m)
    rebuild(m, [1, 2])
    follow_rebuild(m, before, None, opt)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in m.parameters()]
    x = torch.randn(2, 3)
    loss = m._modules["2"](m._modules["1"](x)).sum()
    loss.backward()
    w = m._modules["2"].weight.detach().clone()
    opt.step()
    assert not torch.equal(w, m._modules["2"].weight)  # the live weights train
