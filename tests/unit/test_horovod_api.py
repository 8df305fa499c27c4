"""pdv_ext.horovod pieces that need no running Horovod job (the rest runs under horovodrun in
tests/integration/test_horovod_*.py)."""
import pytest

hvd = pytest.importorskip("horovod.torch")

from pdv_ext.bench._horovod_timing import layer_sizes  # noqa: E402
from pdv_ext.config import check_file, load_pdv  # noqa: E402
from pdv_ext.integrations.horovod import PDVOptimizerType, resolve_aggregation  # noqa: E402


def test_resolve_aggregation_follows_op():
    assert resolve_aggregation(None, None, hvd) == "mean"
    assert resolve_aggregation(None, hvd.Average, hvd) == "mean"
    assert resolve_aggregation(None, hvd.Adasum, hvd) == "adasum"  # ours: any backend and rank count
    assert resolve_aggregation(None, hvd.Sum, hvd) == hvd.Sum  # native
    assert resolve_aggregation({"type": "gossip"}, hvd.Average, hvd) == {"type": "gossip"}


def test_aggregation_and_op_conflict():
    with pytest.raises(ValueError, match="not both"):
        resolve_aggregation("adasum", hvd.Sum, hvd)


def test_whole_pdv_config_gives_its_aggregation():
    cfg = load_pdv({"aggregation": {"type": "gossip", "peers": 1}})
    spec = resolve_aggregation(cfg, None, hvd)
    assert spec.type == "gossip" and spec.options == {"peers": 1}


def test_example_config_is_valid_and_top_level():
    assert check_file("launch/configs/horovod.yaml") == []
    cfg = load_pdv("launch/configs/horovod.yaml")
    assert cfg.aggregation.type == "mean" and [p["name"] for p in cfg.policy.plugins] == ["gns_batch_size", "schedule"]


def test_optimizer_marker_matches_only_ours():
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert not isinstance(opt, PDVOptimizerType)
    opt._pdv_distributed = True
    assert isinstance(opt, PDVOptimizerType)


def test_comm_needs_init():
    from pdv_ext.comm import HorovodComm

    if hvd.is_initialized():
        pytest.skip("Horovod already initialised in this process")
    with pytest.raises(RuntimeError, match="hvd.init"):
        HorovodComm()


def test_layer_sizes_total():
    sizes = layer_sizes(64)
    assert sum(sizes) * 4 == 64 * 2 ** 20 and min(sizes) > 0


def test_comm_byte_views_of_any_layout():
    """HorovodComm moves bytes: a one-element piece of a matrix column counts as contiguous but has a
    stride other than 1 (view(torch.uint8) refused it at 4 ranks); it is viewed in place now, and a
    non-contiguous tensor is copied."""
    import torch

    from pdv_ext.comm.horovod_comm import _bytes, _flat_view

    col = torch.arange(12.0).reshape(4, 3)[:, 1]
    piece = col[2:3]
    assert piece.is_contiguous() and piece.stride() == (3,)
    v = _flat_view(piece)
    assert v is not None and v.data_ptr() == piece.data_ptr()
    v.view(torch.uint8).copy_(torch.tensor([99.0]).view(torch.uint8))
    assert col.tolist() == [1.0, 4.0, 99.0, 10.0]
    assert _flat_view(col) is None and torch.equal(_bytes(col).view(torch.float32), col)
    assert _bytes(torch.empty(0, 3)).numel() == 0
    assert torch.equal(_bytes(torch.ones(2, dtype=torch.bfloat16)).view(torch.bfloat16), torch.ones(2, dtype=torch.bfloat16))


def test_elastic_state_tensors_follow_the_ranks_device():
    """Aggregator state broadcast from rank 0 unpickles onto rank 0's GPU index: it is moved to this rank's
    parameters' device before loading ("meta" plays this rank's GPU)."""
    import torch

    from pdv_ext.integrations.horovod import _on_device

    state = {"step": 3, "residual": torch.ones(4), "parts": [torch.zeros(2), (torch.ones(1), "x")]}
    moved = _on_device(state, torch.device("meta"))
    assert moved["step"] == 3 and moved["residual"].device.type == "meta"
    assert moved["parts"][0].device.type == "meta" and moved["parts"][1][0].device.type == "meta"
    assert moved["parts"][1][1] == "x" and isinstance(moved["parts"][1], tuple)
    assert _on_device(state, None) is state
