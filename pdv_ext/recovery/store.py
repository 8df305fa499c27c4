"""A host's snapshots: files in host memory, each written whole or not at all, counted only once sealed.

Layout (one folder per host, so a lost host takes exactly its own copies with it):

    <root>/<job>/<host>/step00000042/pdv_layers/layer_03.pt     the layer-keyed checkpoint form
    <root>/<job>/<host>/step00000042/pdv_layers/meta.pt         (integrations/deepspeed/checkpoint.py)
    <root>/<job>/<host>/step00000042/sealed-rank00005.json      what rank 5 wrote there: name -> sha256, bytes
    <root>/<job>/<host>/step00000042/sealed-rank00001-fetched.json  files a resume fetched from another host

A file is written under a temporary name and renamed (a reader never sees half of it); a writer seals its
files of a step after all of them are in place, and the seal lists the files a complete step has
(`expected`). `complete()` counts a file only when a seal names it with the size it has; `read()` checks
its sha256. A rank killed while writing leaves files no seal names, or a seal that is not there yet: the
step is then incomplete on that host, never wrong.

Every seal carries the job's *generation*: 0 until the first resume, then one more than the newest any host
held at each resume (all ranks agree on it there). A step number names one state only within a generation: a
host cut off (not wiped) while the others resumed from an earlier step and wrote the same step numbers again
comes back holding the old timeline's files under the new names. Of each step only the newest generation's
seals count, on every host (`complete`, `newest_complete`), so an old file never joins a new step.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
from typing import Dict, Iterable, List, Optional, Set

from ..config_base import ConfigError

SUBDIR = "pdv_layers"  # as integrations/deepspeed/checkpoint.py's layer-keyed form
_STEP = re.compile(r"^step(\d{8})$")
_SEAL = re.compile(r"^sealed-[\w.-]+\.json$")


class SnapshotLost(ConfigError):
    """No step has every file on the hosts that are left (or a copy read back is damaged). A ConfigError:
    uncaught, its lines once under `heading` and exit 2 (user_errors.py)."""

    heading = "pdv_ext: the in-memory snapshots cannot restore this job:"

    def __init__(self, errors: List[str]):
        super().__init__(errors)
        self.args = ("\n".join(self.errors),)


def host_name() -> str:
    """This process's host: PDV_HOST (the emulator sets it per emulated host), else the machine's name."""
    return os.environ.get("PDV_HOST") or socket.gethostname()


def tag_of(step: int) -> str:
    return f"step{int(step):08d}"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HostStore:
    """This host's snapshots of one job (`root/job/host`)."""

    def __init__(self, root: str, job: str, host: Optional[str] = None):
        self.root, self.job, self.host = root, job, host or host_name()
        self.base = os.path.join(root, job, self.host)  # load_layer_checkpoint(engine, base, tag) reads here

    # -- writing -----------------------------------------------------------------------------------------
    def folder(self, step: int) -> str:
        return os.path.join(self.base, tag_of(step), SUBDIR)

    def write(self, step: int, name: str, data: bytes) -> Dict[str, object]:
        """Write one file of `step` (through a temporary name); returns its seal entry."""
        folder = self.folder(step)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
        tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"  # (a keeper writes from two threads)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return {"sha256": digest(data), "bytes": len(data)}

    def seal(self, step: int, rank: int, files: Dict[str, Dict[str, object]], expected: Iterable[str],
             label: str = "", generation: int = 0) -> None:
        """Record that `rank` wrote `files` (name -> seal entry) of `step` whole, in `generation`; `expected`
        names every file a complete step has (on some host). One seal per rank and `label` (a resume's fetched
        files seal under their own label, beside what an earlier rank of that number wrote)."""
        path = os.path.join(self.base, tag_of(step), f"sealed-rank{int(rank):05d}{label}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"step": int(step), "rank": int(rank), "generation": int(generation), "files": files,
                       "expected": sorted(expected)}, f)
        os.replace(tmp, path)

    def prune(self, keep: int) -> List[int]:
        """Drop all but the newest `keep` steps that have a seal (and any older unsealed leftovers);
        returns the steps dropped. Called after a snapshot every rank finished."""
        steps = self.steps()
        sealed = [s for s in steps if self._sealed(s)]
        keep_from = sealed[-keep] if len(sealed) >= keep else (sealed[0] if sealed else None)
        return self._drop([s for s in steps if keep_from is not None and s < keep_from])

    def drop_after(self, step: int) -> List[int]:
        """Drop every step newer than `step`, returning them. At a resume from `step` they are what an
        abandoned run left (a snapshot in flight when a rank died: sealed by some ranks, not all), and the
        resumed run writes the same steps again. Left there, an old seal would still vouch for a file of its
        size rewritten since (a later resume would find it damaged), or count an old file into a new step."""
        return self._drop([s for s in self.steps() if s > step])

    def _drop(self, steps: List[int]) -> List[int]:
        for s in steps:
            shutil.rmtree(os.path.join(self.base, tag_of(s)), ignore_errors=True)
        return steps

    # -- reading -----------------------------------------------------------------------------------------
    def steps(self) -> List[int]:
        try:
            names = os.listdir(self.base)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP.match, names) if m)

    def _sealed(self, step: int) -> bool:
        """Whether some rank sealed files of `step` here (a name, not read: `prune` runs after every
        snapshot, on the writing rank's thread)."""
        try:
            return any(_SEAL.match(name) for name in os.listdir(os.path.join(self.base, tag_of(step))))
        except FileNotFoundError:
            return False

    def _seals(self, step: int) -> List[dict]:
        folder = os.path.join(self.base, tag_of(step))
        out = []
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return []
        for name in names:
            if _SEAL.match(name):
                try:
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        out.append(json.load(f))
                except (OSError, ValueError):  # a seal is renamed into place whole; anything else is not one
                    continue
        return out

    def sealed_by(self, step: int) -> Set[int]:
        """The ranks that sealed files of `step` on this host."""
        return {int(seal["rank"]) for seal in self._seals(step) if "rank" in seal}

    def complete(self) -> Dict[int, Dict[str, object]]:
        """{step: {"files": {name: sha256} sealed and present at their sealed size, "expected": [...],
        "generation": g}}, from the seals of each step's newest generation on this host only."""
        out: Dict[int, Dict[str, object]] = {}
        for step in self.steps():
            files: Dict[str, str] = {}
            expected: List[str] = []
            seals = self._seals(step)
            gen = max((generation_of(seal) for seal in seals), default=0)
            for seal in seals:
                if generation_of(seal) != gen:
                    continue  # an older timeline's seal: its files may have been written again since
                expected = seal.get("expected") or expected
                for name, entry in seal.get("files", {}).items():
                    path = os.path.join(self.folder(step), name)
                    if os.path.isfile(path) and os.path.getsize(path) == int(entry["bytes"]):
                        files[name] = str(entry["sha256"])
            if files:
                out[step] = {"files": files, "expected": list(expected), "generation": gen}
        return out

    def read_raw(self, step: int, name: str) -> bytes:
        """The bytes of a file this process has just written (unchecked: for its copy to another host, whose
        receiver hashes what arrives and seals that)."""
        with open(os.path.join(self.folder(step), name), "rb") as f:
            return f.read()

    def read(self, step: int, name: str, sha256: str) -> bytes:
        """The bytes of a sealed file, checked against its sha256."""
        path = os.path.join(self.folder(step), name)
        with open(path, "rb") as f:
            data = f.read()
        if digest(data) != sha256:
            raise SnapshotLost([f"snapshot {path}: damaged (its sha256 differs from the seal's); not loaded"])
        return data


