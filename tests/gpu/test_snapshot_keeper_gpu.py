"""GPU tier for the snapshot keeper (issue #37): a stage's state on a CUDA device staged into the keeper's
shared buffer (queued copies into page-locked memory, one synchronisation) comes back from the keeper's files
bit for bit. Skipped without CUDA (tests/conftest.py). Not yet run on hardware when written."""
import pytest
import torch

from pdv_ext.recovery.keeper import Keeper
from pdv_ext.recovery.store import HostStore

pytestmark = pytest.mark.gpu


def test_cuda_state_round_trips(tmp_path):
    torch.cuda.init()
    want = {"w": torch.randn(513, 129, device="cuda"), "m": torch.randn(77, device="cuda").bfloat16(),
            "t": torch.randn(64, 64, device="cuda").t()}
    k = Keeper()
    try:
        flat, layout = k.stage({"layer_00.pt": want})
        reply = k.write(flat, layout, root=str(tmp_path), job="j", host="h", step=1, write=True, only_first=False)
    finally:
        k.close()
    store = HostStore(str(tmp_path), "j", "h")
    store.read(1, "layer_00.pt", reply["sealed"]["layer_00.pt"]["sha256"])
    got = torch.load(store.folder(1) + "/layer_00.pt", weights_only=True)
    for name, t in want.items():
        assert torch.equal(got[name], t.cpu()), name
