"""Rank side of tests/integration/test_checkpoint_missing.py: a real PDVPipelineEngine (2 stages on 2 gloo
ranks) asked to load checkpoints that are not there."""
from __future__ import annotations

import os
from typing import Any, Dict


def load_missing(ckpt_root: str) -> Dict[str, Any]:
    import torch.distributed as dist

    from pdv_ext.config import ConfigError
    from tests.integration.move_workers import build, train

    plan = {"boundaries": [0, 4, 8], "rank_mapping": [[0], [1]]}
    eng, data = build("fp32", plan)
    out: Dict[str, Any] = {"rank": dist.get_rank()}

    def refused(*args: Any, **kwargs: Any) -> Any:
        try:
            eng.load_checkpoint(*args, **kwargs)
        except ConfigError as exc:
            return [type(exc).__name__, *exc.errors]
        return None

    out["no_dir"] = refused(os.path.join(ckpt_root, "no_such_dir"))
    out["no_dir_ok"] = list(eng.load_checkpoint(os.path.join(ckpt_root, "no_such_dir"), missing_ok=True))
    out["trained"] = train(eng, data, 1)
    saved = os.path.join(ckpt_root, "ckpt")
    eng.save_checkpoint(saved, tag="t1")
    dist.barrier()
    out["no_tag"] = refused(saved, tag="t2")
    out["no_tag_ok"] = list(eng.load_checkpoint(saved, tag="t2", missing_ok=True))
    path, _ = eng.load_checkpoint(saved)  # the `latest` file names t1: loads as before
    out["loaded"] = bool(path) and "t1" in str(path)
    path, _ = eng.load_checkpoint(saved, tag="t1", missing_ok=True)  # there: missing_ok changes nothing
    out["loaded_ok"] = bool(path) and "t1" in str(path)
    return out
