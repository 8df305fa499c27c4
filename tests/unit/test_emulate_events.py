"""Cluster weather without root: the events schema and its errors, the changes worked out from a timeline,
the commands and cgroup writes that apply them, the event player's clocks and logs, and `pdv emulate`'s
dry run and exit 2 on a bad event."""
import json
import os
import subprocess
import time

import pytest
import yaml

from pdv_ext.config_base import ConfigError
from pdv_ext.emulate import cgroup, cli, events, launcher, netns
from pdv_ext.emulate.player import EventError, EventPlayer
from pdv_ext.emulate.spec import from_cluster
from pdv_ext.emulate.weather import Weather
from pdv_ext.placement.cluster import Cluster

CLUSTER = {
    "devices": [{"name": "fast0", "host": "a", "throughput": 2.0}, {"name": "fast1", "host": "a", "throughput": 2.0},
                {"name": "slow0", "host": "b", "throughput": 1.0}, {"name": "slow1", "host": "b", "throughput": 1.0}],
    "links": {"intra_host": {"bandwidth": "800 Mbit/s", "latency": "50us"},
              "inter_host": {"bandwidth": "80 Mbit/s", "latency": "1ms"},
              "pairs": [{"a": "fast1", "b": "slow1", "bandwidth": "40 Mbit/s", "latency": "2ms"}]},
}
MBIT = 1e6 / 8  # bytes/s


@pytest.fixture
def spec():
    return from_cluster(Cluster.from_dict(CLUSTER))


def parse(*items):
    return events.parse_events(list(items), "t.yaml")


def errors_of(*items):
    with pytest.raises(ConfigError) as exc:
        parse(*items)
    return exc.value.errors


# ---- schema -------------------------------------------------------------------------------------------
def test_three_kinds_with_the_cluster_yamls_units():
    dev, pair, link = parse({"at": "40s", "device": "slow0", "throughput": 0.33},
                            {"at": "1.5min", "pair": {"a": "fast1", "b": "slow1"}, "bandwidth": "10 Mbit/s",
                             "latency": "5ms"},
                            {"at": 90, "link": "inter_host", "bandwidth": "1 Gbit/s"})
    assert (dev.kind, dev.target, dev.at, dev.throughput) == ("device", "slow0", 40.0, 0.33)
    assert (pair.kind, pair.target, pair.at) == ("pair", "fast1<->slow1", 90.0)
    assert pair.bandwidth == pytest.approx(10 * MBIT) and pair.latency == pytest.approx(5e-3)
    assert (link.kind, link.target, link.bandwidth, link.latency) == ("link", "inter_host", 1e9 / 8, None)
    assert [events.parse_time(t) for t in ("500ms", "40s", "1.5min", "2h", 7, "3")] == [0.5, 40, 90, 7200, 7, 3]
    assert dev.origin == "t.yaml: events[0]"


@pytest.mark.parametrize("event, words", [
    ({"at": "40x", "device": "slow0", "throughput": 1}, "events[0].at: cannot read a time"),
    ({"at": "soon", "device": "slow0", "throughput": 1}, "events[0].at: cannot read a time"),
    ({"at": -1, "device": "slow0", "throughput": 1}, "events[0].at: a time must be a finite number of seconds >= 0"),
    ({"at": 1, "device": "slow0", "throughput": 0}, "events[0].throughput: Input should be greater than 0"),
    ({"at": 1, "device": "slow0", "throughput": -0.5}, "events[0].throughput: Input should be greater than 0"),
    ({"at": 1, "device": "slow0", "throughput": True}, "events[0].throughput: expected a relative throughput"),
    ({"at": 1, "device": "slow0", "thruput": 1}, "did you mean 'throughput'"),
    ({"at": 1, "pair": {"a": "fast1", "b": "slow1"}, "bandwidth": "10 Mbps/s"}, "events[0].bandwidth: unknown bandwidth unit"),
    ({"at": 1, "pair": {"a": "fast1", "b": "slow1"}, "bandwidth": "fast"}, "events[0].bandwidth: cannot read bandwidth"),
    ({"at": 1, "link": "inter_host", "bandwidth": "1 Gbit/s", "latency": "2 Mbit/s"}, "events[0].latency: unknown time unit"),
    ({"at": 1, "link": "interhost", "bandwidth": "1 Gbit/s"}, "events[0].link: Input should be 'intra_host' or 'inter_host'"),
    ({"at": 1, "throughput": 1}, "events[0]: an event needs exactly one of 'device', 'pair', 'link' or 'host'"),
    ({"at": 1, "device": "slow0", "link": "inter_host", "bandwidth": 1e6}, "has 'device' and 'link'"),
    ("slow0 at 40s", "events[0]: expected a mapping"),
])
def test_a_bad_event_is_one_line_naming_index_key_and_value(event, words):
    errs = errors_of(event)
    assert len(errs) == 1 and words in errs[0] and errs[0].startswith("t.yaml: events[0]"), errs


def test_every_bad_event_is_reported_with_its_index():
    errs = errors_of({"at": 1, "device": "x", "throughput": 1}, {"at": "x", "device": "y", "throughput": 1},
                     {"at": 2, "device": "z", "throughput": 0})
    assert [e.split(":")[1].strip() for e in errs] == ["events[1].at", "events[2].throughput"]


