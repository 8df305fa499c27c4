"""`pdv emulate`'s run(): a Ctrl-C or SIGTERM while the ranks are being started is held until all of them are,
so that the clean-up knows every process it must stop (issue #37: a SIGINT race)."""
import os
import signal

import pytest

from pdv_ext.emulate.launcher import Emulation


class _Steps(Emulation):
    """run()'s skeleton without namespaces or processes: records what ran; `signal_at` sends a signal to this
    process in the middle of launch()."""

    def __init__(self, sig):
        self.sig, self.ran = sig, []

    def setup(self):
        self.ran.append("setup")

    def launch(self):
        self.ran.append("rank 0")
        os.kill(os.getpid(), self.sig)  # delivered at once to the main thread
        self.ran.append("rank 1")

    def wait(self):
        self.ran.append("wait")
        return 0

    def cleanup(self):
        self.ran.append("cleanup")


@pytest.mark.parametrize("sig, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_signal_during_launch_waits_until_every_rank_started(sig, raised):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    run = _Steps(sig)
    with pytest.raises(raised) as info:
        run.run()
    assert run.ran == ["setup", "rank 0", "rank 1", "cleanup"]  # every rank started, then cleaned; no wait
    if raised is SystemExit:
        assert info.value.code == 128 + signal.SIGTERM
    assert {s: signal.getsignal(s) for s in before} == before  # the caller's handlers are back


def test_without_a_signal_the_run_goes_on_to_wait():
    run = _Steps(0)  # signal 0: nothing is delivered
    assert run.run() == 0
    assert run.ran == ["setup", "rank 0", "rank 1", "wait", "cleanup"]
