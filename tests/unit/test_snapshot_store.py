"""The host side of in-memory snapshots (pdv_ext.recovery.store) and who writes what (snapshots.plan_writers)."""
import os

import pytest

from pdv_ext.config import validate_pdv
from pdv_ext.recovery.store import HostStore, SnapshotLost, missing_files, newest_complete


def _step(store, step, files, rank=0, expected=None, seal=True):
    entries = {name: store.write(step, name, data) for name, data in files.items()}
    if seal:
        store.seal(step, rank, entries, expected or list(files))
    return entries


def test_a_file_counts_only_sealed_and_whole(tmp_path):
    s = HostStore(str(tmp_path), "job", "hostA")
    _step(s, 1, {"meta.pt": b"m", "layer_00.pt": b"abc"})
    _step(s, 2, {"meta.pt": b"m2"}, seal=False)  # a rank killed before it sealed: nothing of step 2 counts
    assert s.complete() == {1: {"files": {"meta.pt": s.write(1, "meta.pt", b"m")["sha256"],
                                          "layer_00.pt": s.write(1, "layer_00.pt", b"abc")["sha256"]},
                                "expected": ["layer_00.pt", "meta.pt"]}}
    with open(os.path.join(s.folder(1), "layer_00.pt"), "wb") as f:  # torn after sealing: another size
        f.write(b"ab")
    assert set(s.complete()[1]["files"]) == {"meta.pt"}
    with open(os.path.join(s.folder(1), "layer_00.pt"), "wb") as f:  # same size, other bytes: read refuses
        f.write(b"abd")
    sha = s.complete()[1]["files"]["layer_00.pt"]
    with pytest.raises(SnapshotLost, match="damaged"):
        s.read(1, "layer_00.pt", sha)
    assert not [n for n in os.listdir(s.folder(1)) if ".tmp" in n]  # no temporary file left behind


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

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not SnapshotsConfig().resumes()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert SnapshotsConfig().resumes() and not SnapshotsConfig(resume=False).resumes()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")
    assert SnapshotsConfig().job_name() == "run7" and SnapshotsConfig(job="x").job_name() == "x"
