"""StealMeter reads the hypervisor's steal share of the CPU between two /proc/stat samples."""
from pdv_ext.emulate.hoststat import StealMeter


def _stat(path, user, idle, steal):
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    path.write_text(f"cpu  {user} 0 10 {idle} 0 0 0 {steal} 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_steal_share_of_all_ticks_between_samples(tmp_path):
    f = tmp_path / "stat"
    _stat(f, user=100, idle=1000, steal=50)
    meter = StealMeter(str(f))
    _stat(f, user=160, idle=1020, steal=70)  # +60 user, +20 idle, +20 steal; guest (already in user) ignored
    assert meter.fraction() == 20 / 100


def test_no_proc_stat_means_unknown(tmp_path):
    assert StealMeter(str(tmp_path / "missing")).fraction() is None
    f = tmp_path / "stat"
    _stat(f, user=1, idle=1, steal=0)
    meter = StealMeter(str(f))
    assert meter.fraction() == 0.0  # no ticks elapsed


def test_sampled_steal_share_of_a_stretch(tmp_path):
    """`steal_fraction` over recorded samples: from the last sample at or before the start to the first at or
    after the end; a stretch the samples do not cover is unknown."""
    from pdv_ext.emulate.hoststat import steal_fraction

    samples = [[10.0, 0, 0], [11.0, 10, 100], [12.0, 40, 200], [13.0, 40, 300]]
    assert steal_fraction(samples, 11.0, 12.0) == 30 / 100
    assert steal_fraction(samples, 11.5, 12.5) == 30 / 200  # widened to the samples around it
    assert steal_fraction(samples, 9.0, 12.0) is None and steal_fraction(samples, 11.0, 14.0) is None


def test_sampler_records_while_it_runs(tmp_path):
    import time

    from pdv_ext.emulate.hoststat import StealSampler

    f = tmp_path / "stat"
    _stat(f, user=100, idle=1000, steal=50)
    with StealSampler(interval=0.01, path=str(f)) as s:
        time.sleep(0.05)
        _stat(f, user=150, idle=1000, steal=100)
        time.sleep(0.05)
    assert len(s.samples) >= 3 and not s._thread.is_alive()
    assert s.samples[0][1:] == [50, 1160] and s.samples[-1][1:] == [100, 1260]
    with StealSampler(interval=0.01, path=str(tmp_path / "missing")) as none:
        time.sleep(0.03)
    assert none.samples == []