def test_names_are_checked_against_the_cluster(spec):
    evs = parse({"at": 1, "device": "slow9", "throughput": 1}, {"at": 2, "pair": {"a": "fast1", "b": "slowl"},
                                                                "bandwidth": 1e6},
                {"at": 3, "pair": {"a": "slow0", "b": "slow0"}, "bandwidth": 1e6},
                {"at": 4, "device": "fast0", "throughput": 1})
    with pytest.raises(ConfigError) as exc:
        events.check(evs, spec)
    errs = exc.value.errors
    assert len(errs) == 3, errs
    assert errs[0].startswith("t.yaml: events[0].device: unknown device 'slow9'") and "did you mean 'slow1'" in errs[0]
    assert "known devices: fast0, fast1, slow0, slow1" in errs[0]
    assert errs[1].startswith("t.yaml: events[1].pair.b: unknown device 'slowl'")
    assert errs[2].startswith("t.yaml: events[2].pair: a and b are the same device 'slow0'")


def test_a_link_class_the_cluster_does_not_have_is_an_error():
    one_host = from_cluster(Cluster.from_dict({"devices": [{"name": "x", "host": "a"}, {"name": "y", "host": "a"}]}))
    one_each = from_cluster(Cluster.from_dict({"devices": [{"name": "x", "host": "a"}, {"name": "y", "host": "b"}]}))
    with pytest.raises(ConfigError, match=r"events\[0\].link: every device of this cluster is on host 'a'"):
        events.check(parse({"at": 1, "link": "inter_host", "bandwidth": 1e6}), one_host)
    with pytest.raises(ConfigError, match=r"events\[0\].link: no two devices of this cluster share a host"):
        events.check(parse({"at": 1, "link": "intra_host", "bandwidth": 1e6}), one_each)


def test_both_sources_are_merged_and_sorted(tmp_path, spec):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({"ranks": 4, "steps": 100, "events": [
        {"at": "30s", "link": "inter_host", "bandwidth": "10 Mbit/s"},
        {"at": "10s", "device": "fast0", "throughput": 1}]}))
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"at": 20, "device": "slow1", "throughput": 0.5}]))
    cluster_events = [{"at": "20s", "device": "slow0", "throughput": 0.5}, {"at": 5, "device": "slow0", "throughput": 1}]
    tl = events.load_timeline(cluster_events, "c.yaml", str(scenario), spec)
    assert [(e.at, e.target) for e in tl] == [(5, "slow0"), (10, "fast0"), (20, "slow0"), (30, "inter_host")]
    assert tl[1].origin == f"{scenario}: events[1]"
    assert [e.target for e in events.load_timeline(cluster_events, "c.yaml", str(listed))] == ["slow0", "slow0", "slow1"]
    assert events.load_timeline(None, "c.yaml") == []


def test_events_file_errors_name_the_file(tmp_path, spec):
    other = tmp_path / "scenario.yaml"
    other.write_text("ranks: 4\n")
    with pytest.raises(ConfigError, match="no 'events' key"):
        events.load_timeline(None, "c.yaml", str(other))
    with pytest.raises(ConfigError, match="cannot read events file"):
        events.load_timeline(None, "c.yaml", str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("events:\n  - {at: 1, device: nope, throughput: 1}\n")
    with pytest.raises(ConfigError) as exc:  # both sources' problems at once
        events.load_timeline([{"at": 1, "device": "slow0", "throughput": -1}], "c.yaml", str(bad), spec)
    assert [e.split(": events")[0] for e in exc.value.errors] == ["c.yaml", str(bad)]


def test_the_placement_loader_accepts_and_ignores_events(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CLUSTER, "events": [{"at": "40s", "device": "slow0", "throughput": 0.33}]}))
    cluster = Cluster.load(str(path))
    assert len(cluster) == 4 and cluster.link(1, 3).bandwidth == pytest.approx(40 * MBIT)
    assert cluster.spec.events == [{"at": "40s", "device": "slow0", "throughput": 0.33}]
    assert "events" not in Cluster.from_dict(CLUSTER).to_dict()  # a cluster without them saves without them


# ---- what each event changes ------------------------------------------------------------------------------
def test_device_quota_scales_with_the_start_quota(spec):
    cores = [0.5, 0.5, 0.25, 0.25]
    plan = Weather(spec, cores).plan(parse({"at": 40, "device": "slow0", "throughput": 0.33},
                                           {"at": 60, "device": "fast1", "throughput": 1.0},
                                           {"at": 120, "device": "slow0", "throughput": 1.0}))
    assert plan[0].cores == (2, pytest.approx(0.25 * 0.33))
    assert plan[0].before == {"throughput": 1.0, "cores": 0.25}
    assert plan[0].after == {"throughput": 0.33, "cores": pytest.approx(0.0825)}
    assert plan[0].text == "device slow0 throughput 1 -> 0.33 (0.250 -> 0.083 cores)"
    assert plan[1].cores == (1, pytest.approx(0.25))  # a fast device at half its start throughput
    assert plan[2].before["throughput"] == 0.33 and plan[2].cores == (2, pytest.approx(0.25))
    assert not plan[0].rates and not plan[0].uplinks


def test_pair_sets_both_directions_and_the_uplinks_follow(spec):
    plan = Weather(spec, [0.5] * 4).plan(parse(
        {"at": 1, "pair": {"a": "fast1", "b": "slow1"}, "bandwidth": "10 Mbit/s", "latency": "5ms"},
        {"at": 2, "pair": {"a": "fast0", "b": "slow0"}, "bandwidth": "200 Mbit/s"}))
    lower, higher = plan
    assert sorted(lower.rates) == [(1, 3, 10 * MBIT), (3, 1, 10 * MBIT)]
    assert sorted(lower.delays) == [(1, 3, 5e-3), (3, 1, 5e-3)]
    assert lower.before == {"bandwidth": pytest.approx(40 * MBIT), "latency": pytest.approx(2e-3)}
    assert lower.after == {"bandwidth": pytest.approx(10 * MBIT), "latency": pytest.approx(5e-3)}
    assert lower.uplinks == []  # the other inter-host pairs still run at 80 Mbit/s: the uplinks stay
    assert "pair fast1<->slow1 bandwidth 40.0 -> 10.0 Mbit/s, latency 2 -> 5 ms" == lower.text
    assert higher.delays == [] and higher.after["latency"] == pytest.approx(1e-3)  # latency unchanged
    assert sorted(higher.uplinks) == [(0, 1, 200 * MBIT), (1, 0, 200 * MBIT)]  # the fastest pair sets them


