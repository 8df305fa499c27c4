"""The `replan` policy on synthetic metrics: a device that stays slow makes it re-plan with the start-up
solver (pipe 4), or split the data instead when that is as good (pipe 2 x data 2); a saving smaller than the
move's cost, noise, and a short blip change nothing; a recovery moves back."""
import yaml
import pytest

from pdv_ext.placement.cost import evaluate
from pdv_ext.placement.profile import LayerProfile, Profile
from pdv_ext.placement.cluster import Cluster
from pdv_ext.placement.solvers import solve
from pdv_ext.policy.base import Replan, SetDataShares, TrainContext, build_policy

LAYERS = 8


def write_files(tmp_path, work):
    prof = Profile([LayerProfile(f"l{i}", w, 1e5, 1e4) for i, w in enumerate(work)])
    prof.save(str(tmp_path / "p.json"))
    cl = {"devices": [{"name": f"d{i}", "host": "a", "throughput": 1.0} for i in range(4)],
          "links": {"intra_host": {"bandwidth": "10 Gbit/s", "latency": "50us"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cl))
    return str(tmp_path / "c.yaml"), str(tmp_path / "p.json")


@pytest.fixture
def files(tmp_path):
    return write_files(tmp_path, [0.01] * LAYERS)


class Run:
    """Ranks whose compute time is the profile's layers over their device's true speed (x a calibration)."""

    def __init__(self, files, mapping, boundaries, total_mb=8, scale=3.0):
        self.cluster, self.profile = files
        self.work = [float(w) for w in Profile.load(self.profile).arrays()["fwd_bwd"]]
        self.plan = {"boundaries": list(boundaries), "rank_mapping": [list(r) for r in mapping]}
        self.speed = [1.0] * 4
        self.total, self.scale = total_mb, scale
        self.shares = [total_mb // len(mapping[0])] * len(mapping[0])
        self.step = 0
        #: a device is slow only with at least this much work (a quota that a light load never reaches)
        self.slow_from_work = 0.0
        #: the devices' speeds as the whole step sees them (None: as the compute times): a slow device whose
        #: communication and optimizer step slow down too costs the step more than its compute shows
        self.step_speed = None
        #: device -> its speed as read on a load below `light_below` (a light load that waits for its quota)
        self.work_speed, self.light_below = {}, 0.0

    def ctx(self):
        return TrainContext(world_size=4, dp_size=len(self.shares), micro_batch_size=4, micro_batches=self.shares[0],
                            lr=1e-3, extra={"placement": {**self.plan, "cluster": self.cluster, "profile": self.profile,
                                                          "solver": "dp", "schedule": "1f1b", "aggregator": "mean",
                                                          "solver_options": {}}})

    def metrics(self):
        self.step += 1
        b, rows = self.plan["boundaries"], self.plan["rank_mapping"]
        compute, stage_of, replica_of = [0.0] * 4, [0] * 4, [0] * 4
        for s, row in enumerate(rows):
            for d, r in enumerate(row):
                work = sum(self.work[b[s]:b[s + 1]])
                speed = self.speed[r] if work >= self.slow_from_work else 1.0
                if work < self.light_below and r in self.work_speed:
                    speed = self.work_speed[r]
                compute[r] = self.scale * work / speed * self.shares[d]
                stage_of[r], replica_of[r] = s, d
        step_time = max(compute) * 1.5
        if self.step_speed is not None:
            cl = Cluster.load(self.cluster)
            prof, cl = Profile.load(self.profile), cl.with_throughputs(self.step_speed)
            whole = evaluate(prof, cl, b, rows, self.total // len(rows[0]))
            pipes = [evaluate(prof, cl, b, [[row[d]] for row in rows], n).pipeline_time
                     for d, n in enumerate(self.shares)]  # every replica with its share, then the common tail
            step_time = 0.5 * self.scale * (max(pipes) + whole.tail_time)
        return {"step": self.step, "compute_times": compute, "data_shares": list(self.shares),
                "replica_of_rank": replica_of, "stage_of_rank": stage_of, "step_time": step_time}

    def apply(self, acts):
        for a in acts:
            if isinstance(a, Replan):
                self.plan = {"boundaries": list(a.boundaries), "rank_mapping": [list(r) for r in a.rank_mapping]}
                replicas = len(a.rank_mapping[0])
                if replicas != len(self.shares):  # another depth: the global batch over the new replicas, equally
                    self.shares = [self.total // replicas] * replicas
            elif isinstance(a, SetDataShares):
                self.shares = list(a.shares) if a.shares else [self.total // len(self.shares)] * len(self.shares)


def run(pol, r, steps):
    out = []
    for _ in range(steps):
        acts = pol.after_step(r.metrics())
        out += [(r.step, a) for a in acts]
        r.apply(acts)
    return out


def test_pipe4_slow_device_is_replanned_and_moved_back(files):
    r = Run(files, [[0], [1], [2], [3]], [0, 2, 4, 6, 8])
    pol = build_policy({"name": "replan", "total_steps": 500})
    pol.on_train_begin(r.ctx())
    assert run(pol, r, 10) == []  # calm: nothing
    r.speed[3] = 0.4
    acts = run(pol, r, 10)
    assert len(acts) == 1 and isinstance(acts[0][1], Replan)
    new = acts[0][1]
    assert new.boundaries[-1] - new.boundaries[-2] < 2 or 3 not in [row[0] for row in new.rank_mapping[-1:]]
    d = pol.decisions[-1]
    assert d["kind"] == "replan" and d["predicted_after"] < d["predicted_before"] and d["saving"] > d["move_cost"]
    assert "saving" in new.reason and "move cost" in new.reason
    cl = Cluster.load(files[0])
    slow = cl.to_dict()
    slow["devices"][3]["throughput"] = 0.4
    before = evaluate(Profile.load(files[1]), Cluster.from_dict(slow), [0, 2, 4, 6, 8], [[0], [1], [2], [3]], 8).step_time
    after = evaluate(Profile.load(files[1]), Cluster.from_dict(slow), list(new.boundaries),
                     [list(x) for x in new.rank_mapping], 8).step_time
    assert after < 0.8 * before
    assert run(pol, r, 20) == []  # the model now holds the measured speed: no churn
    r.speed[3] = 1.0
    back = run(pol, r, 20)
    assert len(back) == 1 and isinstance(back[0][1], Replan)


def test_a_move_must_predict_more_than_min_gain(files):
    """A move is made only when its predicted step is at least `min_gain` faster than the step now (less is
    within the cost model's accuracy): just below the gain the re-plan predicts it moves, just above it the
    choice is kept and recorded."""
    def slowdown(min_gain):
        r = Run(files, [[0], [1], [2], [3]], [0, 2, 4, 6, 8])
        pol = build_policy({"name": "replan", "total_steps": 500, "min_gain": min_gain})
        pol.on_train_begin(r.ctx())
        assert run(pol, r, 10) == []
        r.speed[3] = 0.4
        return run(pol, r, 10), pol

    acts, pol = slowdown(0.0)
    d = pol.decisions[0]
    gain = 1.0 - d["predicted_after"] / d["predicted_before"]
    assert [type(a).__name__ for _, a in acts] == ["Replan"] and gain > 0.2
    acts, pol = slowdown(gain - 0.02)
    assert [type(a).__name__ for _, a in acts] == ["Replan"]
    acts, pol = slowdown(gain + 0.02)
    assert acts == [] and pol.decisions and all(x["kind"] == "kept" for x in pol.decisions)


@pytest.mark.parametrize("confirm_load", [0.5, 0.0])
def test_a_device_fast_only_under_a_light_load_is_not_taken_for_recovered(tmp_path, confirm_load):
    """The emulated cluster's CPU quota: a slowed device left with only the small embedding layer runs at full
    speed. Measured that way it looks recovered; believing it moves the work back, where it is slow again - a
    move every few steps. With `confirm_load` (default) the policy moves once; without it (0), and without
    `min_gain` (a move back predicts a small gain here, which alone would also keep it), it churns."""
    files = write_files(tmp_path, [0.001] + [0.01] * (LAYERS - 2) + [0.002])
    r = Run(files, [[0], [1], [2], [3]], [0, 3, 5, 7, 8])
    r.slow_from_work = 0.005
    pol = build_policy({"name": "replan", "total_steps": 500, "confirm_load": confirm_load,
                        "min_gain": 0.1 if confirm_load else 0.0})
    pol.on_train_begin(r.ctx())
    assert run(pol, r, 10) == []
    r.speed[1] = 0.3
    acts = run(pol, r, 60)
    assert acts and isinstance(acts[0][1], Replan)
    ranks = [row[0] for row in acts[0][1].rank_mapping]
    b = acts[0][1].boundaries
    assert sum(r.work[b[ranks.index(1)]:b[ranks.index(1) + 1]]) < r.slow_from_work  # the embedding alone
    if confirm_load:
        assert len(acts) == 1
        assert pol.slow_load == {1: pytest.approx(0.02)}
    else:
        assert len(acts) >= 3  # what the guard prevents


def calm_pipe4_with_step_times(tmp_path):
    """Pipe 4 over 12 layers (light embedding and head) whose step time follows the cost model, after 10 calm
    steps: the policy has calibrated the model's step to the run's."""
    files = write_files(tmp_path, [0.001] + [0.01] * 10 + [0.002])
    r = Run(files, [[0], [1], [2], [3]], [0, 3, 6, 9, 12])
    r.step_speed = [1.0] * 4
    pol = build_policy({"name": "replan", "total_steps": 500})
    pol.on_train_begin(r.ctx())
    assert run(pol, r, 10) == []
    return r, pol


@pytest.mark.parametrize("ratio, calib", [(0.85, 1.0), (1.2, 1.0), (0.6, 0.6), (1.5, 1.5)])
def test_calm_steps_calibrate_the_model_only_beyond_its_accuracy(tmp_path, ratio, calib):
    """Calm steps within `calib_band` (25%) of the cost model's step leave the profile's seconds as they are (a
    machine's passing speed is not the model's error); further off, their median calibrates the model, and
    one step in five three times slower does not move it."""
    files = write_files(tmp_path, [0.001] + [0.01] * 10 + [0.002])
    r = Run(files, [[0], [1], [2], [3]], [0, 3, 6, 9, 12], scale=2 * ratio)
    r.step_speed = [1.0] * 4  # step time = 0.5 * scale * the model's step
    pol = build_policy({"name": "replan", "total_steps": 500})
    pol.on_train_begin(r.ctx())
    for i in range(30):
        m = r.metrics()
        if i % 5 == 4:
            m["step_time"] *= 3.0
        assert pol.after_step(m) == []
    assert pol.step_calib == pytest.approx(calib, rel=1e-6)
    assert len(pol.calm_ratios) == 30 - pol.options.warmup_steps
    assert pol.state_dict()["calm_ratios"] == pol.calm_ratios  # it resumes with the run


def test_the_first_move_plans_for_the_slowdown_the_step_sees(tmp_path):
    """The compute times show d1 at half speed, but the step suffers as if it ran at a fifth (its
    communication and optimizer step slow down too, as on the emulated cluster). Before planning, the policy
    fits d1's speed to the measured step: the one move it makes is planned for a fifth, and the step after it
    is the one it predicted."""
    r, pol = calm_pipe4_with_step_times(tmp_path)
    r.speed[1], r.step_speed = 0.5, [1.0, 0.2, 1.0, 1.0]
    acts = run(pol, r, 80)
    assert [type(a).__name__ for _, a in acts] == ["Replan"]
    first = pol.decisions[-1]
    assert first["throughputs"][1] == pytest.approx(0.2, rel=0.05)  # the step's view of d1
    assert pol.throughputs[1] == pytest.approx(0.5, rel=0.1)  # its compute view is kept apart
    assert r.metrics()["step_time"] == pytest.approx(first["predicted_after"], rel=0.1)


def test_a_move_that_does_not_deliver_is_corrected_from_the_step_time(tmp_path):
    """After a move, the step gets slower than the model predicts (d1's links or optimizer step slow down
    further while its compute times stay at half speed): the policy fits d1's speed to the measured step
    and moves again - once: the step then matches the model and nothing more happens."""
    r, pol = calm_pipe4_with_step_times(tmp_path)
    r.speed[1], r.step_speed = 0.5, [1.0, 0.5, 1.0, 1.0]
    acts = []
    while not acts and r.step < 60:
        acts = run(pol, r, 1)
    assert [type(a).__name__ for _, a in acts] == ["Replan"]
    r.step_speed = [1.0, 0.2, 1.0, 1.0]
    acts += run(pol, r, 80)
    assert [type(a).__name__ for _, a in acts] == ["Replan", "Replan"]
    first, second = [d for d in pol.decisions if d["kind"] == "replan"]
    assert first["throughputs"][1] == pytest.approx(0.5, rel=0.1)
    assert second["throughputs"][1] == pytest.approx(0.2, rel=0.05)  # the step's view of d1
    assert pol.throughputs[1] == pytest.approx(0.5, rel=0.1)  # its compute view is unchanged
    measured = r.metrics()["step_time"]
    assert measured < 0.8 * first["predicted_before"]
    assert measured == pytest.approx(second["predicted_after"], rel=0.1)
    again = build_policy({"name": "replan", "total_steps": 500})  # what a checkpoint keeps of it
    again.load_state_dict(pol.state_dict())
    assert (again.step_factor, again.slow_load, again.plan, again.start_stages) == (
        pol.step_factor, pol.slow_load, pol.plan, pol.start_stages)
    assert again.step_factor[1] == pytest.approx(0.4, rel=0.05)


def test_a_device_faster_than_described_changes_nothing(files):
    """The policy follows slowdowns and recoveries only: a device that reads faster than the cluster YAML
    says (noise in the profile or the timing, here a steady 1.6x) never makes it re-plan."""
    r = Run(files, [[0], [1], [2], [3]], [0, 2, 4, 6, 8])
    r.speed[2] = 1.6
    pol = build_policy({"name": "replan", "total_steps": 500})
    pol.on_train_begin(r.ctx())
    assert run(pol, r, 40) == [] and pol.decisions == []
    r.speed[0] = 0.4  # a real slowdown is still seen
    acts = run(pol, r, 20)
    assert len(acts) == 1 and isinstance(acts[0][1], Replan)
    assert pol.throughputs[2] == 1.0 and pol.throughputs[0] < 0.5


def test_small_saving_or_blip_changes_nothing(files):
    r = Run(files, [[0], [1], [2], [3]], [0, 2, 4, 6, 8])
    pol = build_policy({"name": "replan", "total_steps": 20})  # few steps left: the move would not pay
    pol.on_train_begin(r.ctx())
    run(pol, r, 10)
    r.speed[3] = 0.4
    assert run(pol, r, 20) == []
    assert pol.decisions and pol.decisions[-1]["kind"] == "kept"
    pol = build_policy({"name": "replan", "total_steps": 500})
    r = Run(files, [[0], [1], [2], [3]], [0, 2, 4, 6, 8])
    pol.on_train_begin(r.ctx())
    run(pol, r, 5)
    r.speed[3] = 0.4
    run(pol, r, 2)  # fewer agreement steps than `patience`
    r.speed[3] = 1.0
    assert run(pol, r, 20) == []


def test_pipe2x2_prefers_data_shares_when_they_do_as_well(files):
    r = Run(files, [[0, 1], [2, 3]], [0, 4, 8])
    r.step_speed = [1.0] * 4
    pol = build_policy({"name": "replan", "total_steps": 500})
    pol.on_train_begin(r.ctx())
    run(pol, r, 5)
    r.speed[1], r.step_speed = 0.4, [1.0, 0.4, 1.0, 1.0]  # stage 0 of replica 1
    acts = run(pol, r, 10)
    assert acts and isinstance(acts[0][1], SetDataShares)
    assert acts[0][1].shares[1] < acts[0][1].shares[0]
    pol = build_policy({"name": "replan", "total_steps": 500, "allow_shares": False})
    r = Run(files, [[0, 1], [2, 3]], [0, 4, 8])
    pol.on_train_begin(r.ctx())
    run(pol, r, 5)
    r.speed[1] = 0.4
    acts = run(pol, r, 10)
    assert acts and isinstance(acts[0][1], Replan)


#: a profile like the demo model's: a light embedding, eight blocks, a light head
DEMO_WORK = [0.0007, 0.0538, 0.056, 0.0512, 0.066, 0.0528, 0.0559, 0.0508, 0.0593, 0.0037]


@pytest.mark.parametrize("change_depth", [True, False])
def test_pipe2x2_changes_depth_when_the_slow_device_can_take_a_light_stage(tmp_path, change_depth):
    """Pipe 2 x data 2, d1 slow (its compute at 0.4, the whole step seeing it at 0.3): every pipe-2 plan keeps
    the same boundaries in both replicas, so the slow device carries half a replica's layers or fewer
    micro-batches; pipe 4 gives it the light head alone. The policy moves to 4 stages (the step it predicts
    is the one measured after); with `change_depth: false` it stays at 2 stages and splits the data. The calm
    cluster never changes depth, though the model prefers pure data parallelism there."""
    files = write_files(tmp_path, DEMO_WORK)
    r = Run(files, [[0, 1], [2, 3]], [0, 5, 10])
    r.step_speed = [1.0] * 4
    pol = build_policy({"name": "replan", "total_steps": 80, "change_depth": change_depth})
    pol.on_train_begin(r.ctx())
    assert run(pol, r, 20) == []
    if change_depth:  # the model's preference on the cluster as described: pure data parallelism
        cl, prof = Cluster.load(files[0]), Profile.load(files[1])
        assert solve("dp", prof, cl, 1, 2).predicted_step_time < solve("dp", prof, cl, 2, 4).predicted_step_time
    r.speed[1], r.step_speed = 0.4, [1.0, 0.3, 1.0, 1.0]
    acts = run(pol, r, 40)
    assert len(acts) == 1
    d = pol.decisions[-1]
    if not change_depth:
        assert isinstance(acts[0][1], SetDataShares) and d["stages"] == 2
        return
    new = acts[0][1]
    assert isinstance(new, Replan) and len(new.rank_mapping) == 4 and d["stages"] == 4
    assert "pipeline depth 2 -> 4" in new.reason
    s = [row[0] for row in new.rank_mapping].index(1)
    assert sum(DEMO_WORK[new.boundaries[s]:new.boundaries[s + 1]]) < 0.01  # d1: a light stage
    assert r.metrics()["step_time"] == pytest.approx(d["predicted_after"], rel=0.1)
    assert r.shares == [8]
    assert run(pol, r, 30) == []  # no churn


@pytest.mark.parametrize("confirm_load", [0.5, 0.0])
def test_a_light_load_on_a_slow_device_is_not_taken_for_a_further_slowdown(tmp_path, confirm_load):
    """After the move leaves the slow device the embedding alone, its compute times on that millisecond of
    work read it far slower still (on the emulated cluster such work waits for the next CPU-quota period):
    with `confirm_load` the policy does not act on that reading; without it, it moves again for nothing."""
    files = write_files(tmp_path, [0.001] + [0.01] * (LAYERS - 2) + [0.002])
    r = Run(files, [[0], [1], [2], [3]], [0, 3, 5, 7, 8])
    r.step_speed = [1.0] * 4
    pol = build_policy({"name": "replan", "total_steps": 500, "confirm_load": confirm_load,
                        "min_gain": 0.1 if confirm_load else 0.0})
    pol.on_train_begin(r.ctx())
    assert run(pol, r, 10) == []
    r.speed[1], r.step_speed = 0.3, [1.0, 0.3, 1.0, 1.0]
    acts = run(pol, r, 20)
    assert len(acts) == 1
    ranks = [row[0] for row in acts[0][1].rank_mapping]
    assert acts[0][1].boundaries[ranks.index(1) + 1] - acts[0][1].boundaries[ranks.index(1)] == 1  # one light layer
    modelled = pol.throughputs[1]
    r.slow_from_work, r.speed[1] = 0.0, 0.3
    r.work_speed = {1: 0.05}  # d1's reading on a light load
    r.light_below = 0.005
    later = run(pol, r, 40)
    if confirm_load:
        assert later == [] and pol.throughputs[1] == modelled
    else:
        assert pol.throughputs[1] < 0.5 * modelled


#: what a replan policy holds that is not its decision state: its options, the start-up placement, cluster and
#: profile (from the config, loaded again on resume) and the described cluster's step per depth (a cache of them)
NOT_STATE = {"options", "plugin_name", "placement", "cluster", "profile", "described"}


def test_the_whole_state_round_trips(tmp_path):
    """Every field of the policy's decision state goes through state_dict/load_state_dict (calm_ratios,
    throughputs, step_ema, ratios, step_factor, slow_load, ...: compared field by field, so a field added
    without its checkpoint entry fails here), and the resumed policy then decides as the original does."""
    r, pol = calm_pipe4_with_step_times(tmp_path)
    r.speed[1], r.step_speed = 0.5, [1.0, 0.5, 1.0, 1.0]
    acts = []
    while not acts and r.step < 60:
        acts = run(pol, r, 1)
    r.step_speed = [1.0, 0.2, 1.0, 1.0]
    names = ("calm_ratios", "throughputs", "step_ema", "ratios", "step_factor", "slow_load", "plan", "seen",
             "decisions")
    while not all(getattr(pol, name) for name in names) and r.step < 150:
        run(pol, r, 1)  # until every field is set (two moves made, the step EMA and ratios running again)
    for name in names:
        assert getattr(pol, name), name  # set, so that the comparison means something
    real = pol.streak
    pol.streak = real or 1  # mid-way through `patience` (a state it passes through), for the comparison
    fields = set(vars(pol)) - NOT_STATE
    state = pol.state_dict()
    again = build_policy({"name": "replan", "total_steps": 500})
    again.load_state_dict(state)
    assert set(vars(again)) - NOT_STATE == fields
    for name in sorted(fields):  # before on_train_begin: what the checkpoint alone restores
        assert getattr(again, name) == getattr(pol, name), name
    again.on_train_begin(r.ctx())
    pol.streak = again.streak = real
    for _ in range(40):  # the same metrics: the same decisions, the same state
        m = r.metrics()
        a, b = pol.after_step(dict(m)), again.after_step(dict(m))
        assert a == b
        r.apply(a)
    assert again.state_dict() == pol.state_dict()
