"""`pdv emulate` end to end (root only): launcher environment, bandwidth limits, and exact clean-up after
success, failure, timeout, SIGINT and SIGTERM."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "integration", "emulate_workers.py")
CLUSTER = """
devices:
  - {name: fast0, host: a, throughput: 2.0}
  - {name: fast1, host: a, throughput: 2.0}
  - {name: slow0, host: b, throughput: 1.0}
  - {name: slow1, host: b, throughput: 1.0}
links:
  intra_host: {bandwidth: 400 Mbit/s, latency: 50us}
  inter_host: {bandwidth: 40 Mbit/s, latency: 1ms}
"""


def _unavailable():
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    from pdv_ext.emulate import launcher, netns

    try:
        launcher.check_available()
    except launcher.EmulationUnavailable as exc:
        return str(exc)
    name = f"pdv-{secrets.token_hex(3)}-probe"
    if netns.run("ip", "netns", "add", name, check=False).returncode != 0:
        return "cannot create network namespaces here"
    netns.run("ip", "netns", "del", name, check=False)
    return None


REASON = _unavailable()
# every emulator test module's marks: root-only integration tests, skipped with the reason where unavailable
EMULATE_MARKS = [pytest.mark.integration, pytest.mark.root] + (
    [pytest.mark.skip(reason=f"pdv emulate unavailable: {REASON}")] if REASON else [])
pytestmark = EMULATE_MARKS


@pytest.fixture
def cluster(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return str(path)


def _emulate(cluster, run_name, *cmd, timeout=None, popen=False, flags=()):
    args = [sys.executable, "-m", "pdv_ext.cli", "emulate", "--cluster", cluster, "--run-name", run_name, *flags]
    if timeout:
        args += ["--timeout", str(timeout)]
    args += ["--", sys.executable, WORKERS, *cmd]
    if popen:  # SIGINT at its default: a test run started in the background (`cmd &`) inherits it ignored
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)


def _rank_json(stdout):
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[rank ") and "{" in line:
            rank = int(line[len("[rank "):line.index("]")])
            out[rank] = json.loads(line[line.index("{"):])
    return out


def _root_state():
    """What a run may never leave in the root namespace: veths, qdiscs."""
    veth = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    qdisc = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
    return veth, qdisc


def _leftovers(run_name):
    from pdv_ext.emulate import cgroup, netns

    import psutil

    left = [ns for ns in netns.list_netns() if ns.startswith(run_name)]
    det = cgroup.detect()
    if det and os.path.exists(os.path.join(det[1], run_name)):
        left.append(f"cgroup {run_name}")
    for p in psutil.process_iter(["cmdline"]):
        if run_name in " ".join(p.info["cmdline"] or []) and p.pid != os.getpid():
            left.append(f"process {p.pid}: {p.info['cmdline']}")
    return left


@pytest.mark.timeout(60)
def test_ranks_see_launcher_env_and_limited_bandwidth(cluster):
    run = f"pdv-{secrets.token_hex(3)}"
    p = _emulate(cluster, run, "env", timeout=40)
    assert p.returncode == 0, p.stderr
    env = _rank_json(p.stdout)
    assert sorted(env) == [0, 1, 2, 3]
    assert [env[r]["PDV_DEVICE_NAME"] for r in range(4)] == ["fast0", "fast1", "slow0", "slow1"]
    assert [env[r]["PDV_HOST"] for r in range(4)] == ["a", "a", "b", "b"]
    assert [env[r]["LOCAL_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert all(env[r]["RANK"] == str(r) and env[r]["WORLD_SIZE"] == "4" for r in range(4))
    assert all(env[r]["MASTER_ADDR"] == env[0]["ADDR"] and env[r]["OMP_NUM_THREADS"] == "1" for r in range(4))
    assert len({env[r]["ADDR"] for r in range(4)}) == 4  # every device has its own address on its interface
    assert not _leftovers(run)

    p = _emulate(cluster, run, "bw", "4", timeout=40)
    assert p.returncode == 0, p.stderr
    bw = {r: v["bw_from_0"] for r, v in _rank_json(p.stdout).items()}
    intra, inter = 400e6 / 8, 40e6 / 8
    assert 0.6 * intra < bw[1] < 1.2 * intra, bw
    assert 0.6 * inter < bw[2] < 1.2 * inter, bw
    assert 0.6 * inter < bw[3] < 1.2 * inter, bw


@pytest.mark.timeout(120)
def test_background_traffic_waits_for_the_rest_of_a_link(cluster):
    """A bulk stream marked as the snapshot keepers' copies are (`recovery.keeper.background_socket`) leaves
    the link's other traffic as fast as an idle link does; unmarked, an 8 KB round trip waits behind its
    queue (the emulator's link classes serve the background leaf last)."""
    loaded = {}
    for mark in ("0", "1"):
        p = _emulate(cluster, f"pdv-{secrets.token_hex(3)}", "hol", mark, timeout=60)
        assert p.returncode == 0, p.stderr
        out = _rank_json(p.stdout)[0]
        loaded[mark] = out["loaded_ms"]
    # 40 Mbit/s: one 9000-byte packet ahead of the round trip is 1.8 ms; the unmarked stream's queue is more
    assert loaded["1"] < 0.5 * loaded["0"], loaded


@pytest.mark.timeout(90)
def test_startup_on_host_then_the_device_quota(cluster):
    """`--startup-on-host`: a worker starts in its device's start-up group (no quota) and enters the device's
    group at `enter_device_group()` (pdv_ext.initialize calls it); its device clock reads the device's quota."""
    run = f"pdv-{secrets.token_hex(3)}"
    p = _emulate(cluster, run, "groups", timeout=60, flags=["--startup-on-host", "--cpu-budget", "1.2"])
    assert p.returncode == 0, p.stderr
    seen = _rank_json(p.stdout)
    assert sorted(seen) == [0, 1, 2, 3]
    for r in range(4):
        assert seen[r]["before"].endswith(f"/{run}/d{r}-start") and seen[r]["entered"], seen[r]
        assert seen[r]["after"].endswith(f"/{run}/d{r}"), seen[r]
    # throughputs 2, 2, 1, 1 over 1.2 cores: 0.4, 0.4, 0.2, 0.2
    assert [round(seen[r]["cores"], 2) for r in range(4)] == [0.4, 0.4, 0.2, 0.2]
    assert not _leftovers(run)
    p = _emulate(cluster, run, "groups", timeout=60)  # without the flag: in the device's group from the start
    seen = _rank_json(p.stdout)
    assert p.returncode == 0 and all(not seen[r]["entered"] and seen[r]["before"].endswith(f"/d{r}")
                                     for r in range(4)), seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["success", "failure", "timeout", "sigint", "sigterm"])
