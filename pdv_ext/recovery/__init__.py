"""Surviving a lost device or host: in-memory snapshots of the layer-keyed training state, kept on each host and
on a peer host, from which a restarted job resumes under the plan its survivors can run (docs/recovery.md).

`store` is the host-side part (files in host memory, written atomically and sealed with checksums, so a copy
counts only when complete); the engine side, which decides what each rank writes and fetches what its new
place needs, lives with the rest of the DeepSpeed integration (`integrations/deepspeed/snapshots.py`).
"""
from .config import SnapshotsConfig  # noqa: F401
from .store import HostStore, SnapshotLost, host_name  # noqa: F401
