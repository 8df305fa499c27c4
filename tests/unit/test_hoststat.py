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