def test_link_class_sets_every_pair_of_the_class_and_the_uplinks(spec):
    w = Weather(spec, [0.5] * 4)
    (inter,) = w.plan(parse({"at": 1, "link": "inter_host", "bandwidth": "20 Mbit/s", "latency": "3ms"}))
    pairs = {(i, j) for i, j, _ in inter.rates}
    assert pairs == {(i, j) for i in range(4) for j in range(4) if (i < 2) != (j < 2)}  # override pair included
    assert all(bw == 20 * MBIT for _, _, bw in inter.rates) and len(inter.delays) == 8
    assert sorted(inter.uplinks) == [(0, 1, 20 * MBIT), (1, 0, 20 * MBIT)]
    assert inter.before == {"bandwidth": pytest.approx(80 * MBIT), "latency": pytest.approx(1e-3),
                            "pairs": {"fast1<->slow1": {"bandwidth": pytest.approx(40 * MBIT),
                                                        "latency": pytest.approx(2e-3)}}}
    assert inter.text == ("link inter_host bandwidth 80.0 -> 20.0 Mbit/s, latency 1 -> 3 ms (4 pairs, 2 host uplinks); "
                          "before it fast1<->slow1 was at 40.0 Mbit/s, 2 ms")
    (intra,) = w.plan(parse({"at": 1, "link": "intra_host", "bandwidth": "100 Mbit/s"}))
    assert sorted((i, j) for i, j, _ in intra.rates) == [(0, 1), (1, 0), (2, 3), (3, 2)] and not intra.uplinks


def test_values_the_kernel_cannot_hold_are_errors_before_the_run(spec):
    with pytest.raises(ConfigError) as exc:
        Weather(spec, [0.5, 0.5, 0.25, 0.25]).plan(parse({"at": 1, "device": "slow0", "throughput": 0.001},
                                                         {"at": 2, "pair": {"a": "fast0", "b": "slow0"},
                                                          "bandwidth": "100 bit/s"}))
    errs = exc.value.errors
    assert "events[0].throughput: 0.001 gives slow0 0.000250 cores" in errs[0] and "smallest CPU quota" in errs[0]
    assert "events[1].bandwidth: 100 bit/s is below" in errs[1]


# ---- applying: cgroup writes and tc commands ---------------------------------------------------------
@pytest.mark.parametrize("version", [1, 2])
def test_set_cores_writes_a_valid_quota_and_follows_with_the_weights(tmp_path, monkeypatch, version):
    groups = cgroup.CpuGroups("pdv-abc123", [0.5, 0.5, 0.25], detected=(version, str(tmp_path)))
    groups.create()
    writes = []
    real = cgroup._write
    monkeypatch.setattr(cgroup, "_write", lambda path, text: (writes.append((os.path.relpath(path, groups.parent),
                                                                             text)), real(path, text)))
    groups.set_cores(2, 0.025)  # a tenth of the start: below 0.1 core the period grows past 10 ms
    if version == 1:
        assert writes[:2] == [("d2/cpu.cfs_quota_us", "1000"), ("d2/cpu.cfs_period_us", "40000")]  # quota first
        assert ("d2/cpu.shares", str(int(262144 * 0.025 / 0.5))) in writes
    else:
        assert writes[:2] == [("d2/cpu.max", "1000 40000"), ("d2/cpu.weight", str(int(10000 * 0.025 / 0.5)))]
    writes.clear()
    groups.set_cores(2, 1.0)  # now the fastest: every weight follows
    if version == 1:
        assert writes[:2] == [("d2/cpu.cfs_period_us", "2000"), ("d2/cpu.cfs_quota_us", "2000")]  # period first
        assert {w for w in writes[2:]} == {("d0/cpu.shares", "131072"), ("d1/cpu.shares", "131072"),
                                           ("d2/cpu.shares", "262144")}
    else:
        assert writes[0] == ("d2/cpu.max", "2000 2000")
    assert groups.cores == [0.5, 0.5, 1.0]
    with pytest.raises(cgroup.CgroupError, match="below the smallest CPU quota"):
        groups.set_cores(0, 0.0001)


