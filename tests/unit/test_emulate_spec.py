"""The emulator's pure parts: cluster -> per-pair links, CPU shares, the commands it would run, CLI errors."""
import os

import pytest

from pdv_ext.emulate import cgroup, cli, launcher, netns
from pdv_ext.emulate.spec import device_ip, from_cluster
from pdv_ext.placement.cluster import Cluster

CLUSTER = {
    "devices": [{"name": "a0", "host": "a", "throughput": 2.0}, {"name": "a1", "host": "a", "throughput": 2.0},
                {"name": "b0", "host": "b", "throughput": 1.0}, {"name": "b1", "host": "b", "throughput": 0.5}],
    "links": {"intra_host": {"bandwidth": "800 Mbit/s", "latency": "50us"},
              "inter_host": {"bandwidth": "80 Mbit/s", "latency": "1ms"},
              "pairs": [{"a": "a1", "b": "b1", "bandwidth": "40 Mbit/s", "latency": "2ms"}]},
}


@pytest.fixture
def spec():
    return from_cluster(Cluster.from_dict(CLUSTER))


def test_spec_links_follow_cluster(spec):
    assert spec.hosts == ["a", "b"]
    assert [spec.local_rank(i) for i in range(4)] == [0, 1, 0, 1]
    assert spec.bandwidth[0][1] == pytest.approx(100e6)  # intra-host, bytes/s
    assert spec.bandwidth[0][2] == pytest.approx(10e6)  # inter-host
    assert spec.bandwidth[1][3] == spec.bandwidth[3][1] == pytest.approx(5e6)  # per-pair override
    assert spec.latency[1][3] == pytest.approx(2e-3)
    assert [device_ip(spec, i) for i in range(4)] == ["10.251.0.1", "10.251.0.2", "10.251.1.1", "10.251.1.2"]


def test_cpu_shares_are_proportional_and_fit_the_budget():
    cores = cgroup.shares([2.0, 2.0, 1.0, 0.5], cpu_budget=1.6)
    assert cores[0] == cores[1] == pytest.approx(2 * cores[2]) == pytest.approx(4 * cores[3])
    assert sum(cores) == pytest.approx(1.6)
    assert cgroup.shares([1.0, 1.0], cpu_budget=8.0) == [1.0, 1.0]  # never more than a core per rank
    assert cgroup.shares([1.0, 0.25], cpu_budget=8.0, top_share=0.5) == [0.5, 0.125]
    assert cgroup.weights([0.5, 0.25], 1) == [262144, 131072]
    assert cgroup.weights([0.5, 0.00001], 2) == [10000, 1]
    for c in (1.0, 0.5, 0.145, 0.1):  # the kernel's 1 ms minimum quota; 2-10 ms periods from 0.1 core up
        assert 2000 <= cgroup.period_us(c) <= 10000
        assert c * cgroup.period_us(c) >= 1000
    for c in (1.0, 0.5, 0.145, 0.1, 0.05, 0.0123, 0.001):  # the quota is the share, also below 0.1 core
        period = cgroup.period_us(c)
        assert period <= cgroup.MAX_PERIOD_US and cgroup.quota_us(c, period) >= cgroup.MIN_QUOTA_US
        assert cgroup.quota_us(c, period) / period == pytest.approx(c, rel=0.01)


def test_network_commands_stay_in_own_namespaces(spec, monkeypatch):
    calls = []

    class Done:
        returncode, stdout, stderr = 1, "", ""  # "netem unknown", like this machine's kernel

    def fake(*args, check=True):
        calls.append(args)
        return Done()

    monkeypatch.setattr(netns, "run", fake)
    net = netns.Network(spec, "pdv-abc123")
    net.create()
    for args in calls:
        scoped = "-n" in args or args[:3] in (("ip", "netns", "add"), ("ip", "netns", "del"))
        assert scoped, f"command outside the run's namespaces: {args}"
        if "-n" in args:
            assert args[args.index("-n") + 1].startswith("pdv-abc123-")
    classes = [a for a in calls if a[:2] == ("tc", "-n") and "class" in a]
    rate = {(a[2], a[a.index("classid") + 1]): a[a.index("rate") + 1] for a in classes}
    assert rate[("pdv-abc123-d1", "1:13")] == "40000000bit"  # a1 -> b1 override (class 16 + 3)
    assert rate[("pdv-abc123-d0", "1:11")] == "800000000bit"  # a0 -> a1 intra-host
    assert rate[("pdv-abc123-h0", "1:11")] == "80000000bit"  # host a's uplink to host b
    assert not any("netem" in a for a in calls[1:] if a[:3] != ("tc", "-n", "pdv-abc123-sw"))  # no netem here


def test_cli_needs_cluster_and_command(capsys):
    assert cli.main([]) == 2
    assert "needs --cluster" in capsys.readouterr().err


def test_cli_dry_run_describes_the_cluster(tmp_path, capsys):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    assert cli.main(["--cluster", str(path), "--dry-run", "--cpu-budget", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "rank 3: b1 on b" in out and "link 1->3: 40.0 Mbit/s" in out


def test_cli_bad_cluster_is_one_clear_error(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("devices: [{name: x}]\n")
    assert cli.main(["--cluster", str(path), "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "host" in err and str(path) in err


def test_not_root_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CLUSTER))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["--cluster", str(path), "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "root" in err[0]
    with pytest.raises(launcher.EmulationUnavailable):
        launcher.check_available()
