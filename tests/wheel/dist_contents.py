"""What the sdist and the wheel must and must not hold (used by check_wheel.py and its unit test).

The wheel is what users install: the package and its metadata only - no tests, nothing from outside
`pdv_ext/` (the old setup.py shipped the kernel sources as data_files outside it), no build products,
and no large file beyond the latency predictor's data. The sdist is what a wheel is built from: it must
hold every file the wheel ships plus the build inputs (pyproject.toml, README.md, LICENSE).
"""
from __future__ import annotations

import re
import tarfile
import zipfile
from typing import Dict, Iterable, List

#: no shipped file may be larger than this, except the ones allowed below
MAX_FILE_BYTES = 100_000
#: the predictor's database (`pdv predict`, placement), about 215 KB; bounded so it cannot grow unnoticed
LARGE_FILES_ALLOWED = {"pdv_ext/data/alpa_prof_database.json": 400_000}
#: files the installed package cannot work without, beyond the Python modules
REQUIRED_PACKAGE_FILES = ["pdv_ext/__init__.py", "pdv_ext/py.typed", "pdv_ext/kernels/csrc/pdv_kernels.cpp",
                          "pdv_ext/data/alpa_prof_database.json"]
#: what a build needs besides the package
REQUIRED_SDIST_FILES = ["pyproject.toml", "README.md", "LICENSE", "PKG-INFO"]
#: path parts and suffixes that never belong in a distribution
FORBIDDEN_PARTS = {"tests", "test", "__pycache__", ".git", "build", "launch"}
FORBIDDEN_SUFFIXES = (".pyc", ".pyo", ".so", ".o", ".egg-info")


def wheel_files(path: str) -> Dict[str, int]:
    """{name: uncompressed size} of a wheel."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: i.file_size for i in z.infolist() if not i.is_dir()}


def sdist_files(path: str) -> Dict[str, int]:
    """{name relative to the sdist's top directory: size} of an sdist."""
    with tarfile.open(path) as t:
        return {m.name.split("/", 1)[1]: m.size for m in t.getmembers() if m.isfile() and "/" in m.name}


def _shipped_problems(files: Dict[str, int], where: str) -> List[str]:
    problems = []
    for name, size in sorted(files.items()):
        parts = name.split("/")
        if FORBIDDEN_PARTS & set(parts[:-1]) or name.endswith(FORBIDDEN_SUFFIXES):
            problems.append(f"{where}: {name} does not belong in a distribution (tests or build products)")
        limit = LARGE_FILES_ALLOWED.get(name, MAX_FILE_BYTES)
        if size > limit:
            problems.append(f"{where}: {name} is {size} bytes (limit {limit})")
    return problems


def wheel_problems(files: Dict[str, int], version: str, package_files: Iterable[str]) -> List[str]:
    """Problems of a wheel's file list; `package_files` are the files under pdv_ext/ in the source tree
    (every one of them must be shipped, so a module or data file left out of the metadata is caught)."""
    dist_info = f"pdv_ext-{version}.dist-info/"
    problems = _shipped_problems(files, "wheel")
    for name in files:
        if not (name.startswith("pdv_ext/") or name.startswith(dist_info)):
            problems.append(f"wheel: {name} is outside pdv_ext/ and {dist_info}")
    for name in sorted(set(package_files) | set(REQUIRED_PACKAGE_FILES)):
        if name not in files:
            problems.append(f"wheel: {name} is missing")
    for name in ("METADATA", "entry_points.txt", "licenses/LICENSE"):
        if dist_info + name not in files:
            problems.append(f"wheel: {dist_info}{name} is missing")
    return problems


def metadata_problems(metadata: str, entry_points: str, extras: Iterable[str]) -> List[str]:
    """Problems of the wheel's METADATA and entry_points.txt texts."""
    problems = []
    if not re.search(r"^pdv\s*=\s*pdv_ext\.cli:main$", entry_points, re.M):
        problems.append("wheel: entry_points.txt has no console script pdv = pdv_ext.cli:main")
    for extra in extras:
        if not re.search(rf"^Provides-Extra: {re.escape(extra)}$", metadata, re.M):
            problems.append(f"wheel: METADATA does not provide the extra '{extra}'")
    for field in ("License-Expression: Apache-2.0", "Requires-Python: >=3.10"):
        if field not in metadata:
            problems.append(f"wheel: METADATA has no '{field}'")
    if "pdv_ext.aggregators" not in metadata or "pdv_ext.policies" not in metadata:
        problems.append("wheel: METADATA (the README) does not document the plug-in entry-point groups")
    return problems


def sdist_problems(sdist: Dict[str, int], wheel: Dict[str, int]) -> List[str]:
    """Problems of an sdist: it must hold every package file of the wheel and the build inputs."""
    problems = _shipped_problems(sdist, "sdist")
    for name in sorted(set(REQUIRED_SDIST_FILES) | {n for n in wheel if n.startswith("pdv_ext/")}):
        if name not in sdist:
            problems.append(f"sdist: {name} is missing")
    return problems


def summary(files: Dict[str, int]) -> str:
    """One line per top-level folder of the package: files and bytes; then the largest files."""
    groups: Dict[str, List[int]] = {}
    for name, size in files.items():
        parts = name.split("/")
        key = "/".join(parts[:2]) + "/" if parts[0] == "pdv_ext" and len(parts) > 2 else parts[0] + "/"
        groups.setdefault("pdv_ext/*.*" if key == "pdv_ext/" else key, []).append(size)
    lines = [f"  {key:<32} {len(sizes):>3} files {sum(sizes):>9} bytes" for key, sizes in sorted(groups.items())]
    largest = sorted(files.items(), key=lambda kv: -kv[1])[:3]
    lines.append("  largest: " + ", ".join(f"{n} ({s} bytes)" for n, s in largest))
    return "\n".join(lines)
