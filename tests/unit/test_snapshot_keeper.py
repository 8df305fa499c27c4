"""The snapshot keeper (pdv_ext.recovery.keeper): what a worker stages into the shared buffer comes back from
the keeper's files as the same tensors and values (any dtype, shape, layout), loadable with weights_only; its
errors reach the worker; it leaves nothing in /dev/shm and dies with its worker."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pdv_ext.recovery.keeper import Keeper
from pdv_ext.recovery.store import HostStore

pytestmark = pytest.mark.timeout(120)


def test_staged_state_round_trips(tmp_path):
    w = torch.randn(6, 5)
    obj = {"layer_00.pt": {"w": {"tensors": {"weight": w.t(),  # not contiguous
                                             "exp_avg": torch.randn(7, dtype=torch.bfloat16),
                                             "step": torch.tensor(3.0), "empty": torch.empty(0, 4),
                                             "mask": torch.tensor([True, False])},
                                 "scalars": {"step": 3, "betas": (0.9, 0.99), "name": "adam"},
                                 "replicas": [None]}},
           "layer_01.pt": {"b": {"tensors": {"bias": torch.arange(3, dtype=torch.int64)}, "scalars": {},
                                 "replicas": [None]}}}
    k = Keeper()
    try:
        flat, layout = k.stage(obj)
        reply = k.write(flat, layout, root=str(tmp_path), job="j", host="h", step=4, write=True, only_first=False)
        assert k.path and not os.path.exists(k.path)  # mapped by both: its name is gone
        reply2 = k.write(*k.stage(obj), root=str(tmp_path), job="j", host="h", step=5, write=True,
                         only_first=True)
    finally:
        k.close()
    assert sorted(reply["sealed"]) == ["layer_00.pt", "layer_01.pt"]
    assert sorted(reply2["sealed"]) == ["layer_00.pt"]  # the fault injection's "one file written"
    store = HostStore(str(tmp_path), "j", "h")
    for name, want in obj.items():
        data = store.read(4, name, reply["sealed"][name]["sha256"])
        got = torch.load(store.folder(4) + "/" + name, weights_only=True)
        assert len(data) == reply["sealed"][name]["bytes"]
        for p, e in want.items():
            assert got[p]["scalars"] == e["scalars"] and got[p]["replicas"] == e["replicas"]
            for t, v in e["tensors"].items():
                assert got[p]["tensors"][t].dtype == v.dtype and torch.equal(got[p]["tensors"][t], v), (name, t)


def test_keeper_errors_reach_the_worker(tmp_path):
    blocker = tmp_path / "root"
    blocker.write_text("a file where the keeper wants a folder")
    k = Keeper()
    try:
        with pytest.raises(RuntimeError, match="snapshot keeper failed"):
            k.write(*k.stage({"layer_00.pt": {"t": torch.ones(2)}}), root=str(blocker), job="j", host="h", step=1,
                    write=True, only_first=False)
    finally:
        k.close()


def test_keeper_dies_with_its_worker(tmp_path):
    code = textwrap.dedent("""
        import os, sys, torch
        from pdv_ext.recovery.keeper import Keeper
        k = Keeper()
        k.write(*k.stage({"layer_00.pt": {"t": torch.ones(2)}}), root=sys.argv[1], job="j", host="h", step=1,
                write=True, only_first=False)
        print(k.proc.pid, os.getpid(), flush=True)
        os._exit(9)  # killed: no close()
    """)
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    pid, worker = map(int, p.stdout.split()[:2])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail(f"keeper {pid} outlived its worker")
    if os.path.isdir("/dev/shm"):  # its shared buffer went with the two processes
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"pdv-keeper-{worker}-")]