def generation_of(entry: Dict[str, object]) -> int:
    """A seal's (or a `complete()` entry's) generation; seals written before generations were kept: 0."""
    return int(entry.get("generation", 0) or 0)  # type: ignore[arg-type]


def step_entries(listings: Dict[str, Dict[int, Dict[str, object]]], step: int) -> Dict[str, Dict[str, object]]:
    """{host: its `complete()` entry of `step`}, for the hosts whose entry is of the step's newest generation
    among all hosts (an older one is another timeline's step of that number)."""
    entries = {h: lst[step] for h, lst in listings.items() if lst.get(step)}
    gen = max((generation_of(e) for e in entries.values()), default=0)
    return {h: e for h, e in entries.items() if generation_of(e) == gen}


def newest_generation(listings: Dict[str, Dict[int, Dict[str, object]]]) -> int:
    """The newest generation any host holds a step of (0 when none)."""
    return max((generation_of(e) for lst in listings.values() for e in lst.values()), default=0)


def _expected_and_have(listings: Dict[str, Dict[int, Dict[str, object]]], step: int):
    expected: Set[str] = set()
    have: Set[str] = set()
    for entry in step_entries(listings, step).values():
        expected |= set(entry["expected"])  # type: ignore[arg-type]
        have |= set(entry["files"])  # type: ignore[arg-type]
    return expected, have


def newest_complete(listings: Dict[str, Dict[int, Dict[str, object]]]) -> Optional[int]:
    """The newest step whose expected files are all present on some host of `listings`
    ({host: HostStore.complete()}), counting each step's newest generation only."""
    best = None
    for step in sorted({s for lst in listings.values() for s in lst}):
        expected, have = _expected_and_have(listings, step)
        if expected and expected <= have:
            best = step
    return best


def missing_files(listings: Dict[str, Dict[int, Dict[str, object]]]) -> Dict[int, List[str]]:
    """{step: files expected but on no host}, for the error that names what was lost."""
    out: Dict[int, List[str]] = {}
    for step in sorted({s for lst in listings.values() for s in lst}):
        expected, have = _expected_and_have(listings, step)
        out[step] = sorted(expected - have)
    return out