def test_live_rate_and_delay_changes_stay_in_the_runs_namespaces(spec, monkeypatch):
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    monkeypatch.setattr(netns, "run", lambda *args, check=True: calls.append(args) or Done())
    net = netns.Network(spec, "pdv-abc123", netem=False)
    net.set_rate(1, 3, 10 * MBIT)
    net.set_uplink_rate(0, 1, 20 * MBIT)
    assert not net.set_delay(1, 3, 5e-3)  # no sch_netem: nothing to change
    assert calls[0][:12] == ("tc", "-n", "pdv-abc123-d1", "class", "change", "dev", "eth0", "parent", "1:",
                             "classid", "1:13", "htb")
    assert calls[0][calls[0].index("rate") + 1] == calls[0][calls[0].index("ceil") + 1] == "10000000bit"
    # the link's two leaves (all traffic; what is marked as background) may borrow up to its new rate
    for call, leaf in zip(calls[1:3], ("1:113", "1:213")):
        assert call[:12] == ("tc", "-n", "pdv-abc123-d1", "class", "change", "dev", "eth0", "parent", "1:13",
                             "classid", leaf, "htb")
        assert call[call.index("ceil") + 1] == "10000000bit" and call[call.index("rate") + 1] == "8000bit"
    assert [c[-1] for c in calls[1:3]] == ["0", "1"]  # their priorities: the background leaf last
    assert calls[3][:11] == ("tc", "-n", "pdv-abc123-h0", "class", "change", "dev", "up0", "parent", "1:",
                             "classid", "1:11")
    assert calls[3][calls[3].index("rate") + 1] == "20000000bit" and len(calls) == 6
    net = netns.Network(spec, "pdv-abc123", netem=True)
    assert net.set_delay(3, 1, 5e-3) and net.set_delay(3, 0, 0.0)
    for call, leaf in zip(calls[6:8], ("1:111", "1:211")):
        assert call == ("tc", "-n", "pdv-abc123-d3", "qdisc", "replace", "dev", "eth0", "parent", leaf, "netem",
                        "delay", "5000us", "limit", "100000")
    for call, leaf in zip(calls[8:10], ("1:110", "1:210")):
        assert call[:10] == ("tc", "-n", "pdv-abc123-d3", "qdisc", "replace", "dev", "eth0", "parent", leaf,
                             "pfifo")


# ---- the player --------------------------------------------------------------------------------------
def _wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_player_applies_in_order_logs_each_and_reports_what_the_run_cut_short(spec, tmp_path):
    plan = Weather(spec, [0.5] * 4).plan(parse({"at": 0.05, "device": "slow0", "throughput": 0.5},
                                               {"at": 0.1, "pair": {"a": "fast0", "b": "slow0"}, "bandwidth": 1e6},
                                               {"at": 3600, "device": "slow0", "throughput": 1}))
    applied, lines, path = [], [], tmp_path / "events.jsonl"
    player = EventPlayer(plan, lambda c: applied.append(c.index) or [], "launch", None, str(path), lines.append)
    player.start(time.monotonic())
    _wait_for(lambda: len(applied) == 2)
    player.stop()
    player.stop()  # twice is harmless
    assert applied == [0, 1] == player.applied
    log = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["index"], r["kind"], r["target"], r["applied"]) for r in log] == [
        (0, "device", "slow0", True), (1, "pair", "fast0<->slow0", True), (2, "device", "slow0", False)]
    assert set(log[0]) == {"index", "at", "applied_at", "wall", "kind", "target", "before", "after", "applied"}
    assert log[0]["applied_at"] >= 0.05 - 0.01 and log[1]["applied_at"] >= 0.1 - 0.01  # never early
    assert abs(log[0]["wall"] - time.time()) < 60 and log[0]["before"] == {"throughput": 1.0, "cores": 0.5}
    assert log[2]["applied_at"] is None and log[2]["reason"] == "the run ended first"
    assert lines[0].startswith("event 0 at +0.") and "(wall 20" in lines[0]
    assert lines[0].endswith("Z): device slow0 throughput 1 -> 0.5 (0.500 -> 0.250 cores)")
    assert lines[2] == ("event 2 at +3600.0s not applied (the run ended first): device slow0 throughput 0.5 -> 1 "
                        "(0.250 -> 0.500 cores)")


def test_mark_clock_starts_when_a_rank_marks(spec, tmp_path, monkeypatch):
    plan = Weather(spec, [0.5] * 4).plan(parse({"at": 0, "device": "slow0", "throughput": 0.5}))
    mark = tmp_path / "mark"
    applied, lines = [], []
    player = EventPlayer(plan, lambda c: applied.append(c.index) or [], "mark", str(mark), None, lines.append)
    player.start(time.monotonic())
    time.sleep(0.2)
    assert applied == [] and player.zero is None  # nothing before the mark, however long start-up takes
    monkeypatch.setenv(events.MARK_ENV, str(mark))
    events.mark_start()
    events.mark_start()  # idempotent
    _wait_for(lambda: applied == [0])
    player.stop()
    assert lines[0].startswith("timeline started by a rank's mark_start()")


def test_mark_never_reached_is_reported(spec):
    plan = Weather(spec, [0.5] * 4).plan(parse({"at": 0, "device": "slow0", "throughput": 0.5}))
    lines = []
    player = EventPlayer(plan, lambda c: [], "mark", "/nonexistent/mark", None, lines.append)
    player.start(time.monotonic())
    player.stop()
    assert lines == ["event 0 at +0.0s not applied (the run ended before any rank called mark_start()): device "
                     "slow0 throughput 1 -> 0.5 (0.500 -> 0.250 cores)"]


