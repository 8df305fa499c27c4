"""Cluster weather on a running emulation (root): a device's CPU quota and a pair's link rate are observed to
change when their events are applied, each event is logged, and nothing is left behind.

Both changes are 10x so that a shared, busy machine cannot hide them: a quota is a ceiling the rank cannot
exceed whatever the load, and a shaped link cannot pass more than its rate; only the "before" figures depend on
the machine having CPU to spare, and they are held to a small fraction of their nominal values."""
import json
import secrets
import subprocess
import sys

import pytest

from .test_emulate_cluster import EMULATE_MARKS, ROOT, WORKERS, _leftovers, _rank_json

pytestmark = EMULATE_MARKS

CLUSTER = """
devices:
  - {name: d0, host: a, throughput: 1.0}
  - {name: d1, host: b, throughput: 1.0}
links:
  intra_host: {bandwidth: 800 Mbit/s, latency: 50us}
  inter_host: {bandwidth: 200 Mbit/s, latency: 1ms}
"""
TOP_SHARE = 0.5  # cores of each device at start


def _emulate(tmp_path, events, cmd, *flags):
    cluster, ev, log = tmp_path / "c.yaml", tmp_path / "events.yaml", tmp_path / "events.jsonl"
    cluster.write_text(CLUSTER)
    ev.write_text(events)
    run = f"pdv-{secrets.token_hex(3)}"
    p = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "emulate", "--cluster", str(cluster), "--run-name", run,
                        "--top-share", str(TOP_SHARE), "--events", str(ev), "--events-log", str(log), *flags,
                        "--timeout", "40", "--", sys.executable, WORKERS, *cmd],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not _leftovers(run)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return p, _rank_json(p.stdout), rows


def _rate(windows, start, end):
    """Per second over the windows that lie wholly in [start, end]."""
    inside = [w for w in windows if w[0] >= start and w[1] <= end]
    assert len(inside) >= 2, (start, end, windows)
    return sum(w[2] for w in inside) / sum(w[1] - w[0] for w in inside)


@pytest.mark.timeout(90)
def test_throughput_event_changes_the_running_quota(tmp_path):
    p, ranks, rows = _emulate(tmp_path, "- {at: 2.5s, device: d1, throughput: 0.1}\n"
                                        "- {at: 1h, device: d1, throughput: 1.0}\n", ["spin", "5"])
    applied, cut = rows
    assert (applied["index"], applied["kind"], applied["target"], applied["applied"]) == (0, "device", "d1", True)
    assert applied["before"] == {"throughput": 1.0, "cores": TOP_SHARE}
    assert applied["after"] == {"throughput": 0.1, "cores": pytest.approx(TOP_SHARE / 10)}
    assert applied["applied_at"] >= 2.5 - 0.01  # never early
    assert (cut["applied"], cut["reason"]) == (False, "the run ended first")
    assert "event 0 at +2." in p.stderr and "device d1 throughput 1 -> 0.1 (0.500 -> 0.050 cores)" in p.stderr
    assert "event 1 at +3600.0s not applied (the run ended first)" in p.stderr

    t = applied["wall"]
    spin = ranks[1]["windows"]
    before, after = _rate(spin, 0, t - 0.1), _rate(spin, t + 0.3, float("inf"))
    # the new quota is a ceiling: 0.05 of a core whatever else runs; before, the rank had up to 0.5
    assert after <= 1.5 * TOP_SHARE / 10, (before, after)
    assert before >= 3 * after, (before, after)