def test_nothing_left_behind(cluster, case):
    run = f"pdv-{secrets.token_hex(3)}"
    before = _root_state()
    if case == "success":
        p = _emulate(cluster, run, "sleep", "0.1", run)
        assert p.returncode == 0, p.stderr
    elif case == "failure":
        p = _emulate(cluster, run, "fail", "2", "3", run)
        assert p.returncode == 3, p.stderr  # the failing rank's code; the sleeping ranks were killed
    elif case == "timeout":
        p = _emulate(cluster, run, "sleep", "600", run, timeout=3)
        assert p.returncode == 124, p.stderr
        assert "timed out" in p.stderr
    else:
        proc = _emulate(cluster, run, "sleep", "600", run, popen=True)
        try:
            deadline = time.time() + 30
            import psutil

            while time.time() < deadline:  # all four ranks started inside their namespaces
                n = sum(1 for q in psutil.process_iter(["cmdline"])
                        if run in " ".join(q.info["cmdline"] or []) and WORKERS in " ".join(q.info["cmdline"] or [])
                        and os.path.basename((q.info["cmdline"] or [""])[0]) not in ("ip", "nsenter"))
                if n >= 4:
                    break
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT if case == "sigint" else signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == (130 if case == "sigint" else 128 + signal.SIGTERM), err
    assert not _leftovers(run)
    assert _root_state() == before


@pytest.mark.timeout(30)
def test_cleanup_removes_stale_resources(cluster):
    from pdv_ext.emulate import cgroup, netns

    run = f"pdv-{secrets.token_hex(3)}"
    netns.run("ip", "netns", "add", f"{run}-d0")  # what a SIGKILLed run leaves behind
    os.mkdir(os.path.join(cgroup.detect()[1], run))
    p = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "emulate", "--cleanup"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert not _leftovers(run)
