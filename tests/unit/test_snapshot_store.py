"""The host side of in-memory snapshots (pdv_ext.recovery.store) and who writes what (snapshots.plan_writers)."""
import os

import pytest

from pdv_ext.config import validate_pdv
from pdv_ext.recovery.store import HostStore, SnapshotLost, missing_files, newest_complete


def _step(store, step, files, rank=0, expected=None, seal=True, generation=0):
    entries = {name: store.write(step, name, data) for name, data in files.items()}
    if seal:
        store.seal(step, rank, entries, expected or list(files), generation=generation)
    return entries


def test_a_file_counts_only_sealed_and_whole(tmp_path):
    s = HostStore(str(tmp_path), "job", "hostA")
    _step(s, 1, {"meta.pt": b"m", "layer_00.pt": b"abc"})
    _step(s, 2, {"meta.pt": b"m2"}, seal=False)  # a rank killed before it sealed: nothing of step 2 counts
    assert s.complete() == {1: {"files": {"meta.pt": s.write(1, "meta.pt", b"m")["sha256"],
                                          "layer_00.pt": s.write(1, "layer_00.pt", b"abc")["sha256"]},
                                "expected": ["layer_00.pt", "meta.pt"], "generation": 0}}
    with open(os.path.join(s.folder(1), "layer_00.pt"), "wb") as f:  # torn after sealing: another size
        f.write(b"ab")
    assert set(s.complete()[1]["files"]) == {"meta.pt"}
    with open(os.path.join(s.folder(1), "layer_00.pt"), "wb") as f:  # same size, other bytes: read refuses
        f.write(b"abd")
    sha = s.complete()[1]["files"]["layer_00.pt"]
    with pytest.raises(SnapshotLost, match="damaged"):
        s.read(1, "layer_00.pt", sha)
    assert not [n for n in os.listdir(s.folder(1)) if ".tmp" in n]  # no temporary file left behind


def test_sealed_by_names_the_ranks_that_sealed_a_step(tmp_path):
    """What Snapshots.wait_sealed polls: a rank counts once its seal is in place, not while it writes."""
    s = HostStore(str(tmp_path), "job", "h")
    assert s.sealed_by(5) == set()
    _step(s, 5, {"layer_00.pt": b"a"}, rank=0)
    _step(s, 5, {"layer_01.pt": b"b"}, rank=2, seal=False)  # still writing
    assert s.sealed_by(5) == {0}
    _step(s, 5, {"layer_01.pt": b"b"}, rank=2)
    assert s.sealed_by(5) == {0, 2} and s.sealed_by(6) == set()


def test_prune_keeps_the_newest_sealed(tmp_path):
    s = HostStore(str(tmp_path), "job", "h")
    for step in (1, 2, 3):
        _step(s, step, {"meta.pt": b"x"})
    _step(s, 4, {"meta.pt": b"x"}, seal=False)  # being written
    assert s.prune(2) == [1]
    assert s.steps() == [2, 3, 4]


def test_newest_complete_across_hosts():
    a = {3: {"files": {"meta.pt": "1", "layer_00.pt": "2"}, "expected": ["meta.pt", "layer_00.pt", "layer_01.pt"]},
         2: {"files": {"meta.pt": "1", "layer_00.pt": "2", "layer_01.pt": "3"}, "expected": ["meta.pt"]}}
    b = {3: {"files": {"layer_01.pt": "4"}, "expected": []}}
    assert newest_complete({"A": a, "B": b}) == 3  # layer 1 of step 3 only on B
    assert newest_complete({"A": a}) == 2  # B lost: step 3 misses layer 1, step 2 is whole on A
    assert missing_files({"A": a})[3] == ["layer_01.pt"]
    assert newest_complete({"A": {}}) is None