def test_mark_start_is_a_noop_outside_the_emulator(monkeypatch, tmp_path):
    monkeypatch.delenv(events.MARK_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    events.mark_start()
    assert os.listdir(tmp_path) == []


def test_an_event_that_fails_stops_the_run_with_a_clear_message(spec, tmp_path, monkeypatch):
    """The player reports the failure, the launcher stops the ranks and raises EventError naming the event."""
    log = tmp_path / "events.jsonl"
    em = launcher.Emulation(spec, ["true"], events=parse({"at": 0.05, "device": "slow0", "throughput": 0.5},
                                                         {"at": 0.1, "device": "slow0", "throughput": 1}),
                            events_log=str(log), log=lambda m: None)

    def boom(change):
        raise OSError("cgroup gone")

    def setup():
        em.player = EventPlayer(em.changes, boom, "launch", None, str(log), log=lambda m: None)

    def launch():  # a rank that would run for a minute
        em.procs.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        em.player.start(time.monotonic())

    monkeypatch.setattr(em, "setup", setup)
    monkeypatch.setattr(em, "launch", launch)
    monkeypatch.setattr(netns.Network, "destroy", lambda self: None)  # nothing was created
    t0 = time.monotonic()
    with pytest.raises(EventError, match=r"event 0 \(t.yaml: events\[0\]: device slow0 throughput 1 -> 0.5 .*\) "
                                         r"failed: cgroup gone"):
        em.run()
    assert time.monotonic() - t0 < 30 and em.procs[0].poll() is not None  # the rank was stopped
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["applied"], r["reason"]) for r in rows] == [(False, "failed: cgroup gone"),
                                                          (False, "an earlier event failed")]


# ---- the command --------------------------------------------------------------------------------------
@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CLUSTER, "events": [{"at": "40s", "device": "slow0", "throughput": 0.33}]}))
    return str(path)