@pytest.mark.timeout(90)
def test_pair_and_link_events_change_the_running_link_rate_from_the_mark(tmp_path):
    p, ranks, rows = _emulate(tmp_path, "events:\n  - {at: 1.5s, pair: {a: d0, b: d1}, bandwidth: 20 Mbit/s}\n"
                                        "  - {at: 3s, link: inter_host, bandwidth: 200 Mbit/s}\n",
                              ["stream", "4.5"], "--events-clock", "mark")
    pair, link = rows
    assert (pair["kind"], pair["target"], pair["applied"]) == ("pair", "d0<->d1", True)
    assert pair["before"]["bandwidth"] == pytest.approx(200e6 / 8)
    assert pair["after"]["bandwidth"] == pytest.approx(20e6 / 8)
    assert (link["kind"], link["target"], link["applied"]) == ("link", "inter_host", True)
    assert "timeline started by a rank's mark_start()" in p.stderr
    assert "pair d0<->d1 bandwidth 200.0 -> 20.0 Mbit/s (and 2 host uplinks)" in p.stderr

    received = ranks[1]
    t1, t2, mark = pair["wall"], link["wall"], received["mark"]
    assert 1.5 - 0.05 <= t1 - mark <= 1.5 + 1.5  # counted from the rank's mark, not from the launch
    windows = received["windows"]
    before, slow = _rate(windows, 0, t1 - 0.1), _rate(windows, t1 + 0.3, t2 - 0.1)
    again = _rate(windows, t2 + 0.3, float("inf"))
    assert slow <= 1.2 * 20e6 / 8, (before, slow, again)  # the new rate is a ceiling
    assert before >= 3 * slow and again >= 3 * slow, (before, slow, again)  # the pair's and the uplinks' classes


STEPPER = ("import json, sys, time\n"
           "from pdv_ext.emulate.events import mark_step\n"
           "walls = []\n"
           "for i in range(int(sys.argv[1])):\n"
           "    mark_step(i)\n"
           "    walls.append(time.time())\n"
           "    time.sleep(0.1)\n"
           "print(json.dumps(walls))\n")


def _emulate_steps(tmp_path, events, steps):
    cluster, ev, log = tmp_path / "c.yaml", tmp_path / "events.yaml", tmp_path / "events.jsonl"
    cluster.write_text(CLUSTER)
    ev.write_text(events)
    run = f"pdv-{secrets.token_hex(3)}"
    p = subprocess.run([sys.executable, "-m", "pdv_ext.cli", "emulate", "--cluster", str(cluster), "--run-name", run,
                        "--top-share", str(TOP_SHARE), "--events", str(ev), "--events-log", str(log),
                        "--timeout", "40", "--", sys.executable, "-c", STEPPER, str(steps)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not _leftovers(run)
    return p, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.timeout(90)
def test_step_events_follow_rank_0s_reported_steps(tmp_path):
    """Rank 0 reports steps 0..29 every 0.1 s (rank 1's reports do not count): the event at step 10 is applied
    once step 10 is reported, and not before; one at step 100 is not reached and is said so."""
    p, rows = _emulate_steps(tmp_path, "- {at_step: 10, device: d1, throughput: 0.5}\n"
                                       "- {at_step: 100, device: d1, throughput: 1.0}\n", 30)
    applied, cut = rows
    walls = json.loads(next(line.split("] ", 1)[1] for line in p.stdout.splitlines() if line.startswith("[rank 0] ")))
    assert (applied["applied"], applied["at_step"], applied["at"]) == (True, 10, None)
    # step 10 is written 0.1 s after step 9 was: an event applied at step 9 would be within ~0.02 s of walls[9]
    assert applied["applied_step"] in (10, 11) and applied["wall"] > walls[9] + 0.05
    assert (cut["applied"], cut["applied_step"], cut["reason"]) == (False, None, "the run ended at step 29")
    assert "event 0 at step 1" in p.stderr and "event 1 at step 100 not applied (the run ended at step 29)" in p.stderr


@pytest.mark.timeout(90)
def test_step_events_without_progress_never_apply_and_the_run_ends(tmp_path):
    p, rows = _emulate_steps(tmp_path, "- {at_step: 0, device: d1, throughput: 0.5}\n", 0)
    assert [(r["applied"], r["reason"]) for r in rows] == [
        (False, "no rank reported training progress: step events need rank 0 to call "
                "pdv_ext.emulate.events.mark_step(n) after each step")]
