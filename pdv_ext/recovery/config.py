"""`pdv.snapshots`: in-memory snapshots of the training state, for resuming after a lost device or host."""
from __future__ import annotations

import os
import tempfile
from typing import Annotated, Literal, Optional, Union

from pydantic import Field

from ..config_base import StrictModel


def host_memory_dir() -> str:
    """Host memory where there is some (/dev/shm: a tmpfs on Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def default_root() -> str:
    return os.path.join(host_memory_dir(), "pdv-snapshots")


class SnapshotsConfig(StrictModel):
    """`pdv.snapshots` (absent: no snapshots). Every `every` steps each rank's layer-keyed state goes to its
    host's memory under `root`, on at least two hosts where the job has two; a restarted job resumes from the
    newest step every layer of which survived."""

    every: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field(
        1, description="steps between snapshots; 'auto': as often as the last snapshot's time allows, so that "
                       "the next one starts after it finished (where the link to the other host or the host's "
                       "CPU cannot take one every step: fewer steps of overhead, more steps at risk)")
    max_every: int = Field(50, ge=1, description="'auto' never waits longer than this many steps")
    keep: int = Field(2, ge=1, description="snapshots kept per host (the newest)")
    root: str = Field(default_factory=default_root, description="folder in host memory (each host its own)")
    job: Optional[str] = Field(None, description="name of this job's snapshots under root (default: torchrun's "
                                                 "run id, TORCHELASTIC_RUN_ID, else 'pdv')")
    timeout: float = Field(300.0, gt=0, description="seconds a background snapshot waits for a peer (its copies, "
                                                     "its seal) before it gives up")
    background: bool = Field(True, description="write, copy and seal on a thread while training goes on (false: "
                                                "inside the step)")
    resume: Union[bool, Literal["auto"]] = Field(
        "auto", description="resume from the newest complete snapshot at start-up: 'auto' under torchrun's agent "
                            "(TORCHELASTIC_RUN_ID set: every start of the workers, the first one finding none), "
                            "true always, false never")

    in_place: bool = Field(
        False, description="recover in these processes when a peer dies (no restart): the survivors agree on who "
                           "is left through `store`, form a new process group, plan for themselves and resume from "
                           "the newest complete snapshot; anything that fails on the way exits the process, and a "
                           "restart (torchrun) resumes as without this")
    store: Optional[str] = Field(
        None, description="in_place: HOST:PORT of a TCPStore that outlives any training host (torchrun's "
                          "--rdzv-endpoint on a host of its own); default PDV_RECOVERY_STORE, else "
                          "PET_RDZV_ENDPOINT")
    settle_s: float = Field(30.0, gt=0, description="in_place: the longest the survivors wait, once one reports a "
                                                     "failure, for a rank that has not reported but whose heartbeat "
                                                     "moves (it was computing when the peer died and notices at its "
                                                     "next collective, or after heartbeat_dead_s); a rank whose "
                                                     "heartbeat has stopped for 3 s is not waited for")

    heartbeat_dead_s: float = Field(10.0, gt=0, description="in_place: a peer whose heartbeat has not moved for "
                                                            "this long is taken for lost (a host gone silent)")

    def root_dir(self) -> str:
        """`root`, unless the emulator gives this host its memory (PDV_HOST_MEMORY, `pdv emulate`'s elastic
        runs): then that folder, which the emulator wipes when the host is lost."""
        return os.environ.get("PDV_HOST_MEMORY") or self.root

    def job_name(self) -> str:
        return self.job or os.environ.get("TORCHELASTIC_RUN_ID") or "pdv"

    def resumes(self) -> bool:
        """Whether start-up looks for a snapshot (a collective: the answer must be the same on every rank).
        Not TORCHELASTIC_RESTART_COUNT: it counts one agent's failures, so after a lost host the agent whose
        worker failed says 1 and one restarted for the new membership says 0 (seen on the emulated cluster:
        one rank resumed, its peer started over, and their collectives crossed); a scale-up says 0 on all."""
        if self.resume == "auto":
            return bool(os.environ.get("TORCHELASTIC_RUN_ID"))
        return bool(self.resume)

    def store_address(self) -> Optional[str]:
        """`store`, else PDV_RECOVERY_STORE (`pdv emulate` sets it), else torchrun's PET_RDZV_ENDPOINT."""
        return self.store or os.environ.get("PDV_RECOVERY_STORE") or os.environ.get("PET_RDZV_ENDPOINT") or None
