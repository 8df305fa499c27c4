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
        with open(f"/proc/{k.proc.pid}/maps") as f:  # it made loadable files without torch (~1.4 s of CPU)
            assert "libtorch" not in f.read()
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


def _written(k, root, host, step, files):
    """`files` ({name: tensor}) written by keeper `k` into `host`'s store at `step`; their seal entries."""
    return k.write(*k.stage({n: {"t": t} for n, t in files.items()}), root=root, job="j", host=host, step=step,
                   write=True, only_first=False)["sealed"]


def test_a_copy_goes_keeper_to_keeper_and_is_collected_whole(tmp_path):
    """The copy for another host: the sender's keeper sends the files it has just written (from memory, not
    read back from its host's store); the receiver's keeper writes them into its own and hands their seal
    entries to its worker."""
    root = str(tmp_path)
    a, b = Keeper(), Keeper()
    try:
        sent = _written(a, root, "hostA", 3, {"layer_00.pt": torch.randn(1000), "layer_01.pt": torch.randn(10)})
        port = b.request({"op": "listen", "root": root, "job": "j", "host": "hostB", "token": "t0k",
                          "timeout": 30.0})["port"]
        kept = {n: HostStore(root, "j", "hostA").read_raw(3, n) for n in sent}
        for n in sent:  # gone from the store: what is sent is the write's own bytes
            os.unlink(os.path.join(HostStore(root, "j", "hostA").folder(3), n))
        pushed = a.request({"op": "push", "root": root, "job": "j", "host": "hostA", "step": 3,
                            "names": sorted(sent), "to": ["127.0.0.1", port], "token": "t0k", "sender": 0,
                            "timeout": 30.0})
        got = b.request({"op": "collect", "step": 3, "senders": [0], "timeout": 30.0})["sealed"]
    finally:
        a.close()
        b.close()
    assert got == sent and pushed["bytes"] == sum(e["bytes"] for e in sent.values())
    there = HostStore(root, "j", "hostB")
    for name, e in sent.items():
        assert there.read(3, name, e["sha256"]) == kept[name]


def test_a_copy_without_the_token_is_not_taken_and_a_missing_one_is_an_error(tmp_path):
    root = str(tmp_path)
    a, b = Keeper(), Keeper()
    try:
        sent = _written(a, root, "hostA", 1, {"layer_00.pt": torch.randn(5)})
        port = b.request({"op": "listen", "root": root, "job": "j", "host": "hostB", "token": "right",
                          "timeout": 30.0})["port"]
        with pytest.raises(RuntimeError, match="keeper failed \\(push\\)"):  # the receiver hangs up on it
            a.request({"op": "push", "root": root, "job": "j", "host": "hostA", "step": 1, "names": sorted(sent),
                       "to": ["127.0.0.1", port], "token": "wrong", "sender": 0, "timeout": 30.0})
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="from rank\\(s\\) \\[0\\] did not come within 1 s"):
            b.request({"op": "collect", "step": 1, "senders": [0], "timeout": 1.0})
        assert time.monotonic() - t0 < 10
    finally:
        a.close()
        b.close()
    assert not os.path.exists(os.path.join(HostStore(root, "j", "hostB").folder(1), "layer_00.pt"))


def test_a_keeper_waiting_for_a_copy_leaves_when_its_worker_gives_up(tmp_path):
    """A snapshot abandoned (a peer lost) closes its keeper, which may be waiting for that peer's copy: it
    leaves at once, not at the end of the wait."""
    b = Keeper()
    b.request({"op": "listen", "root": str(tmp_path), "job": "j", "host": "hostB", "token": "t", "timeout": 30.0})
    import pickle

    pickle.dump({"op": "collect", "step": 2, "senders": [0], "timeout": 300.0}, b.proc.stdin)
    b.proc.stdin.flush()
    time.sleep(0.5)
    t0 = time.monotonic()
    b.proc.stdin.close()  # the worker gave the snapshot up: end of the pipe
    assert b.proc.wait(timeout=20) == 0 and time.monotonic() - t0 < 5


