"""pdv's checkpoint files cannot run code when loaded (issue #34 item 4): they hold tensors and plain values,
are loaded with `torch.load(weights_only=True)`, and a crafted file is refused with one clear error."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pdv_ext
from pdv_ext.config_base import ConfigError
from pdv_ext.integrations.deepspeed.checkpoint import layer_dir, read_meta
from pdv_ext.integrations.deepspeed.pdv_state import load_state
from pdv_ext.integrations.deepspeed.safe_io import check_plain, load_plain, save_plain


class _Payload:
    """What a crafted pickle does on load: here, create a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _crafted(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"aggregator": {"type": "mean"}, "evil": _Payload(str(marker))}, str(path))


def test_a_crafted_pdv_state_file_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    _crafted(tmp_path / "ckpt" / "step5" / "pdv_state_rank00000.pt", marker)
    engine = SimpleNamespace(global_rank=0, device="cpu")
    with pytest.raises(ConfigError) as err:
        load_state(engine, str(tmp_path / "ckpt"), "step5")
    assert not marker.exists()
    assert len(err.value.errors) == 1
    assert "pdv_state_rank00000.pt was refused" in err.value.errors[0]
    assert err.value.errors[0].startswith("load_checkpoint: ")


def test_a_crafted_layer_checkpoint_meta_is_refused(tmp_path):
    marker = tmp_path / "ran"
    _crafted(Path(layer_dir(str(tmp_path), "t")) / "meta.pt", marker)
    with pytest.raises(ConfigError, match="meta.pt was refused"):
        read_meta(str(tmp_path), "t")
    assert not marker.exists()


def test_plain_state_round_trips_and_anything_else_is_named(tmp_path):
    state = {"aggregator": {"type": "gossip", "peers": 2}, "aggregator_state": {"residual": torch.arange(4.0),
             "rng": torch.get_rng_state()}, "data": {"position": 17, "order": [3, 1, 2]}, "shares": None,
             "betas": (0.9, 0.999), "dtype": torch.bfloat16}
    path = tmp_path / "s.pt"
    save_plain(state, str(path))
    back = load_plain(str(path))
    assert back["data"] == state["data"] and back["betas"] == (0.9, 0.999) and back["dtype"] is torch.bfloat16
    assert torch.equal(back["aggregator_state"]["residual"], state["aggregator_state"]["residual"])
    import numpy as np

    with pytest.raises(TypeError, match=r"state\['data'\]\['rng'\]: a numpy.ndarray"):
        check_plain({"data": {"rng": np.zeros(3)}})
    with pytest.raises(TypeError, match=r"_Payload"):
        save_plain({"x": [1, _Payload("nowhere")]}, str(tmp_path / "never.pt"))
    assert not (tmp_path / "never.pt").exists()


def test_no_unrestricted_torch_load_in_pdv_ext():
    root = Path(pdv_ext.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "weights_only=False" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_a_client_state_that_is_not_plain_is_refused_before_anything_is_written(tmp_path):
    from pdv_ext.integrations.deepspeed import PDVPipelineEngine

    fake = SimpleNamespace()  # the refusal comes before DeepSpeed's save (which a fake engine could not do)
    with pytest.raises(ConfigError, match=r"save_checkpoint: client_state\['opt'\]: a .*_Payload"):
        PDVPipelineEngine.save_checkpoint(fake, str(tmp_path), "t", client_state={"step": 3, "opt": _Payload("x")})
    assert list(tmp_path.iterdir()) == []
