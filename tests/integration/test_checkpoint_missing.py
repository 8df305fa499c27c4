"""`engine.load_checkpoint` on a real engine (issue #35 item 4): a folder that does not exist, or a tag it does
not hold, raises CheckpointNotFound naming the path on every rank (DeepSpeed alone warned and trained from
scratch); `missing_ok=True` returns (None, None) as DeepSpeed does; a checkpoint that is there loads as before."""
import os

import pytest

from pdv_ext.spawn import run_ranks

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_a_missing_checkpoint_is_an_error_unless_missing_ok(tmp_path):
    res = run_ranks("tests.integration.checkpoint_workers:load_missing", 2, {"ckpt_root": str(tmp_path)},
                    timeout=240)
    missing = str(tmp_path / "no_such_dir")
    saved = str(tmp_path / "ckpt")
    for r in res:
        assert r["no_dir"] == ["CheckpointNotFound", f"load_checkpoint: {missing!r} does not exist"], r
        assert r["no_dir_ok"] == [None, None]
        assert r["no_tag"] == ["CheckpointNotFound", f"load_checkpoint: {saved!r} has no checkpoint 't2' "
                               f"(no folder {os.path.join(saved, 't2')!r})"], r
        assert r["no_tag_ok"] == [None, None]
        assert r["loaded"] and r["loaded_ok"], r
