"""A collective that nothing ends gives up when in-place recovery says a peer is lost (torch_comm.set_interrupt).

Seen on the emulated cluster (#37): a survivor's gradient all-reduce went on waiting after its peers had left
for the recovery and every connection of the old world was closed; the survivors then decided without it."""
import os
import subprocess
import sys
import textwrap

import pytest

from pdv_ext.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RANK = textwrap.dedent("""
    import sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from pdv_ext.comm.torch_comm import InterruptedCollective, TorchComm, set_interrupt
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    comm = TorchComm()
    ev = threading.Event()
    set_interrupt(ev)
    t = torch.ones(4)
    comm.all_reduce(t)  # both there: as without the interrupt
    assert t.tolist() == [2.0] * 4, t
    if rank == 1:  # then takes no part in the next one (it is 'lost'), and stays until rank 0 is done
        store.wait(["done"], timedelta(seconds=30))
        sys.exit(0)
    threading.Timer(0.5, ev.set).start()
    t0 = time.monotonic()
    try:
        comm.all_reduce(t)
    except InterruptedCollective as exc:
        from pdv_ext.integrations.deepspeed.inplace import lost_peer
        print(f"gave up after {time.monotonic() - t0:.2f} s; lost_peer={lost_peer(exc)}", flush=True)
    store.set("done", "1")
""")


def _two_ranks(script: str, timeout: float) -> str:
    """Run `script` as ranks 0 and 1; both must succeed. Rank 0's last line of output."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    return outs[0][0].strip().splitlines()[-1]


@pytest.mark.timeout(120)
def test_a_collective_on_gloo_gives_up_when_the_interrupt_is_set():
    line = _two_ranks(RANK, 90)
    took = float(line.split()[3])
    assert 0.4 < took < 5.0 and line.endswith("lost_peer=True"), line


LEFT_BEHIND = textwrap.dedent("""
    import gc, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from pdv_ext.comm.torch_comm import InterruptedCollective, TorchComm, set_interrupt
    from pdv_ext.integrations.deepspeed import internals
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    comm = TorchComm(dist.new_group([0, 1]))  # (a group made without a timeout: DeepSpeed's are so)
    ev = threading.Event()
    set_interrupt(ev)
    t = torch.ones(4)
    comm.all_reduce(t)
    if rank == 1:  # alive, but takes no part in the next one (as a peer gone on to the new world)
        store.wait(["done"], timedelta(seconds=40))
        sys.exit(0)
    threading.Timer(0.3, ev.set).start()
    try:
        comm.all_reduce(t)
    except InterruptedCollective:
        pass
    t0 = time.monotonic()
    internals.forget_process_groups()
    del comm
    gc.collect()
    print(f"left behind in {time.monotonic() - t0:.2f} s", flush=True)
    store.set("done", "1")
""")


@pytest.mark.timeout(120)
def test_a_world_left_behind_with_a_collective_given_up_is_dropped_at_once():
    """After a given-up collective, the old world's groups are forgotten and their last references dropped at
    once: a gloo group's destructor waits for its queued work, which here waits on a live peer that never
    takes part (before `internals.keep_forever`: 40 s, until that peer left; in a recovery, until the group's
    30-minute timeout, while the new world waited for this rank: the stall after a recovery, docs/recovery.md)."""
    line = _two_ranks(LEFT_BEHIND, 100)
    assert line.startswith("left behind in") and float(line.split()[3]) < 5.0, line
