"""The survivors' agreement of in-place recovery (pdv_ext.recovery.inplace) over a real TCPStore."""
import os
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from pdv_ext.config_base import ConfigError
from pdv_ext.recovery.inplace import NotASurvivor, agree, connect, parse_address
from pdv_ext.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def server():
    port = free_port()
    master = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield f"127.0.0.1:{port}"
    del master


def _run(address, ranks, world, settle, delays=None):
    out, errs = {}, {}

    def one(r):
        import time
        time.sleep((delays or {}).get(r, 0.0))
        try:
            out[r] = agree(connect(address, "job/e1/"), 1, r, world, settle)
        except NotASurvivor as exc:
            errs[r] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out, errs


def test_the_survivors_agree_on_who_is_left(server):
    out, errs = _run(server, [0, 1, 3], world=4, settle=0.5)  # rank 2 died
    assert not errs and out == {0: [0, 1, 3], 1: [0, 1, 3], 3: [0, 1, 3]}


def test_everyone_there_decides_at_once(server):
    import time

    t = time.monotonic()
    out, _ = _run(server, [0, 1], world=2, settle=5.0)
    assert out == {0: [0, 1], 1: [0, 1]} and time.monotonic() - t < 3.0  # not the settle time


def test_a_rank_late_for_the_decision_leaves(server):
    out, errs = _run(server, [0, 1, 2], world=4, settle=0.3, delays={2: 1.5})
    assert out == {0: [0, 1], 1: [0, 1]} and set(errs) == {2}
    assert "decided without it" in str(errs[2])


def test_each_epoch_and_generation_has_its_own_keys(server):
    """A decision left by an earlier life of the job (another epoch) or generation binds nobody else."""
    connect(server, "job/e1/").set("g1/decision", "[0]")
    with pytest.raises(NotASurvivor):
        agree(connect(server, "job/e1/"), 1, 1, 2, 0.2)  # the same epoch and generation: bound by it
    out = {}
    assert agree(connect(server, "job/e1/"), 2, 0, 1, 0.2) == [0]  # the next generation starts clean
    t = threading.Thread(target=lambda: out.setdefault(1, agree(connect(server, "job/e2/"), 1, 1, 2, 1.0)))
    t.start()
    out[0] = agree(connect(server, "job/e2/"), 1, 0, 2, 1.0)  # another epoch starts clean
    t.join(10)
    assert out == {0: [0, 1], 1: [0, 1]}


@pytest.mark.parametrize("bad", ["localhost", ":29400", "host:port", "host:0", "host:70000"])
def test_a_bad_store_address_names_the_key(bad):
    with pytest.raises(ConfigError, match="pdv.snapshots.store"):
        parse_address(bad)
    assert parse_address("10.0.0.1:29400") == ("10.0.0.1", 29400)


def test_the_lost_agents_are_checked_into_torchruns_exit_barrier(server):
    """torch's own exit barrier (elastic/utils/store.barrier, as SimpleElasticAgent._exit_barrier calls it, on the
    rendezvous round's prefix) lets the two surviving agents of four go once the two lost ones are checked in;
    without that it waits out its timeout."""
    import base64
    import pickle
    import time

    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState
    from torch.distributed.elastic.utils import store as store_util

    from pdv_ext.recovery.inplace import EXIT_BARRIER_PREFIX, fill_exit_barrier, rendezvous_round

    host, port = parse_address(server)
    raw = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    state = _RendezvousState()
    state.round = 3
    raw.set("torch.rendezvous.job7", base64.b64encode(pickle.dumps(state)).decode())
    assert rendezvous_round(raw, "job7") == 3

    def agents(n, timeout):
        errs = []

        def one():  # an agent: a store client of its own (a TCPStore client is not for two threads)
            own = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
            try:
                store_util.barrier(PrefixStore(f"torch.rendezvous.job7.{state.round}", own), world_size=4,
                                   key_prefix=EXIT_BARRIER_PREFIX, barrier_timeout=timeout)
            except Exception as exc:  # noqa: BLE001
                errs.append(exc)

        ts = [threading.Thread(target=one) for _ in range(n)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        return errs, time.monotonic() - t0

    errs, _ = agents(2, timeout=1.0)  # nobody filled in the lost two: the barrier times out
    assert len(errs) == 2
    state.round = 4
    raw.set("torch.rendezvous.job7", base64.b64encode(pickle.dumps(state)).decode())
    fill_exit_barrier(raw, "job7", lost_agents=2, world_agents=4)
    errs, took = agents(2, timeout=20.0)
    assert not errs and took < 5.0


def test_only_what_a_lost_peer_raises_starts_a_recovery():
    from pdv_ext.integrations.deepspeed.inplace import lost_peer

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:5339: "
                        "Connection reset by peer")
    assert lost_peer(gloo) and lost_peer(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                                                      "waiting 60000ms for recv operation to complete"))
    assert not lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not lost_peer(ValueError("Connection reset"))  # not what a collective raises
    assert not lost_peer(KeyError("labels"))