def test_writers_cover_two_hosts():
    from pdv_ext.integrations.deepspeed.snapshots import plan_writers

    mapping = [[0, 1], [2, 3]]
    # each stage on one host: its replica 0 sends a copy to the lowest rank of the next host
    assert plan_writers(mapping, ["A", "A", "B", "B"]) == ({0: [0], 1: [2]}, {0: (0, 2), 1: (2, 0)})
    # a replica of each stage on each host: both write, nothing sent
    assert plan_writers(mapping, ["A", "B", "A", "B"]) == ({0: [0, 1], 1: [2, 3]}, {})
    # one host: one copy, nowhere to send it
    assert plan_writers(mapping, ["A"] * 4) == ({0: [0], 1: [2]}, {})


def test_config_names_the_bad_key():
    cfg, errors = validate_pdv({"snapshots": {"every": 0}})
    assert cfg is None and any("pdv.snapshots.every" in e for e in errors), errors
    cfg, errors = validate_pdv({"snapshots": {"evry": 2}})
    assert cfg is None and any("pdv.snapshots.evry" in e for e in errors), errors
    cfg, errors = validate_pdv({"snapshots": {}})
    assert not errors and cfg.snapshots.every == 1 and cfg.snapshots.keep == 2 and cfg.snapshots.resume == "auto"
    cfg, _ = validate_pdv({})
    assert cfg.snapshots is None


def test_resume_auto_follows_torchrun(monkeypatch):
    from pdv_ext.recovery.config import SnapshotsConfig

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not SnapshotsConfig().resumes() and SnapshotsConfig(resume=True).resumes()  # not under torchrun
    # under torchrun every start looks (the same answer on every rank, whatever one agent's restart count says)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    assert SnapshotsConfig().resumes() and not SnapshotsConfig(resume=False).resumes()
    assert SnapshotsConfig().job_name() == "run7" and SnapshotsConfig(job="x").job_name() == "x"


