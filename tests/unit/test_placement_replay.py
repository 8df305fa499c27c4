"""The replay of DeepSpeed's 1F1B schedule against hand computations and the closed form."""
import numpy as np
import pytest

from pdv_ext.placement.cluster import Cluster
from pdv_ext.placement.cost import evaluate
from pdv_ext.placement.profile import LayerProfile, Profile
from pdv_ext.placement.simulate import FORWARD_SHARE, _schedule, replay

pytest.importorskip("deepspeed")


def _cluster(inter_bw=10.0, inter_lat=0.1):
    return Cluster.from_dict({
        "devices": [{"name": "a", "host": "h0", "throughput": 2.0}, {"name": "b", "host": "h0", "throughput": 2.0},
                    {"name": "c", "host": "h1", "throughput": 1.0}, {"name": "d", "host": "h1", "throughput": 1.0}],
        "links": {"intra_host": {"bandwidth": 100.0, "latency": 0.01},
                  "inter_host": {"bandwidth": inter_bw, "latency": inter_lat}},
        "reference_throughput": 2.0})


def _profile(p2p=0.0):
    # fwd_bwd, param bytes, act bytes, saved, update, p2p, fwd
    return Profile([LayerProfile("l0", 3.0, 10.0, 5.0, 0.0, 0.5, p2p, 1.0),
                    LayerProfile("l1", 6.0, 20.0, 4.0, 0.0, 1.0, p2p, 2.0)])


def test_schedule_is_deepspeeds():
    names = _schedule(4, 2, 0)
    assert names.count("ForwardPass") == 4 and names.count("BackwardPass") == 4
    assert names.count("SendActivation") == 4 and names.count("RecvGrad") == 4
    assert names[-1] == "OptimizerStep"


def test_one_stage_equals_closed_form():
    cl, prof = _cluster(), _profile()
    for mb in (1, 4):
        r = replay(prof, cl, [0, 2], [[0]], mb)
        assert r.step_time == pytest.approx(evaluate(prof, cl, [0, 2], [[0]], mb).step_time)
        assert r.step_time == pytest.approx(mb * 9.0 + 1.5)  # device a is the reference (speed 1)


def test_two_stages_one_micro_batch_by_hand():
    cl, prof = _cluster(), _profile(p2p=0.2)
    # stage 0 = l0 on a (speed 1), stage 1 = l1 on c (speed 0.5, other host): one micro-batch goes there
    # and back: F0, activation over the link, RecvActivation's work, F1, B1, SendGrad's work... B0
    r = replay(prof, cl, [0, 1, 2], [[0], [2]], 1)
    x = 0.1 + 5.0 / 10.0                       # latency + l0's 5 activation bytes at 10 B/s
    f0, b0, f1, b1 = 1.0, 2.0, 2.0 / 0.5, 4.0 / 0.5
    half0, half1 = 0.2 / 2, 0.2 / 0.5 / 2      # each end's half of the message work
    arrive = f0 + x                            # sent as soon as F0 ends; the send's work overlaps the wire
    t1 = arrive + half1 + f1 + b1              # RecvActivation, F1, B1 on c
    back = t1 + x                              # SendGrad starts the gradient on its way
    t0 = max(f0 + half0, back) + half0 + b0    # RecvGrad, B0 on a
    assert r.finish[0] == pytest.approx(t0)
    assert r.finish[1] == pytest.approx(t1 + half1)
    # then the reductions (none: one device per stage) and every device's update, after the slowest
    assert r.step_time == pytest.approx(t0 + max(0.5 / 1.0, 1.0 / 0.5))


def test_forward_share_default():
    cl, prof = _cluster(), _profile()
    untimed = Profile([LayerProfile(l.name, l.fwd_bwd, l.param_bytes, l.act_bytes, 0.0, l.update) for l in prof.layers])
    r = replay(untimed, cl, [0, 1, 2], [[0], [2]], 1, keep_trace=True)
    fwd = [e for e in r.trace[0][0] if e[0] == "ForwardPass"][0]
    assert fwd[2] - fwd[1] == pytest.approx(3.0 * FORWARD_SHARE)


def test_replicas_queue_on_a_shared_host_link():
    cl, prof = _cluster(), _profile()
    # both replicas of stage 0 (a, b on h0) send to stage 1 on h1 (c, d) at the same moment: one link
    shared = replay(prof, cl, [0, 1, 2], [[0, 1], [2, 3]], 1, keep_trace=True)
    recv = [[e for e in shared.trace[1][r] if e[0] == "RecvActivation"][0][2] for r in range(2)]
    assert sorted(recv)[1] - sorted(recv)[0] == pytest.approx(5.0 / 10.0)  # the second waits one transfer
    # a slow round trip over the link sits in DeepSpeed's cycle: a slower link costs more than twice its
    # transfer per micro-batch in the steady state, which the closed form (links overlapped) does not see
    fast, slow = replay(prof, _cluster(inter_bw=1e9, inter_lat=0.0), [0, 1, 2], [[0], [2]], 8), \
        replay(prof, _cluster(inter_bw=2.5, inter_lat=0.0), [0, 1, 2], [[0], [2]], 8)
    assert slow.step_time - fast.step_time > 8 * 2 * (5.0 / 2.5) * 0.5


@pytest.mark.parametrize("seed", range(5))
def test_replay_is_at_least_the_busiest_device(seed):
    rng = np.random.default_rng(seed)
    prof = Profile.synthetic(6, seed=seed)
    cl = _cluster(inter_bw=float(rng.uniform(1e6, 1e8)), inter_lat=1e-3)
    bounds = [0, *sorted(rng.choice(np.arange(1, 6), 1, replace=False).tolist()), 6]
    groups = [[0, 2], [1, 3]] if seed % 2 else [[0, 1], [2, 3]]
    mb = int(rng.integers(1, 9))
    r = replay(prof, cl, bounds, groups, mb)
    cb = evaluate(prof, cl, bounds, groups, mb)
    assert r.step_time >= mb * max(st.compute for st in cb.stages) * (1 - 1e-9)
    assert r.step_time >= max(r.busy) * (1 - 1e-9)


def test_bad_plans_are_named():
    cl, prof = _cluster(), _profile()
    with pytest.raises(ValueError, match="boundaries"):
        replay(prof, cl, [0, 2, 2], [[0], [1]], 1)
    with pytest.raises(ValueError, match="width"):
        replay(prof, cl, [0, 1, 2], [[0, 1], [2]], 1)
