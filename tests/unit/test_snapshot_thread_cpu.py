"""Under `pdv emulate` a worker's snapshot thread runs on its host's CPU group, as on a real host beside the GPU
(pdv_ext.recovery.keeper.join_host_cpu_thread); elsewhere nothing happens, and a group it cannot enter costs
one line, not the snapshot."""
import threading

from pdv_ext.recovery import keeper


def _in_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join(10)
    return box


def test_the_thread_enters_its_hosts_group(tmp_path, monkeypatch):
    host = tmp_path / "host-hostA"
    host.mkdir()
    (host / "tasks").write_text("")
    monkeypatch.setenv(keeper.CGROUP_ENV, str(host / "cgroup.procs"))
    monkeypatch.setattr(keeper, "_THREAD_JOIN_FAILED", False)
    _in_thread(keeper.join_host_cpu_thread)
    assert (host / "tasks").read_text() == "0"  # the calling thread, not the process (cgroup.procs untouched)
    assert not (host / "cgroup.procs").exists()


def test_outside_the_emulator_nothing_happens(tmp_path, monkeypatch):
    monkeypatch.delenv(keeper.CGROUP_ENV, raising=False)
    monkeypatch.setattr(keeper, "_THREAD_JOIN_FAILED", False)
    _in_thread(keeper.join_host_cpu_thread)
    assert list(tmp_path.iterdir()) == []


def test_a_group_it_cannot_enter_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(keeper.CGROUP_ENV, str(tmp_path / "gone" / "cgroup.procs"))
    monkeypatch.setattr(keeper, "_THREAD_JOIN_FAILED", False)
    for _ in range(3):
        _in_thread(keeper.join_host_cpu_thread)
    err = capsys.readouterr().err
    assert err.count("stays under the device's CPU quota") == 1, err