def test_a_smaller_job_plans_for_the_devices_left(tmp_path):
    """Issue #37 item 3: a job restarted on fewer ranks than the cluster lists plans for the devices its ranks
    run on (by host and local rank); a host the cluster does not know keeps the clear size error."""
    import yaml

    from pdv_ext.config_base import ConfigError
    from pdv_ext.placement.config import PlacementConfig
    from pdv_ext.placement.profile import Profile
    from pdv_ext.placement.startup import make_plan

    cluster = {"devices": [{"name": "a0", "host": "hostA", "throughput": 1.0},
                           {"name": "a1", "host": "hostA", "throughput": 1.0},
                           {"name": "b0", "host": "hostB", "throughput": 0.25},
                           {"name": "b1", "host": "hostB", "throughput": 0.25}],
               "links": {"intra_host": {"bandwidth": "10GB/s", "latency": "5us"},
                         "inter_host": {"bandwidth": "1GB/s", "latency": "50us"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    Profile.synthetic(8).save(str(tmp_path / "p.json"))
    pl = PlacementConfig(cluster=str(tmp_path / "c.yaml"), profile=str(tmp_path / "p.json"), num_stages=2)
    full = make_plan(None, pl, 4, layers=[None] * 8)
    assert sorted(r for st in full["rank_mapping"] for r in st) == [0, 1, 2, 3]
    left = make_plan(None, pl, 2, layers=[None] * 8, ranks_at=[("hostB", 0), ("hostB", 1)])
    assert sorted(r for st in left["rank_mapping"] for r in st) == [0, 1] and len(left["boundaries"]) == 3
    # the slow host's two devices alone: predicted slower than the two fast ones
    fast = make_plan(None, pl, 2, layers=[None] * 8, ranks_at=[("hostA", 0), ("hostA", 1)])
    assert left["predicted_step_time"] > 2 * fast["predicted_step_time"]
    with pytest.raises(ConfigError, match="describes 4 devices but the job has 2 ranks .*hostC"):
        make_plan(None, pl, 2, layers=[None] * 8, ranks_at=[("hostC", 0), ("hostC", 1)])


def test_a_failed_background_snapshot_is_raised_at_the_next_wait():
    """The writing half runs on a thread: its error must reach the training thread (at the next snapshot,
    discard or resume), once, naming what failed - never be lost."""
    import threading

    from pdv_ext.integrations.deepspeed.snapshots import Snapshots

    snaps = Snapshots.__new__(Snapshots)  # no process group needed for the thread's bookkeeping
    snaps._error, snaps._thread = None, None

    def write(**_):
        raise OSError("No space left on device")

    snaps._write = write
    snaps._thread = threading.Thread(target=snaps._run, daemon=True)
    snaps._thread.start()
    with pytest.raises(RuntimeError, match="background failed: No space left on device"):
        snaps.wait()
    snaps.wait()  # reported once; nothing in flight now


def test_fault_injection_fires_once_where_asked(monkeypatch):
    from pdv_ext.integrations.deepspeed import snapshots as snap

    fired = []
    monkeypatch.setattr(snap.os, "_exit", lambda code: fired.append(code))
    monkeypatch.setenv(snap.FAULT_ENV, "seal@3:0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for phase, step, rank in [("write", 3, 0), ("seal", 2, 0), ("seal", 3, 1)]:
        snap._fault(phase, step, rank)
    assert fired == []
    snap._fault("seal", 3, 0)
    assert fired == [snap.FAULT_EXIT]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restart: not again
    snap._fault("seal", 3, 0)
    assert fired == [snap.FAULT_EXIT]
    monkeypatch.setenv(snap.FAULT_ENV, "later@3:0")
    with pytest.raises(ValueError, match="PHASE@STEP:RANK"):
        snap._fault("seal", 3, 0)


def test_auto_interval():
    from pdv_ext.integrations.deepspeed.snapshots import auto_interval

    assert auto_interval(0.1, 0.0, 50) == 1  # no step timed yet
    assert auto_interval(0.05, 0.2, 50) == 1  # done well within a step
    assert auto_interval(0.48, 0.21, 50) == 3  # a slow link: 0.6 s with the margin, three steps
    assert auto_interval(100.0, 0.1, 50) == 50  # never more than max_every


def test_wait_sealed_waits_for_this_hosts_writers_only_where_a_snapshot_was_taken(tmp_path):
    """Snapshots.wait_sealed (what `--crash-at` calls before it kills a rank): True once every writer of this host
    sealed the step, False after the timeout while one has not, False at once for a step with no snapshot."""
    import time
    from types import SimpleNamespace

    from pdv_ext.integrations.deepspeed.snapshots import Snapshots

    snaps = Snapshots.__new__(Snapshots)  # the waiting alone: no process group, no engine
    snaps._thread, snaps._error = None, None
    snaps.store = HostStore(str(tmp_path), "job", "a")
    snaps.hosts = ["a", "a", "b", "b"]
    # stage 0 written by rank 0 (host a) and rank 2 (host b); stage 1 by rank 1 (a); rank 3's copy from rank 1
    snaps._plan = SimpleNamespace(writers={0: [0, 2], 1: [1]}, buddies={1: (1, 3)}, meta_writers={0, 2})
    snaps.taken_step = 10
    t = time.monotonic()
    assert snaps.wait_sealed(9, timeout=5) is False and time.monotonic() - t < 1  # no snapshot of step 9
    _step(snaps.store, 10, {"layer_00.pt": b"a"}, rank=0)
    assert snaps.wait_sealed(10, timeout=0.2) is False  # rank 1 (this host) has not sealed yet
    _step(snaps.store, 10, {"layer_01.pt": b"b"}, rank=1)
    assert snaps.wait_sealed(10, timeout=5) is True  # host b's ranks 2 and 3 are not waited for here


def test_a_resume_drops_the_steps_the_stopped_run_left_after_it(tmp_path, monkeypatch):
    """A rank died while step 6 was being sealed: rank 1 had sealed its file, rank 0 had not. The restarted job
    (one rank) resumes at step 5 and writes step 6 again, the same files at the same sizes with other bytes.
    Had rank 1's old seal stayed, it would still vouch for its file by size: step 6 would read as damaged at the
    next resume (or an old file would count into the new step). The resume drops what came after its step."""
    from pdv_ext.integrations.deepspeed import snapshots as snap_mod
    from pdv_ext.integrations.deepspeed.snapshots import Snapshots

    store = HostStore(str(tmp_path), "job", "hostA")
    names = ["meta.pt", "layer_00.pt", "layer_01.pt"]
    old = {n: bytes([1]) * 64 for n in names}
    _step(store, 5, {"meta.pt": old["meta.pt"], "layer_00.pt": old["layer_00.pt"]}, rank=0, expected=names)
    _step(store, 5, {"layer_01.pt": old["layer_01.pt"]}, rank=1, expected=names)
    _step(store, 6, {"layer_01.pt": old["layer_01.pt"]}, rank=1, expected=names)  # rank 0 died before its seal

    class OneRank:  # torch.distributed with one rank: the restarted job
        @staticmethod
        def get_world_size():
            return 1

        @staticmethod
        def all_gather_object(out, obj):
            out[0] = obj

        @staticmethod
        def barrier(*a, **k):
            pass

    loaded = []
    monkeypatch.setattr(snap_mod, "dist", OneRank)
    monkeypatch.setattr(snap_mod, "load_layer_checkpoint", lambda eng, base, tag: loaded.append(tag))
    snaps = Snapshots.__new__(Snapshots)
    snaps.store, snaps.hosts, snaps._thread, snaps._error = store, ["hostA"], None, None

    class Module:
        parts = [0, 2]

    class Engine:
        global_rank, stage_id, module = 0, 0, Module()

    assert snaps.resume(Engine()) == 5 and loaded == ["step00000005"]
    assert store.steps() == [5]  # step 6, which the stopped run left unfinished, is gone
    new = {n: bytes([2]) * 64 for n in names}  # the resumed run's step 6: same names and sizes, other bytes
    _step(store, 6, new, rank=0, expected=names)
    files = store.complete()[6]["files"]
    for name in names:
        assert store.read(6, name, files[name]) == new[name]


def test_of_each_step_only_the_newest_generation_counts(tmp_path):
    """Host B was cut off (its memory kept) while host A resumed from step 5 and wrote steps 6 and 7 again, in
    generation 1. B still holds the old timeline's step 6 (generation 0), whole on its own. Counted, it would
    complete A's unfinished new step 7 (same names and sizes, other bytes) or mix into step 6."""
    from pdv_ext.recovery.store import step_entries

    names = ["meta.pt", "layer_00.pt", "layer_01.pt"]
    a, b = HostStore(str(tmp_path), "job", "hostA"), HostStore(str(tmp_path), "job", "hostB")
    _step(b, 6, {n: b"old" for n in names}, rank=2, expected=names)  # the old timeline, generation 0
    _step(b, 7, {"layer_01.pt": b"old"}, rank=2, expected=names)
    _step(a, 6, {n: b"new" for n in names}, rank=0, expected=names, generation=1)
    _step(a, 7, {"meta.pt": b"new", "layer_00.pt": b"new"}, rank=0, expected=names, generation=1)  # in flight
    listings = {"hostA": a.complete(), "hostB": b.complete()}
    assert newest_complete(listings) == 6  # not 7, which only B's old layer_01 would complete
    assert missing_files(listings)[7] == ["layer_01.pt"]
    assert set(step_entries(listings, 6)) == {"hostA"}  # B's step 6 is another timeline's: nothing fetched from it
    # a resume on B fetches A's files of step 6 and seals them in their generation: B's old seal stops counting
    entry = b.write(6, "layer_01.pt", b"new")
    b.seal(6, 2, {"layer_01.pt": entry}, [], label="-fetched-layer_01.pt", generation=1)
    assert b.complete()[6] == {"files": {"layer_01.pt": entry["sha256"]}, "expected": [], "generation": 1}


def test_a_resume_starts_a_generation_and_fetches_over_an_old_timeline(tmp_path, monkeypatch):
    """Two ranks, one per host; this process is rank 0 on host A. Host B comes back holding the old timeline's
    step 6 whole; A holds the new one. Rank 0 must send B the new files (B's own do not count), the run's seals
    from here on carry generation 2, and the step loaded is A's."""
    from pdv_ext.integrations.deepspeed import snapshots as snap_mod
    from pdv_ext.integrations.deepspeed.snapshots import Snapshots

    names = ["meta.pt", "layer_00.pt", "layer_01.pt"]
    a, b = HostStore(str(tmp_path), "job", "hostA"), HostStore(str(tmp_path), "job", "hostB")
    _step(b, 6, {n: b"old" for n in names}, rank=1, expected=names)
    _step(a, 6, {n: b"new" for n in names}, rank=0, expected=names, generation=1)

    class TwoRanks:
        @staticmethod
        def get_world_size():
            return 2

        @staticmethod
        def all_gather_object(out, obj):
            if isinstance(obj, tuple):  # the listings
                out[0], out[1] = obj, ("hostB", b.complete())
            else:  # what each rank loads: rank 0 stage 0, rank 1 stage 1
                out[0], out[1] = obj, ["layer_01.pt", "meta.pt"]

        @staticmethod
        def barrier(*a, **k):
            pass

    sent, loaded = [], []
    monkeypatch.setattr(snap_mod, "dist", TwoRanks)
    monkeypatch.setattr(snap_mod, "exchange", lambda out, incoming, group=None: sent.append((out, incoming)) or {})
    monkeypatch.setattr(snap_mod, "load_layer_checkpoint", lambda eng, base, tag: loaded.append((base, tag)))
    snaps = Snapshots.__new__(Snapshots)
    snaps.store, snaps.hosts, snaps._thread, snaps._error = a, ["hostA", "hostB"], None, None

    class Module:
        parts = [0, 1, 2]

    class Engine:
        global_rank, stage_id, module = 0, 0, Module()

    assert snaps.resume(Engine()) == 6
    assert snaps.generation == 2
    (out, incoming), = sent  # layer_01 and meta for host B, in one message: its old copies do not count
    assert incoming == [] and list(out) == [1]
    assert snap_mod.unpack_files(out[1]) == {"layer_01.pt": b"new", "meta.pt": b"new"}
    assert loaded == [(a.base, "step00000006")]


def test_one_fault_spec_for_snapshots_and_recoveries(monkeypatch):
    """`recovery/injected.py`: `PHASE[@STEP]:RANK[,...]`, the step where the spec has steps; a bad spec is one
    ConfigError naming the variable and the item, whatever phase asks."""
    from pdv_ext.config_base import ConfigError
    from pdv_ext.recovery import injected

    monkeypatch.setenv("PDV_X_FAULT", "form:2, load:0")
    assert injected.faults("PDV_X_FAULT", ("form", "load")) == {("form", None, 2), ("load", None, 0)}
    assert injected.fires("PDV_X_FAULT", ("form", "load"), "form", 2)
    assert not injected.fires("PDV_X_FAULT", ("form", "load"), "form", 0)
    monkeypatch.setenv("PDV_X_FAULT", "seal@3:1")
    assert injected.fires("PDV_X_FAULT", ("seal",), "seal", 1, step=3)
    assert not injected.fires("PDV_X_FAULT", ("seal",), "seal", 1, step=4)
    for bad in ("form@3:2", "jump:1", "form:x", "form"):
        monkeypatch.setenv("PDV_X_FAULT", bad)
        with pytest.raises(ConfigError, match=r"PDV_X_FAULT=.*PHASE:RANK"):
            injected.fires("PDV_X_FAULT", ("form", "load"), "load", 0)
    monkeypatch.delenv("PDV_X_FAULT")
    assert injected.faults("PDV_X_FAULT", ("form",)) == frozenset()