def test_dry_run_prints_the_resolved_timeline(cluster_file, tmp_path, capsys):
    more = tmp_path / "ev.yaml"
    more.write_text("- {at: 60s, pair: {a: fast1, b: slow1}, bandwidth: 10 Mbit/s}\n"
                    "- {at: 2min, device: slow0, throughput: 1.0}\n")
    assert cli.main(["--cluster", cluster_file, "--events", str(more), "--dry-run", "--top-share", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-4:] == ["timeline: 3 events, from when the ranks start",
                        "event 0 at +40.0s: device slow0 throughput 1 -> 0.33 (0.250 -> 0.083 cores)",
                        "event 1 at +60.0s: pair fast1<->slow1 bandwidth 40.0 -> 10.0 Mbit/s",
                        "event 2 at +120.0s: device slow0 throughput 0.33 -> 1 (0.083 -> 0.250 cores)"]
    assert cli.main(["--cluster", cluster_file, "--dry-run", "--events-clock", "mark"]) == 0
    assert "from when a rank first calls mark_start()" in capsys.readouterr().out


@pytest.mark.parametrize("event, words", [
    ({"at": 1, "device": "slow9", "throughput": 1}, "events[0].device: unknown device 'slow9'"),
    ({"at": 1, "pair": {"a": "fast1", "b": "fast7"}, "bandwidth": "1 Mbit/s"}, "events[0].pair.b: unknown device 'fast7'"),
    ({"at": 1, "device": "slow0", "throughput": 0}, "events[0].throughput: Input should be greater than 0"),
    ({"at": "tomorrow", "device": "slow0", "throughput": 1}, "events[0].at: cannot read a time"),
    ({"at": 1, "link": "inter_host", "bandwidth": "lots"}, "events[0].bandwidth: cannot read bandwidth"),
])
def test_bad_event_is_exit_2_before_anything_starts(event, words, cluster_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "check_available", lambda: pytest.fail("emulation checked"))
    monkeypatch.setattr(launcher.Emulation, "run", lambda self: pytest.fail("emulation started"))
    path = tmp_path / "ev.yaml"
    path.write_text(yaml.safe_dump({"events": [event]}))
    assert cli.main(["--cluster", cluster_file, "--events", str(path), "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pdv emulate: {path}: ") and words in err[0], err


def test_events_log_directory_must_exist(cluster_file, monkeypatch, capsys):
    monkeypatch.setattr(launcher.Emulation, "run", lambda self: pytest.fail("emulation started"))
    assert cli.main(["--cluster", cluster_file, "--events-log", "/nonexistent/dir/e.jsonl", "--", "true"]) == 2
    assert "events log /nonexistent/dir/e.jsonl: directory /nonexistent/dir does not exist" in capsys.readouterr().err


def test_cleanup_removes_mark_folders_of_killed_runs(tmp_path, monkeypatch):
    import tempfile

    from pdv_ext.emulate import elastic

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(netns, "stale_namespaces", lambda: [])
    monkeypatch.setattr(cgroup, "stale", lambda prefix="pdv-": [])
    # the hosts' memory under tmp_path too: the real one may belong to a run going on beside this test (its
    # owner file is in the real temporary folder, which this test hides)
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(elastic, "memory_root", lambda run: str(tmp_path / "shm" / f"{run}-memory"))
    (tmp_path / "pdv-abc123-mark-x1y2").mkdir()  # what a kill -9 leaves behind with --events-clock mark
    (tmp_path / "pdv-ranks-keep").mkdir()  # not a run's
    assert launcher.cleanup_stale(log=lambda m: None) == 1
    assert sorted(os.listdir(tmp_path)) == ["pdv-ranks-keep", "shm"]



# ---- events placed by training progress (at_step, at_fraction) ------------------------------------------
def test_at_step_and_at_fraction_place_an_event_by_training_progress():
    step, share = parse({"at_step": 25, "device": "slow0", "throughput": 0.5},
                        {"at_fraction": 0.4, "link": "inter_host", "bandwidth": "10 Mbit/s"})
    assert (step.at, step.at_step, step.by_step, step.when) == (None, 25, True, "step 25")
    assert (share.at_step, share.at_fraction, share.when) == (None, 0.4, "0.4 of the run")
    resolved = events.resolve_steps([step, share], 80)
    assert [e.at_step for e in resolved] == [25, 32] and resolved[1].when == "step 32 (0.4 of the run)"
    assert resolved[1].origin == "t.yaml: events[1]" and share.at_step is None  # a copy: the share is kept
    assert events.resolve_steps(resolved, 10)[1].at_step == 4  # again from the share (e.g. bench --steps 10)
    assert [e.at_step for e in events.timeline(events.resolve_steps(
        parse({"at_step": 50, "device": "slow0", "throughput": 1}, {"at_fraction": 0.25, "device": "slow0",
                                                                    "throughput": 0.5}), 100))] == [25, 50]
    assert parse({"at_step": 0, "device": "slow0", "throughput": 1})[0].at_step == 0  # when training starts
    assert not parse({"at": 5, "device": "slow0", "throughput": 1})[0].by_step


@pytest.mark.parametrize("event, words", [
    ({"at": 1, "at_step": 3, "device": "slow0", "throughput": 1},
     "events[0]: an event needs exactly one of 'at' (seconds), 'at_step' (a training step) or 'at_fraction' "
     "(a share of the run's steps) (has 'at' and 'at_step')"),
    ({"at_step": 3, "at_fraction": 0.5, "device": "slow0", "throughput": 1}, "(has 'at_step' and 'at_fraction')"),
    ({"device": "slow0", "throughput": 1}, "events[0]: an event needs exactly one of 'at' (seconds)"),
    ({"at_step": -1, "device": "slow0", "throughput": 1}, "events[0].at_step: Input should be greater than or equal to 0"),
    ({"at_step": 2.5, "device": "slow0", "throughput": 1}, "events[0].at_step: Input should be a valid integer"),
    ({"at_step": True, "device": "slow0", "throughput": 1}, "events[0].at_step: expected a whole number of training steps"),
    ({"at_step": "soon", "device": "slow0", "throughput": 1}, "events[0].at_step: Input should be a valid integer"),
    ({"at_fraction": 0, "device": "slow0", "throughput": 1}, "events[0].at_fraction: Input should be greater than 0"),
    ({"at_fraction": 1, "device": "slow0", "throughput": 1}, "events[0].at_fraction: Input should be less than 1"),
    ({"at_fraction": True, "device": "slow0", "throughput": 1}, "events[0].at_fraction: expected a share of the run"),
    ({"at_stp": 3, "device": "slow0", "throughput": 1}, "has none"),
])
def test_a_bad_placement_is_one_line_naming_index_and_key(event, words):
    errs = errors_of(event)
    assert len(errs) == 1 and words in errs[0] and errs[0].startswith("t.yaml: events[0]"), errs


def test_seconds_and_steps_do_not_mix_and_a_share_needs_the_runs_steps(tmp_path):
    ev = tmp_path / "ev.yaml"
    ev.write_text("- {at_step: 10, device: slow0, throughput: 0.5}\n- {at_fraction: 0.5, device: slow0, throughput: 1}\n")
    with pytest.raises(ConfigError) as exc:
        events.load_timeline([{"at": "5s", "device": "fast0", "throughput": 1}], "c.yaml", str(ev))
    assert exc.value.errors == [
        f"{ev}: events[0].at_step: a timeline places every event in seconds ('at') or every event by training step "
        "('at_step'/'at_fraction'), not both (c.yaml: events[0] uses 'at')",
        f"{ev}: events[1].at_fraction: a timeline places every event in seconds ('at') or every event by training "
        "step ('at_step'/'at_fraction'), not both (c.yaml: events[0] uses 'at')"]
    tl = events.load_timeline(None, "c.yaml", str(ev))  # the share stays a share until the steps are known
    assert [(e.at_step, e.at_fraction) for e in tl] == [(10, None), (None, 0.5)]
    assert [e.at_step for e in events.load_timeline(None, "c.yaml", str(ev), total_steps=40)] == [10, 20]
    with pytest.raises(ConfigError, match=r"events\[1\].at_fraction: a share of the run needs the run's total steps"):
        events.resolve_steps(tl, None)


def _step_player(spec, tmp_path, *items, log_path=None):
    plan = Weather(spec, [0.5] * 4).plan(events.timeline(parse(*items)))
    applied, lines = [], []
    player = EventPlayer(plan, lambda c: applied.append(c.index) or [], "mark", str(tmp_path / "mark"),
                         log_path, lines.append, step_path=str(tmp_path / "step"))
    return player, applied, lines


def test_a_step_event_applies_when_rank_0_reports_its_step_and_not_before(spec, tmp_path, monkeypatch):
    log = tmp_path / "events.jsonl"
    player, applied, lines = _step_player(spec, tmp_path, {"at_step": 3, "device": "slow0", "throughput": 0.5},
                                          {"at_step": 5, "device": "slow0", "throughput": 1},
                                          {"at_step": 90, "device": "slow0", "throughput": 0.2}, log_path=str(log))
    monkeypatch.setenv(events.STEP_ENV, str(tmp_path / "step"))
    monkeypatch.setenv("RANK", "0")
    player.start(time.monotonic())  # no mark_start(): step events wait for no clock
    for n in range(3):
        events.mark_step(n)
        _wait_for(lambda: player.step == n)  # the player has read it ...
        assert applied == [], f"applied before step 3 (at {n})"  # ... and applied nothing
    events.mark_step(3)
    _wait_for(lambda: applied == [0])
    time.sleep(3 * events_poll())
    assert applied == [0]  # the next one waits for step 5
    monkeypatch.setenv("RANK", "1")
    events.mark_step(7)  # another rank's report does not count
    time.sleep(3 * events_poll())
    assert applied == [0] and player.step == 3
    monkeypatch.setenv("RANK", "0")
    events.mark_step(6)  # past step 5 in one jump (a step shorter than the poll): applied at once
    _wait_for(lambda: applied == [0, 1])
    player.stop()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["at"], r["at_step"], r["applied_step"], r["applied"]) for r in rows] == [
        (None, 3, 3, True), (None, 5, 6, True), (None, 90, None, False)]
    assert rows[0]["applied_at"] >= 0 and abs(rows[0]["wall"] - time.time()) < 60
    assert rows[2]["reason"] == "the run ended at step 6"
    assert lines[0].startswith("event 0 at step 3 (+") and ", wall 20" in lines[0]
    assert "placed at step 5" in lines[1]
    assert lines[2] == ("event 2 at step 90 not applied (the run ended at step 6): device slow0 throughput 1 -> "
                        "0.2 (0.500 -> 0.100 cores)")
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # written by rename: never half a number


