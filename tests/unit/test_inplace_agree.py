"""The survivors' agreement of in-place recovery (pdv_ext.recovery.inplace) over a real TCPStore."""
import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from pdv_ext.config_base import ConfigError
from pdv_ext.recovery.inplace import NotASurvivor, agree, connect, parse_address
from pdv_ext.spawn import free_port


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
