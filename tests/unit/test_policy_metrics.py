"""Monitor (combining gathered per-rank scalars, CSV) and `pdv plot metrics`."""
import csv

import pytest
import torch

from pdv_ext.comm.base import Comm
from pdv_ext.policy.config import MonitorConfig
from pdv_ext.policy.metrics import Monitor, sum_of_squares


class RowsComm(Comm):
    """Rank 0 of a fake group whose other ranks contribute preset rows."""

    def __init__(self, others):
        self.rank, self.size, self.others = 0, 1 + len(others), others

    def all_gather(self, tensor):
        return [tensor] + [torch.tensor(r, dtype=torch.float64) for r in self.others]


def test_sum_of_squares():
    ts = [torch.tensor([3.0, 4.0]), torch.ones(2, 2, dtype=torch.float64)]
    assert float(sum_of_squares(ts)) == 29.0
    assert float(sum_of_squares([])) == 0.0


def test_monitor_combines_ranks_and_writes_csv(tmp_path):
    # 2 stages x 2 replicas: the other three ranks' (wall, compute, local_sq, agg_sq, loss, dropped, cd, grads)
    nan = float("nan")
    others = [[0.5, 0.2, 1.0, 0.5, nan, 1.0, nan, 1.0], [0.4, 0.9, 3.0, 1.5, 2.0, 0.0, 0.25, 1.0],
              [0.45, 0.1, 2.0, 1.0, 2.0, nan, nan, 1.0]]
    mon = Monitor(RowsComm(others), dp_size=2, config=MonitorConfig(output_dir=str(tmp_path), ema=0.0,
                                                                   tensorboard=False))
    mon.add_local_grads([torch.tensor([2.0])])  # 4
    mon.add_aggregated_grads([torch.tensor([1.0])])  # 1
    mon.add_compute(0.3)
    mon.note(val_loss=1.5)
    m = mon.end_step(7, 2.0, 0.01, micro_batch_size=4, micro_batches=2, report={"dropped": [3]})
    assert m["batch_size"] == 16 and m["step"] == 7 and m["loss"] == 2.0 and m["val_loss"] == 1.5
    assert m["step_time"] == pytest.approx(max(0.5, m["step_times"][0]))
    assert m["slowest_rank"] == 2 and m["compute_max"] == 0.9
    assert m["dropped"] == 1.0 and m["consensus_distance"] == 0.25
    assert m["local_sq"] == pytest.approx((4 + 1 + 3 + 2) / 2) and m["agg_sq"] == pytest.approx((1 + .5 + 1.5 + 1) / 2)
    g2 = (16 * 2.0 - 8 * 5.0) / 8
    assert m["grad_sq"] == pytest.approx(g2)  # negative: no GNS
    assert m["gns"] is None
    mon.close()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert rows[0]["step"] == "7" and rows[0]["val_loss"] == "1.5" and "compute_r3" in rows[0]


def test_monitor_without_grads_has_no_gns():
    from pdv_ext.comm import LocalComm

    mon = Monitor(LocalComm(), dp_size=1)
    m = mon.end_step(1, None, None, 4, 1)
    assert m["loss"] is None and "gns" not in m and mon.rows[0]["samples"] == 4


def test_plot_metrics(tmp_path):
    from pdv_ext.plot import main, plot_metrics

    p = tmp_path / "metrics.csv"
    p.write_text("step,loss,batch_size,gns,step_time\n1,3.0,16,,0.1\n2,2.5,16,40,0.1\n3,2.0,32,80,0.2\n")
    assert plot_metrics(str(p), str(tmp_path / "a.png")) == [
        "loss", "batch size (samples/step)", "gradient noise scale", "step time (s)"]
    assert (tmp_path / "a.png").stat().st_size > 1000
    from pdv_ext.plot import read_columns

    only_loss = tmp_path / "l.csv"
    only_loss.write_text("step,loss,gns\n1,2.0,\n2,1.0,\n")
    assert set(read_columns(str(only_loss))) == {"loss"}  # empty columns are skipped
    bad = tmp_path / "bad.csv"
    bad.write_text("x,y\n1,2\n")
    assert main(["metrics", str(bad), "--out", str(tmp_path / "c.png")]) == 2


def test_update_last_and_open_later(tmp_path):
    from pdv_ext.comm import LocalComm

    import logging

    from pdv_ext.log import logger

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    mon = Monitor(LocalComm(), dp_size=1, config=MonitorConfig(tensorboard=False))
    mon.end_step(1, 2.0, 0.1, 4, 1)
    logger.addHandler(handler)
    try:
        mon.open(str(tmp_path))  # rows so far are written too
    finally:
        logger.removeHandler(handler)
    assert said == [f"monitor -> {tmp_path / 'metrics.csv'}"]  # the summary had said "in memory"
    mon.end_step(2, 1.5, 0.1, 4, 1)
    mon.update_last(val_loss=1.7)
    mon.end_step(3, 1.2, 0.1, 4, 1)
    mon.close()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert [r["val_loss"] for r in rows] == ["", "1.7", ""]


