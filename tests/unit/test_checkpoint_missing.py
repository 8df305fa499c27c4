"""`engine.load_checkpoint(dir)` with nothing to load (issue #35 item 4): DeepSpeed logs "Unable to find latest
file" and trains from scratch, so a mistyped path lost the run silently. pdv_ext's engine raises
CheckpointNotFound (a ConfigError naming the path) unless the caller passes `missing_ok=True`. The decision on
folders here; on a real engine (2 gloo ranks): tests/integration/test_checkpoint_missing.py."""
import sys

import pytest

from pdv_ext.config import ConfigError
from pdv_ext.integrations.deepspeed.checkpoint import CheckpointNotFound, missing_checkpoint
from pdv_ext.user_errors import report_config_error


def test_a_folder_that_does_not_exist_is_named(tmp_path):
    where = str(tmp_path / "no_such_dir")
    assert missing_checkpoint(where) == f"load_checkpoint: {where!r} does not exist"
    (tmp_path / "a_file").write_text("x")
    assert "is not a folder" in missing_checkpoint(str(tmp_path / "a_file"), "t")


def test_no_latest_file_and_a_tag_without_its_folder(tmp_path):
    assert missing_checkpoint(str(tmp_path)) == (f"load_checkpoint: {str(tmp_path)!r} has no 'latest' file naming "
                                                 "the checkpoint to load (pass tag=... to load a named one)")
    assert "'latest_universal' file" in missing_checkpoint(str(tmp_path), latest="latest_universal")
    assert missing_checkpoint(str(tmp_path), "global_step5").startswith(
        f"load_checkpoint: {str(tmp_path)!r} has no checkpoint 'global_step5'")
    (tmp_path / "latest").write_text("global_step5\n")
    assert "names 'global_step5', but" in missing_checkpoint(str(tmp_path))


def test_a_checkpoint_that_is_there_is_left_to_the_loader(tmp_path):
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "latest").write_text("global_step5\n")
    assert missing_checkpoint(str(tmp_path)) is None
    assert missing_checkpoint(tmp_path, "global_step5") is None  # a PathLike too


def test_not_found_is_a_config_error_with_its_own_heading(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    err = CheckpointNotFound(["load_checkpoint: 'x' does not exist"])
    assert isinstance(err, ConfigError)
    report_config_error(err)
    assert capsys.readouterr().err.splitlines() == [
        "pdv_ext: no checkpoint to load (fix the path, or pass missing_ok=True to start from scratch):",
        "  load_checkpoint: 'x' does not exist"]


def test_the_engine_raises_unless_missing_ok(tmp_path, monkeypatch):
    """PDVPipelineEngine.load_checkpoint's own check, before any DeepSpeed code (no engine built: the method
    runs on a stand-in that has what it reads)."""
    from types import SimpleNamespace

    from pdv_ext.integrations.deepspeed.engine import PDVPipelineEngine

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the raise installs pdv_ext's hook: not past this test
    eng = SimpleNamespace(load_universal_checkpoint=lambda: False, global_rank=0)
    where = str(tmp_path / "no_such_dir")
    with pytest.raises(CheckpointNotFound, match="no_such_dir"):
        PDVPipelineEngine.load_checkpoint(eng, where)
    assert PDVPipelineEngine.load_checkpoint(eng, where, missing_ok=True) == (None, None)


@pytest.mark.parametrize("answers, expected", [
    ([None, None, None], None),
    (["load_checkpoint: 'x' does not exist"] * 3, "load_checkpoint: 'x' does not exist"),
    ([None, "load_checkpoint: 'x' does not exist", None],
     "load_checkpoint: 'x' does not exist on rank(s) 1 (the other ranks found it: every node needs the same "
     "checkpoint folder)"),
])
def test_every_rank_gets_the_same_answer(monkeypatch, answers, expected):
    """Node-local folders: where one rank finds nothing, every rank raises (none goes on loading alone)."""
    import torch.distributed as dist

    from pdv_ext.integrations.deepspeed.engine import agreed_missing

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: len(answers))

    def gather(out, obj, group=None):
        out[:] = answers

    monkeypatch.setattr(dist, "all_gather_object", gather)
    for mine in answers:  # whatever this rank saw, the agreed answer is the same
        assert agreed_missing(mine) == expected
