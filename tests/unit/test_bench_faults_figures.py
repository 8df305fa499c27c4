"""`pdv bench faults`' figures from its ways' logs (pdv_ext/bench/faults.py `_summary`, `_combine`): what the
snapshots cost after the loss and at the start, beside the figures before it."""
import os

import pytest

from pdv_ext.bench import faults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _log(start_at, first_step_at, step_s_before, lost_at, resume_at, restart_s, step_s_after, steps=40,
         in_place=False):
    """One way's log as faults_job.py writes it: a start record per attempt, a record per finished step."""
    lines = [{"attempt": 0, "world": 4, "start": 0, "t_process": start_at, "t_ready": start_at + 1.0,
              "resume_s": 0.0}]
    t = first_step_at
    for s in range(1, lost_at + 1):
        lines.append({"step": s, "attempt": 0, "t": t})
        t += step_s_before
    t_restart = t + restart_s
    lines.append({"attempt": 1, "world": 3, "start": resume_at, "t_process": t_restart, "t_ready": t_restart,
                  "resume_s": 0.0, **({"in_place": True, "parts": {"agree_s": 0.1, "group_s": 0.0,
                                                                    "engine_s": 0.0}} if in_place else {})})
    t = t_restart + step_s_after
    for s in range(resume_at + 1, steps + 1):
        lines.append({"step": s, "attempt": 1, "t": t})
        t += step_s_after
    lines.append({"held_out": 1.0, "attempt": 1})
    return {"logs": {"hostA-rank0": lines}, "t_kill": None, "wall_s": t - start_at}


def test_the_survivors_steps_and_the_start_are_compared():
    rec = faults._summary(_log(0.0, 12.0, 0.30, 15, 15, 3.0, 0.36, in_place=True), 40)
    disk = faults._summary(_log(0.0, 10.0, 0.30, 15, 10, 15.0, 0.30), 40)
    assert rec["step_s_after"] == pytest.approx(0.36) and disk["step_s_after"] == pytest.approx(0.30)
    assert rec["first_step_at_s"] == 12.0 and disk["first_step_at_s"] == 10.0
    res = {"recovered": rec, "disk_restart": disk}
    faults._combine(res)
    assert res["snapshot_overhead_after"] == pytest.approx(0.2, abs=1e-3)
    assert res["startup_extra_s"] == pytest.approx(2.0)
    assert res["snapshot_overhead_median"] == pytest.approx(0.0, abs=1e-3)  # before the loss: the same steps
    assert res["steps_lost"] == 0 and res["completed"]


def test_the_layouts_place_replicas_by_host_not_by_rank():
    """`--layout`: pipelines puts a stage's replicas on different hosts (a lost host leaves a whole pipeline
    and no snapshot crosses hosts), stages puts them side by side; both by host and device, so the ranks'
    rendezvous order changes nothing."""
    from pdv_ext.bench.faults import layout_names
    from pdv_ext.bench.faults_job import arrange
    from pdv_ext.placement.startup import load_cluster

    order = ["a0", "a1", "b0", "b1"]
    assert arrange(order, 2, "pipelines") == [["a0", "b0"], ["a1", "b1"]]
    assert arrange(order, 2, "stages") == [["a0", "a1"], ["b0", "b1"]]
    assert arrange(order, 1, "pipelines") == arrange(order, 1, "stages") == [order]
    cluster = load_cluster(os.path.join(ROOT, "launch", "clusters", "emulated_4dev.yaml"))
    assert layout_names(cluster, 2, "pipelines") == [["fast0", "slow0"], ["fast1", "slow1"]]
    assert layout_names(cluster, 2, "stages") == [["fast0", "fast1"], ["slow0", "slow1"]]


def _round(ratio, overhead, recovery, completed=True, lost=1, held=0.0):
    return {"recovered_vs_disk_restart": ratio, "snapshot_overhead": overhead, "recovery_s": recovery,
            "completed": completed, "steps_lost": lost, "held_out_vs_reference": held,
            "recovered": {"wall_s": 100 * ratio, "name": f"r{ratio}"}, "disk_restart": {"wall_s": 100.0}}


def test_repeats_report_the_rounds_medians_and_the_worst_of_what_must_always_hold():
    """`--repeats`: each figure the median of the rounds; `completed` only if every round completed, the most
    steps lost and the largest held-out difference of any round; the ways' summaries from the median round."""
    rounds = [_round(0.95, 0.20, 6.0), _round(0.80, 0.01, 7.0, lost=0), _round(0.84, 0.05, 5.0, held=1e-7)]
    res = {}
    mid = faults._median_rounds(res, rounds)
    assert mid == 2 and res["median_round"] == 3 and res["recovered"]["name"] == "r0.84"
    assert res["recovered_vs_disk_restart"] == 0.84 and res["snapshot_overhead"] == 0.05
    assert res["recovery_s"] == 6.0 and res["steps_lost"] == 1 and res["held_out_vs_reference"] == 1e-7
    assert res["completed"] and len(res["rounds"]) == 3 and res["rounds"][0]["recovered_wall_s"] == 95.0
    rounds[1]["completed"] = False
    faults._median_rounds(res, rounds)
    assert res["completed"] is False
    one = {}
    assert faults._median_rounds(one, [_round(0.9, 0.1, 4.0)]) == 0 and "rounds" not in one
    assert one["recovered_vs_disk_restart"] == 0.9


def test_repeats_is_checked_before_anything_runs(capsys):
    for argv, msg in ((["--repeats", "0"], "--repeats must be >= 1"), (["--repeats", "2"], "needs --scenario")):
        with pytest.raises(SystemExit) as exc:
            faults.main(argv)
        assert exc.value.code == 2 and msg in capsys.readouterr().err