def events_poll():
    from pdv_ext.emulate import player as player_module

    return player_module.POLL_S


def test_no_progress_reported_never_applies_and_never_hangs(spec, tmp_path):
    player, applied, lines = _step_player(spec, tmp_path, {"at_step": 0, "device": "slow0", "throughput": 0.5})
    player.start(time.monotonic())
    time.sleep(0.2)
    t0 = time.monotonic()
    player.stop()
    assert time.monotonic() - t0 < 2 and applied == [] and not player._thread.is_alive()
    assert lines == ["event 0 at step 0 not applied (no rank reported training progress: step events need rank 0 "
                     "to call pdv_ext.emulate.events.mark_step(n) after each step): device slow0 throughput 1 -> "
                     "0.5 (0.500 -> 0.250 cores)"]


def test_mark_step_is_a_noop_outside_the_emulator_and_on_other_ranks(monkeypatch, tmp_path):
    monkeypatch.delenv(events.STEP_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    events.mark_step(3)
    assert os.listdir(tmp_path) == []
    monkeypatch.setenv(events.STEP_ENV, str(tmp_path / "step"))
    monkeypatch.setenv("RANK", "2")
    events.mark_step(3)
    assert os.listdir(tmp_path) == [] and events.read_step(str(tmp_path / "step")) is None
    monkeypatch.setenv("RANK", "0")
    events.mark_step(3)
    events.mark_step(4)
    assert os.listdir(tmp_path) == ["step"] and events.read_step(str(tmp_path / "step")) == 4


def test_the_launcher_gives_a_step_timeline_its_step_file(spec, tmp_path):
    em = launcher.Emulation(spec, ["true"], events=parse({"at_fraction": 0.5, "device": "slow0", "throughput": 0.5}),
                            total_steps=30, events_clock="launch")
    assert em.by_step and em.events[0].at_step == 15 and em.step_path is None
    em._mark_dir = str(tmp_path)  # what setup() makes
    env = em.rank_env(0)
    assert env[events.STEP_ENV] == str(tmp_path / "step") and events.MARK_ENV not in env
    with pytest.raises(ConfigError, match="needs the run's total steps"):
        launcher.Emulation(spec, ["true"], events=parse({"at_fraction": 0.5, "device": "slow0", "throughput": 0.5}))
    timed = launcher.Emulation(spec, ["true"], events=parse({"at": 1, "device": "slow0", "throughput": 0.5}))
    timed._mark_dir = str(tmp_path)
    assert not timed.by_step and events.STEP_ENV not in timed.rank_env(0)


def test_each_rank_is_told_its_cpu_group(spec):
    """The rank's device clock (emulated_device.py) reads its quota from the group the emulator names."""
    from pdv_ext import emulated_device as device_clock

    class Groups:  # cgroup.CpuGroups' names, without the groups
        paths = [f"/cg/d{i}" for i in range(4)]

        def host_procs(self, host):
            return f"/cg/host-{host}/cgroup.procs"

        def procs_file(self, i):
            return f"{self.paths[i]}/cgroup.procs"

    em = launcher.Emulation(spec, ["true"])
    assert device_clock.ENV not in em.rank_env(1)  # no CPU groups (not set up): no device clock
    em.groups = Groups()
    assert em.rank_env(1)[device_clock.ENV] == "/cg/d1"


def test_dry_run_of_a_step_timeline(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CLUSTER, "events": [{"at_fraction": 0.4, "device": "slow0", "throughput": 0.5},
                                                          {"at_step": 10, "device": "slow0", "throughput": 1}]}))
    assert cli.main(["--cluster", str(path), "--dry-run", "--top-share", "0.5", "--total-steps", "80"]) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "timeline: 2 events, by training step, as rank 0 reports it (mark_step)",
        "event 0 at step 10: device slow0 throughput 1 -> 1 (0.250 -> 0.250 cores)",
        "event 1 at step 32 (0.4 of the run): device slow0 throughput 1 -> 0.5 (0.250 -> 0.125 cores)"]
    assert cli.main(["--cluster", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pdv emulate: {path}: events[0].at_fraction: a share of the run "
                                               "needs the run's total steps"), err


# ---- faults (issue #37 item 4): a host or a device stops, and comes back ---------------------------------
def test_fault_events_parse_check_and_plan(spec):
    evs = parse({"at_step": 30, "host": "b", "down": True}, {"at_step": 40, "device": "fast1", "down": True},
                {"at_step": 60, "host": "b", "down": False})
    assert events.faults(evs) and not events.faults(parse({"at": 1, "device": "slow0", "throughput": 0.5}))
    events.check(evs, spec)
    changes = Weather(spec, [0.5] * 4).plan(evs)
    assert [(c.down, c.hosts_down, c.up, c.hosts_up) for c in changes] == [
        ([2, 3], [1], [], []), ([1], [], [], []), ([], [], [2, 3], [1])]
    assert changes[0].text == "host b (slow0, slow1) down: its processes killed, its memory wiped, its uplink down"
    assert changes[2].text == "host b (slow0, slow1) back: a new agent joins the job"
    from pdv_ext.emulate.elastic import fewest_left

    assert fewest_left(4, changes) == 1  # slow0, slow1 and fast1 down at once
    assert fewest_left(4, changes[:1]) == 2


@pytest.mark.parametrize("items, words", [
    ([{"at_step": 3, "device": "slow0", "down": True, "throughput": 0.5}], "exactly one of 'throughput'"),
    ([{"at_step": 3, "host": "c", "down": True}], "events[0].host: unknown host 'c'"),
    ([{"at_step": 3, "host": "b", "down": False}], "events[0].down: host 'b' is not down at step 3"),
    ([{"at_step": 3, "device": "slow0", "down": True}, {"at_step": 4, "host": "b", "down": True},
      {"at_step": 5, "host": "b", "down": True}], "events[2].down: host 'b' is already down at step 5"),
    ([{"at_step": 3, "host": "a", "down": True}, {"at_step": 4, "host": "b", "down": True}],
     "events[1]: every device is down at step 4"),
])
def test_faults_that_make_no_sense_are_one_line_each(spec, items, words):
    with pytest.raises(ConfigError) as exc:
        events.check(parse(*items), spec)
    assert any(words in line for line in exc.value.errors), exc.value.errors


def test_a_fault_timeline_runs_elastic_and_says_so(spec, tmp_path, capsys):
    em = launcher.Emulation(spec, ["true"], events=parse({"at_step": 3, "host": "b", "down": True}))
    assert em.elastic and not launcher.Emulation(spec, ["true"]).elastic
    assert launcher.Emulation(spec, ["true"], elastic=True).elastic
    assert em.host_memory("b").endswith(f"{em.name}-memory/b")
    from pdv_ext.emulate import elastic

    cmd = elastic.agent_command(["python", "job.py"], 2, 4, "10.251.0.1", em.name, 4, "/cg/d0/cgroup.procs")
    assert "--nnodes=2:4" in cmd and "--local-addr=10.251.0.1" in cmd and cmd[-2:] == ["python", "job.py"]
    assert "$$" not in " ".join(cmd)  # torchrun reads $$ in a worker's arguments as an escaped $
    env = elastic.agent_env(em.rank_env(2), "/mem/b")
    assert "RANK" not in env and env["PDV_DEVICE_NAME"] == "slow0" and env[elastic.MEMORY_ENV] == "/mem/b"
    assert env["PDV_RECOVERY_STORE"] == f"{elastic.STORE_IP}:{elastic.STORE_PORT}"  # in-place recovery meets there
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CLUSTER, "events": [{"at_step": 5, "device": "slow1", "down": True}]}))
    assert cli.main(["--cluster", str(path), "--dry-run", "--top-share", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "event 0 at step 5: device slow1 down: its processes killed"
    assert out[-3].startswith("supervision: a torchrun agent per device")


def test_ranks_find_their_devices_by_name_in_any_order():
    cluster = Cluster.from_dict(CLUSTER)
    assert cluster.devices_named(["slow1", "fast0"]) == [3, 0]
    assert cluster.devices_named(["slow1", "slow1"]) is None and cluster.devices_named(["rank0", "fast0"]) is None
    assert cluster.devices_named([None, None]) is None


def test_the_host_memory_replaces_the_snapshot_root(monkeypatch):
    from pdv_ext.recovery.config import SnapshotsConfig

    monkeypatch.delenv("PDV_HOST_MEMORY", raising=False)
    assert SnapshotsConfig(root="/x").root_dir() == "/x"
    monkeypatch.setenv("PDV_HOST_MEMORY", "/dev/shm/pdv-abc123-memory/b")
    assert SnapshotsConfig(root="/x").root_dir() == "/dev/shm/pdv-abc123-memory/b"


def test_cleanup_leaves_a_running_emulation_alone(tmp_path, monkeypatch):
    """`pdv emulate --cleanup` (CI runs it in a test) once removed a benchmark's live namespaces and cgroups."""
    import tempfile

    from pdv_ext.emulate import elastic

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "shm").mkdir()  # (as above: never a live run's memory)
    monkeypatch.setattr(elastic, "memory_root", lambda run: str(tmp_path / "shm" / f"{run}-memory"))
    monkeypatch.setattr(netns, "stale_namespaces", lambda: ["pdv-aaaaaa-d0", "pdv-bbbbbb-d0"])
    removed = []
    monkeypatch.setattr(netns, "remove_namespaces", lambda names: removed.extend(names))
    monkeypatch.setattr(cgroup, "stale", lambda prefix="pdv-": [])
    launcher._claim("pdv-aaaaaa")  # this test's process owns run aaaaaa: alive
    (tmp_path / "pdv-bbbbbb.owner").write_text("999999999 1.0\n")  # an owner long gone
    (tmp_path / "pdv-aaaaaa-mark-x").mkdir()
    (tmp_path / "pdv-bbbbbb-mark-y").mkdir()
    logs = []
    assert launcher.cleanup_stale(log=logs.append) == 2
    assert removed == ["pdv-bbbbbb-d0"] and sorted(os.listdir(tmp_path)) == ["pdv-aaaaaa-mark-x", "pdv-aaaaaa.owner",
                                                                             "shm"]
    assert any("left pdv-aaaaaa alone" in m for m in logs)
    launcher._release("pdv-aaaaaa")
    assert launcher.live_runs() == {}
