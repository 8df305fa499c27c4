"""The emulated device's clock (emulated_device.py): CPU seconds at the device's quota, read from its cgroup."""
import time

import pytest

from pdv_ext import emulated_device as dc
from pdv_ext.policy.config import MonitorConfig
from pdv_ext.policy.metrics import Monitor


class OneRank:
    rank, size, payload_device = 0, 1, "cpu"


def _v2(tmp_path, text):
    (tmp_path / "cpu.max").write_text(text)
    return str(tmp_path)


def test_cores_from_cgroup_v2_and_v1(tmp_path):
    assert dc.read_cores(_v2(tmp_path, "27500 100000\n")) == pytest.approx(0.275)
    assert dc.read_cores(_v2(tmp_path, "max 100000\n")) is None  # no quota
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("1100\n")
    (v1 / "cpu.cfs_period_us").write_text("4000\n")
    assert dc.read_cores(str(v1)) == pytest.approx(0.275)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert dc.read_cores(str(v1)) is None
    assert dc.read_cores(str(tmp_path / "missing")) is None


def test_the_clock_follows_a_quota_changed_while_it_runs(tmp_path):
    """The emulator's events change a device's quota mid-run: the next reading after `refresh_s` uses it."""
    group = _v2(tmp_path, "50000 100000")
    clock = dc.DeviceClock(group, refresh_s=0.0)
    assert clock.cores() == pytest.approx(0.5)
    _v2(tmp_path, "10000 100000")
    assert clock.cores() == pytest.approx(0.1)
    _v2(tmp_path, "max 100000")
    assert clock.cores() == 1.0  # no quota: one core


def _burn(seconds):
    t = time.process_time()
    while time.process_time() - t < seconds:
        pass


def test_busy_seconds_are_cpu_seconds_over_the_quota(tmp_path):
    clock = dc.DeviceClock(_v2(tmp_path, "25000 100000"))
    c = clock.start()
    _burn(0.05)
    time.sleep(0.1)  # waiting costs the device nothing
    busy = clock.seconds_since(c)
    assert busy == pytest.approx(0.05 / 0.25, rel=0.3)


def test_the_environment_names_the_group(tmp_path, monkeypatch):
    monkeypatch.delenv(dc.ENV, raising=False)
    assert dc.device_clock() is None  # not on an emulated device: the host clock
    monkeypatch.setenv(dc.ENV, str(tmp_path / "gone"))
    assert dc.device_clock() is None
    monkeypatch.setenv(dc.ENV, _v2(tmp_path, "50000 100000"))
    assert dc.device_clock().group == str(tmp_path)


def test_glue_times_compute_by_the_device_clock(tmp_path):
    """On an emulated device the Monitor's compute is the busy time (CPU at the quota), not the wall time: a
    pass that waited reads no faster than one kept busy."""
    from pdv_ext.integrations.deepspeed.glue import _timed

    clock = dc.DeviceClock(_v2(tmp_path, "50000 100000"))
    mon = Monitor(OneRank(), dp_size=1, config=MonitorConfig(tensorboard=False, gns=False))

    def instruction(engine):
        _burn(0.04)
        time.sleep(0.2)  # a wall clock would count this

    _timed(instruction, mon, cuda=False, clock=clock)(None)
    out = mon.end_step(1, None, 0.1, 4, 1)
    assert out["compute_times"][0] == pytest.approx(0.04 / 0.5, rel=0.3)
    host = Monitor(OneRank(), dp_size=1, config=MonitorConfig(tensorboard=False, gns=False))
    _timed(instruction, host, cuda=False)(None)  # no clock: the host's wall clock
    assert host.end_step(1, None, 0.1, 4, 1)["compute_times"][0] >= 0.2


def test_entering_the_device_group_once(tmp_path, monkeypatch):
    """`pdv emulate --startup-on-host`: the worker writes itself (0) into its device group's procs file at
    pdv_ext.initialize, once; without the variable there is nothing to enter."""
    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    monkeypatch.delenv(dc.ENTER_ENV, raising=False)
    assert dc.enter_device_group() is False and procs.read_text() == ""
    monkeypatch.setenv(dc.ENTER_ENV, str(procs))
    assert dc.enter_device_group() is True and procs.read_text() == "0"
    assert dc.ENTER_ENV not in __import__("os").environ  # child processes (the snapshot keepers) stay put
    assert dc.enter_device_group() is False


def test_initialize_enters_the_device_group_first(monkeypatch):
    """Before anything else, even a config error: the engine's construction runs at the device's speed."""
    from pdv_ext.config import ConfigError
    from pdv_ext.integrations.deepspeed import engine

    calls = []
    monkeypatch.setattr(engine, "enter_device_group", lambda: calls.append(1) or True)
    with pytest.raises(ConfigError):
        engine.initialize(model=None, config=None)
    assert calls == [1]


def test_a_lost_device_takes_its_starting_worker_with_it(tmp_path, monkeypatch):
    from pdv_ext.emulate import cgroup

    groups = cgroup.CpuGroups.__new__(cgroup.CpuGroups)
    groups.paths = [str(tmp_path / "d0")]
    start = groups.start_procs(0)
    assert start == str(tmp_path / "d0-start" / "cgroup.procs")
    killed = []
    monkeypatch.setattr(cgroup, "kill_all", lambda path, deadline: killed.append(path))
    groups.kill(0)
    assert killed == [str(tmp_path / "d0-start"), str(tmp_path / "d0")]



def test_a_rank_under_the_emulator_prints_its_stacks_on_the_signal_and_only_it_gets_it():
    """A run that times out asks its ranks where they wait (`Emulation.dump_stacks`): a rank under `pdv emulate`
    prints every thread's stack on SIGUSR1; a process that does not catch it is not sent it (it would die)."""
    import os
    import signal
    import subprocess
    import sys

    from pdv_ext.emulate.launcher import catches

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("from pdv_ext.emulated_device import dump_stacks_on_signal as d; import time\n"
            "print(d(), flush=True)\n"
            "def waits_here():\n    print('waiting', flush=True)\n    time.sleep(60)\n"
            "waits_here()\n")
    env = {k: v for k, v in os.environ.items() if k != "PDV_EMULATION"}
    env["PYTHONPATH"] = root
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, **extra}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for extra in ({"PDV_EMULATION": "pdv-x"}, {})]
    ranked, plain = procs
    try:
        assert ranked.stdout.readline().strip() == "True" and plain.stdout.readline().strip() == "False"
        # (the signal only once the rank is inside waits_here: sent after the first line alone, it once came
        # while the main thread was still on the print's line, and the stack had no waits_here in it)
        assert ranked.stdout.readline().strip() == "waiting" and plain.stdout.readline().strip() == "waiting"
        assert catches(ranked.pid, signal.SIGUSR1) and not catches(plain.pid, signal.SIGUSR1)
        os.kill(ranked.pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert ranked.poll() is None  # printed, still running
    finally:
        for p in procs:
            p.kill()
    err = ranked.communicate()[1]
    assert "most recent call first" in err and "waits_here" in err, err
