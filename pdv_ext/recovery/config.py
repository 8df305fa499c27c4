"""`pdv.snapshots`: in-memory snapshots of the training state, for resuming after a lost device or host."""
from __future__ import annotations

import os
import tempfile
from typing import Literal, Optional, Union

from pydantic import Field

from ..config_base import StrictModel


def default_root() -> str:
    """Host memory where there is some (/dev/shm: a tmpfs on Linux), else the temporary directory."""
    return "/dev/shm/pdv-snapshots" if os.path.isdir("/dev/shm") else os.path.join(tempfile.gettempdir(),
                                                                                     "pdv-snapshots")


class SnapshotsConfig(StrictModel):
    """`pdv.snapshots` (absent: no snapshots). Every `every` steps each rank's layer-keyed state goes to its
    host's memory under `root`, on at least two hosts where the job has two; a restarted job resumes from the
    newest step every layer of which survived."""

    every: int = Field(1, ge=1, description="steps between snapshots")
    keep: int = Field(2, ge=1, description="snapshots kept per host (the newest)")
    root: str = Field(default_factory=default_root, description="folder in host memory (each host its own)")
    job: Optional[str] = Field(None, description="name of this job's snapshots under root (default: torchrun's "
                                                 "run id, TORCHELASTIC_RUN_ID, else 'pdv')")
    timeout: float = Field(300.0, gt=0, description="seconds a background snapshot waits for a peer (its copies, "
                                                     "its seal) before it gives up")
    background: bool = Field(True, description="write, copy and seal on a thread while training goes on (false: "
                                                "inside the step)")
    resume: Union[bool, Literal["auto"]] = Field(
        "auto", description="resume from the newest complete snapshot at start-up: 'auto' when torchrun "
                            "restarted the workers (TORCHELASTIC_RESTART_COUNT > 0), true always, false never")

    def job_name(self) -> str:
        return self.job or os.environ.get("TORCHELASTIC_RUN_ID") or "pdv"

    def resumes(self) -> bool:
        if self.resume == "auto":
            return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        return bool(self.resume)