def test_a_silent_rank_is_not_waited_for_a_computing_one_is(server):
    """With heartbeats: the rank whose heartbeat stopped is decided without after ~1.5 s, not settle_s; a rank
    that beats on but reports late (it was computing) is waited for."""
    import time

    hb = connect(server, "job/e3/")
    for u in range(3):
        hb.add(f"hb/{u}", 1)
    stop = threading.Event()

    def beat(u):  # rank 2 is alive: its heartbeat moves
        while not stop.is_set():
            time.sleep(0.2)
            own.add(f"hb/{u}", 1)

    own = connect(server, "job/e3/")
    t = threading.Thread(target=beat, args=(2,))
    t.start()
    try:
        out = {}
        late = threading.Thread(target=lambda: (time.sleep(2.5), out.setdefault(
            2, agree(connect(server, "job/e3/"), 1, 2, 4, 20.0, uids=[0, 1, 2, 3]))))
        late.start()
        t0 = time.monotonic()
        ths = [threading.Thread(target=lambda r=r: out.setdefault(
            r, agree(connect(server, "job/e3/"), 1, r, 4, 20.0, uids=[0, 1, 2, 3]))) for r in (0, 1)]
        for th in ths:
            th.start()
        for th in ths + [late]:
            th.join(30)
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join(5)
    assert out == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}  # rank 3 silent: not waited for; rank 2 waited for
    assert 2.0 < took < 10.0  # not the 20 s settle


HEARTBEATS_AT_EXIT = """
import time
from datetime import timedelta
from torch.distributed import TCPStore
from pdv_ext.recovery.inplace import Heartbeat
from pdv_ext.spawn import free_port
port = free_port()
server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
beats = [Heartbeat(f"127.0.0.1:{port}", "t/", u, [0, 1, 2, 3], lambda u: None, interval_s=0.0) for u in range(4)]
time.sleep(0.3)
"""