def test_monitor_window_gathers_every_n_steps():
    calls = []

    class Counting(RowsComm):
        size = 2  # a group: the Monitor must communicate (this fake answers with one row)

        def all_gather(self, tensor):
            calls.append(tensor.clone())
            return [tensor]

    comm = Counting([])
    comm.size = 2
    mon = Monitor(comm, dp_size=1, config=MonitorConfig(tensorboard=False), every=3)
    outs = []
    for step in range(1, 7):
        mon.add_local_grads([torch.tensor([float(step)])])
        mon.add_aggregated_grads([torch.tensor([1.0])])
        outs.append(mon.end_step(step, 1.0 / step, 0.1, 4, 1))
    assert [o is None for o in outs] == [True, True, False, True, True, False]
    assert len(calls) == 2 and len(mon.rows) == 6  # rank 0 still has a row per step
    assert outs[2]["local_sq"] == pytest.approx((1 + 4 + 9) / 3) and outs[5]["local_sq"] == pytest.approx((16 + 25 + 36) / 3)
    assert outs[5]["samples"] == 24 and outs[5]["loss"] == pytest.approx(1 / 6)


class FakeEvent:
    """A CUDA timing event's interface, with a preset device timestamp (seconds)."""
    clock = [0.0]
    synced = []

    def __init__(self, enable_timing=True, t=None):
        self.t = t

    def record(self):
        self.t = FakeEvent.clock[0]

    def synchronize(self):
        FakeEvent.synced.append(self.t)

    def elapsed_time(self, end):  # milliseconds, as torch.cuda.Event
        return (end.t - self.t) * 1e3


def test_device_timed_compute_is_read_once_per_window(monkeypatch):
    """GPU ranks time forward/backward with CUDA events (the host clock would time the launches): the
    events of a window are read on its reporting step; every step's end waits for the device."""
    from pdv_ext.integrations.deepspeed.glue import _timed

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.synced.clear()
    comm = RowsComm([])
    comm.size = 2
    comm.all_gather = lambda t: [t]
    waits = []
    mon = Monitor(comm, dp_size=1, config=MonitorConfig(tensorboard=False, gns=False), every=2,
                  sync=lambda: waits.append(FakeEvent.clock[0]))

    def instruction(engine, seconds):  # the device advances while the host "launches"
        FakeEvent.clock[0] += seconds

    timed = _timed(instruction, mon, cuda=True)
    outs = []
    for step, spans in enumerate([(0.1, 0.2), (0.3,), (0.5, 0.25), (0.05,)], start=1):
        for sec in spans:
            timed(None, sec)
        FakeEvent.clock[0] += 1.0  # idle device time between steps is not compute
        outs.append(mon.end_step(step, None, 0.1, 4, 1))
    assert [o is None for o in outs] == [True, False, True, False]
    assert outs[1]["compute_times"][0] == pytest.approx((0.1 + 0.2 + 0.3) / 2)
    assert outs[3]["compute_times"][0] == pytest.approx((0.5 + 0.25 + 0.05) / 2)
    assert len(FakeEvent.synced) == 2  # the events are read once per window
    assert len(waits) == 4  # the step's end waits for the device (its wall time includes the kernels)
    host = _timed(instruction, Monitor(comm, dp_size=1, config=MonitorConfig(tensorboard=False)), cuda=False)
    host(None, 0.0)  # CPU ranks: the host clock (no event created)
    assert len(FakeEvent.synced) == 2


def test_sum_of_squares_of_fp16_gradients_does_not_overflow():
    """Loss-scaled fp16 gradients: a norm taken in fp16 overflows at 65504 (inf, and the GNS with it)."""
    ts = [torch.full((1000,), 300.0, dtype=torch.float16), torch.full((10,), 2.0, dtype=torch.bfloat16)]
    assert float(sum_of_squares(ts)) == pytest.approx(1000 * 300.0 ** 2 + 10 * 4.0)


def test_a_checkpoint_between_agreement_steps_pickles_without_events(monkeypatch):
    """CUDA events do not pickle: the window's spans are folded into seconds before its state is saved."""
    import pickle

    from pdv_ext.integrations.deepspeed.glue import _timed

    class Unpicklable(FakeEvent):
        def __reduce__(self):
            raise TypeError("cannot pickle 'torch.Event' object")

    monkeypatch.setattr(torch.cuda, "Event", Unpicklable)
    comm = RowsComm([])
    comm.size = 2
    comm.all_gather = lambda t: [t]
    mon = Monitor(comm, dp_size=1, config=MonitorConfig(tensorboard=False, gns=False), every=2)
    timed = _timed(lambda engine, sec: FakeEvent.clock.__setitem__(0, FakeEvent.clock[0] + sec), mon, cuda=True)
    timed(None, 0.25)
    assert mon.end_step(1, None, 0.1, 4, 1) is None  # not an agreement step: the span waits in the window
    state = pickle.loads(pickle.dumps(mon.state_dict()))
    assert state["window"]["spans"] == [] and state["window"]["compute"] == pytest.approx(0.25)
    again = Monitor(comm, dp_size=1, config=MonitorConfig(tensorboard=False, gns=False), every=2)
    again.load_state_dict({k: v for k, v in state.items()})
    timed2 = _timed(lambda engine, sec: FakeEvent.clock.__setitem__(0, FakeEvent.clock[0] + sec), again, cuda=True)
    timed2(None, 0.5)
    out = again.end_step(2, None, 0.1, 4, 1)
    assert out["compute_times"][0] == pytest.approx((0.25 + 0.5) / 2)