def test_a_snapshot_of_the_same_structure_reuses_the_pickles_and_a_changed_value_does_not(tmp_path):
    """Under one plan every step's state has the same structure: the pickles of the last snapshot are reused
    (only the tensors' bytes change). Any other value, or the same value of another type, pickles again; the
    files always load with the staged step's values."""
    def state(step, lr):
        return {"layer_00.pt": {"w": {"tensors": {"weight": torch.full((3, 2), float(step))},
                                      "scalars": {"lr": lr, "step": step}, "replicas": [None]}}}

    k = Keeper()
    try:
        staged = []
        for step, lr in ((1, 0.5), (2, 0.5), (3, 0.25), (4, 0.25), (5, 1), (6, 1)):
            pickles, spans = k.stage(state(step, lr))
            reply = k.write(pickles, spans, root=str(tmp_path), job="j", host="h", step=step, write=True,
                            only_first=False)
            staged.append(pickles)
            got = torch.load(HostStore(str(tmp_path), "j", "h").folder(step) + "/layer_00.pt", weights_only=True)
            assert reply["sealed"]["layer_00.pt"]["bytes"] > 0
            assert torch.equal(got["w"]["tensors"]["weight"], torch.full((3, 2), float(step)))
            assert got["w"]["scalars"] == {"lr": lr, "step": step} and type(got["w"]["scalars"]["lr"]) is type(lr)
    finally:
        k.close()
    # the step count is a scalar here, so each step pickles again; the same state twice reuses them
    assert all(a is not b for a, b in zip(staged, staged[1:]))
    k = Keeper()
    try:
        first, _ = k.stage(state(7, 0.5))
        again, _ = k.stage(state(7, 0.5))
        other_type, _ = k.stage(state(7, 0.5 + 0j))  # equal to 0.5, of another type
        int_lr, _ = k.stage(state(7, 1))
        float_lr, _ = k.stage(state(7, 1.0))
    finally:
        k.close()
    assert again is first and other_type is not first
    assert float_lr is not int_lr  # 1 == 1.0, but their pickles differ
    w = torch.ones(2)
    k = Keeper()
    try:  # a tensor of another shape or dtype (the layout) pickles again
        a, _ = k.stage({"layer_00.pt": {"t": w}})
        b, _ = k.stage({"layer_00.pt": {"t": torch.ones(3)}})
        c, _ = k.stage({"layer_00.pt": {"t": w.double()}})
        d, _ = k.stage({"layer_00.pt": {"t": w * 2}})
    finally:
        k.close()
    assert b is not a and c is not b and d is not c  # (d: only the last snapshot's pickles are kept)


def test_the_copies_for_other_hosts_go_marked_as_background_traffic():
    """The keepers' copies (`push`) connect through `background_socket`: DSCP CS1 in the IP header, which a
    network with QoS (and `pdv emulate`'s links) serves after the training's own traffic."""
    import socket

    from pdv_ext.recovery import keeper

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        with keeper.background_socket(("127.0.0.1", srv.getsockname()[1]), 10.0) as sock:
            assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == keeper.BACKGROUND_TOS == 0x20
            if hasattr(socket, "SO_PRIORITY"):
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY) == keeper.TC_PRIO_BULK
    finally:
        srv.close()


def test_push_sends_over_a_background_socket(tmp_path, monkeypatch):
    from pdv_ext.recovery import keeper

    used, original = [], keeper.background_socket
    monkeypatch.setattr(keeper, "background_socket", lambda to, timeout: used.append(to) or original(to, timeout))
    copies = keeper.Copies(HostStore(str(tmp_path), "j", "hostB"), "t", 10.0)
    sent = keeper.push(HostStore(str(tmp_path), "j", "hostA"), 1, ["layer_00.pt"], ("127.0.0.1", copies.port), "t",
                       0, 10.0, {(1, "layer_00.pt"): b"abc"})
    assert sent == 3 and used == [("127.0.0.1", copies.port)]
    assert HostStore(str(tmp_path), "j", "hostB").read_raw(1, "layer_00.pt") == b"abc"