def test_a_process_with_heartbeats_running_exits_cleanly():
    """The heartbeat threads live until the process ends: each is stopped and joined before the interpreter
    finalizes. Torn down inside a store call instead, the process aborted (-6) at the end of a job that had
    trained to the end (every run of this script did before the fix)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": ROOT}
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", HEARTBEATS_AT_EXIT], env=env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr[-2000:]


def test_a_rank_that_reports_and_dies_is_left_out_in_the_next_generation(server):
    """Rank 2 reports (its host's link dropped: it saw the error first) and dies with its host before the new
    world forms. `confirm` says no on both live ranks (rank 2 never says it is ready, its heartbeat is still),
    and they agree again in generation 2 without it: the same world on both, instead of a new process group
    waiting for rank 2 to connect (the emulated host loss that hung until the emulator's timeout)."""
    import time

    from pdv_ext.recovery.inplace import survivors

    hb = connect(server, "job/e5/")
    for u in range(3):
        hb.add(f"hb/{u}", 1)
    hb.set("g1/alive/2", "1")  # rank 2's report; then nothing from it
    stop = threading.Event()
    beater = connect(server, "job/e5/")

    def beat():  # ranks 0 and 1 live
        while not stop.is_set():
            time.sleep(0.2)
            for u in (0, 1):
                beater.add(f"hb/{u}", 1)

    t = threading.Thread(target=beat)
    t.start()
    out, warned = {}, []
    try:
        ths = [threading.Thread(target=lambda r=r: out.setdefault(r, survivors(
            connect(server, "job/e5/"), 1, r, 3, 20.0, uids=[0, 1, 2], silent_s=2.0, warn=warned.append)))
            for r in (0, 1)]
        t0 = time.monotonic()
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join(5)
    assert out == {0: ([0, 1], 2), 1: ([0, 1], 2)}, out
    assert len(warned) == 2 and "[0, 1, 2]" in warned[0], warned
    # rank 2's silence timed once (2 s): the second agreement knows it already (timed again it took 4 s), and
    # never the 20 s deadline
    assert took < 3.5, took


def test_a_recovery_begun_elsewhere_reaches_every_heartbeat(server):
    """A rank that is not in a collective when its peer dies (it waits on its own snapshot thread, or computes)
    learns of the recovery from its heartbeat: `begin` in the store -> `on_begun` once, `interrupted` set; after
    its own recovery into that generation (`watch`) it is cleared, and the next generation is watched for."""
    import time

    from pdv_ext.recovery.inplace import Heartbeat, begin

    got = []
    beat = Heartbeat(server, "job/e6/", 0, [0, 1], lambda u: None, interval_s=0.05, dead_after_s=60,
                     on_begun=got.append)
    try:
        time.sleep(0.3)
        assert got == [] and not beat.interrupted.is_set()
        begin(connect(server, "job/e6/"), 1)
        assert beat.interrupted.wait(5) and _until(lambda: got == [1]), got
        time.sleep(0.3)
        assert got == [1]  # once per generation
        beat.watch([0, 1], generation=1)
        assert not beat.interrupted.is_set()
        begin(connect(server, "job/e6/"), 1)  # (said again by a late rank: nothing new)
        time.sleep(0.3)
        assert got == [1] and not beat.interrupted.is_set()
        begin(connect(server, "job/e6/"), 2)
        assert beat.interrupted.wait(5) and _until(lambda: got == [1, 2]), got
    finally:
        beat.stop()


def _until(cond, timeout_s=5.0):
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_wait_for_the_snapshot_in_flight_gives_up_when_interrupted():
    """`Snapshots.wait` on a thread that does not end (it waits on a lost peer) returns as an error that
    in-place recovery takes for a lost peer once the process's interrupt (the heartbeat's `interrupted`, given
    to `torch_comm.set_interrupt`) is set; without it, it waits."""
    from pdv_ext.comm.torch_comm import set_interrupt
    from pdv_ext.integrations.deepspeed.inplace import lost_peer
    from pdv_ext.integrations.deepspeed.snapshots import InterruptedWait, Snapshots

    release, interrupt = threading.Event(), threading.Event()
    snaps = Snapshots.__new__(Snapshots)  # (the wait alone: no process group)
    snaps._thread = threading.Thread(target=release.wait, daemon=True)
    snaps._thread.start()
    snaps._error = None
    set_interrupt(interrupt)
    try:
        threading.Timer(0.3, interrupt.set).start()
        with pytest.raises(InterruptedWait) as err:
            snaps.wait()
        assert lost_peer(err.value)
        interrupt.clear()
        threading.Timer(0.3, release.set).start()
        snaps.wait()  # the thread ends: no error
        assert snaps._thread is None
    finally:
        set_interrupt(None)


def test_what_a_poll_read_before_a_recovery_is_not_fired_after_it(server):
    """A poll of the heartbeat reads the store, then acts. A recovery (`pause`, then `watch` of the new world)
    that comes in between makes what it read stale: fired after the new world formed, an old world's begun
    recovery shut the new world's connections (its survivors then failed their first step: seen once in the
    second-failure test). Such a poll fires nothing; a poll made after it fires as before."""
    from pdv_ext.recovery.inplace import Heartbeat

    got, lost = [], []
    beat = Heartbeat(server, "job/e7/", 0, [0, 1], lost.append, interval_s=3600, dead_after_s=60,
                     on_begun=got.append)
    try:
        epoch = beat._epoch  # a poll's read: generation 1 begun, rank 1 silent long enough
        seen = {1: (5, 0.0)}
        beat.pause()  # the recovery starts...
        beat.watch([0, 1], generation=1)  # ...and ends: the new world
        beat._act(epoch, [1], seen, 1000.0, 1, True)
        assert got == [] and lost == [] and not beat.interrupted.is_set()
        beat._act(beat._epoch, [1], seen, 1000.0, 2, True)  # read after it: acted on
        assert got == [2] and lost == [[1]] and beat.interrupted.is_set()
    finally:
        beat.stop()
