"""`make test-wheel`: build the sdist and the wheel, check what they hold, install the wheel into a fresh
virtual environment and run the smoke test there, from a directory outside the source tree.

Run from the repository root with the project's environment: `.venv/bin/python -m tests.wheel.check_wheel`.
The wheel is built from the sdist (what `python -m build` does), in an isolated build environment, so a
file missing from the sdist or a wrong [build-system] fails here as it would for a user. The fresh
environment gets the wheel and the torch and DeepSpeed versions of the running one (pip's cache and the
local torch wheel make that about half a minute); it does not see the source tree. Everything lands in a
new temporary directory outside the tree, removed on success and kept (with its logs) on failure. Exits
non-zero, naming the step, on any failure.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Dict, List, Optional

from pdv_ext import __version__
from tests.wheel import dist_contents

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTRAS = ["horovod", "mpi", "plot", "docs", "dev"]
SMOKE = os.path.join(ROOT, "tests", "wheel", "smoke.py")
DEMO_CONFIG = os.path.join(ROOT, "pdv_ext", "examples", "configs", "demo.json")


class StepFailed(RuntimeError):
    pass


def run(step: str, cmd: List[str], log: str, **kw) -> None:
    """Run a command with its output in `log`; on failure raise with the log's tail."""
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if rc != 0:
        with open(log) as f:
            tail = "".join(f.readlines()[-40:])
        raise StepFailed(f"{step} failed (exit {rc}): {' '.join(cmd)}\n{tail}")


def outside_env(**extra: str) -> Dict[str, str]:
    """This environment without what would put the source tree or another environment on the fresh one's path.
    Byte-code is written (the wheel is installed without compiling it: the first import of a module compiles
    it once, instead of pip compiling all of torch)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def package_files() -> List[str]:
    """The files under pdv_ext/ that the source tree tracks (git), or that it holds (no git)."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "pdv_ext"], capture_output=True, text=True, check=True)
        return [n for n in out.stdout.splitlines() if n]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for d, dirs, files in os.walk(os.path.join(ROOT, "pdv_ext")):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            found += [os.path.relpath(os.path.join(d, f), ROOT) for f in files if not f.endswith(".pyc")]
        return found


def build(out: str) -> Dict[str, str]:
    run("building the sdist and the wheel", [sys.executable, "-m", "build", "--outdir", os.path.join(out, "dist"), ROOT],
        os.path.join(out, "build.log"))
    wheels = glob.glob(os.path.join(out, "dist", "*.whl"))
    sdists = glob.glob(os.path.join(out, "dist", "*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise StepFailed(f"expected one wheel and one sdist in {out}/dist, found {wheels + sdists}")
    return {"wheel": wheels[0], "sdist": sdists[0]}


def check_contents(paths: Dict[str, str], version: str) -> None:
    wheel = dist_contents.wheel_files(paths["wheel"])
    sdist = dist_contents.sdist_files(paths["sdist"])
    dist_info = f"pdv_ext-{version}.dist-info/"
    with zipfile.ZipFile(paths["wheel"]) as z:
        metadata = z.read(dist_info + "METADATA").decode() if dist_info + "METADATA" in wheel else ""
        entry_points = z.read(dist_info + "entry_points.txt").decode() if dist_info + "entry_points.txt" in wheel else ""
    problems = (dist_contents.wheel_problems(wheel, version, package_files())
                + dist_contents.metadata_problems(metadata, entry_points, EXTRAS)
                + dist_contents.sdist_problems(sdist, wheel))
    print(f"[wheel] {os.path.basename(paths['wheel'])}: {os.path.getsize(paths['wheel'])} bytes, {len(wheel)} files, "
          f"{sum(wheel.values())} bytes unpacked")
    print(dist_contents.summary(wheel))
    print(f"[wheel] {os.path.basename(paths['sdist'])}: {os.path.getsize(paths['sdist'])} bytes, {len(sdist)} files")
    if problems:
        raise StepFailed("the distributions are not right:\n  " + "\n  ".join(problems))


def fresh_env(out: str, wheel: str) -> str:
    """A new venv (no pip of its own: the running pip installs into it) with the wheel and this torch/DeepSpeed."""
    venv = os.path.join(out, "venv")
    run("creating the fresh venv", [sys.executable, "-m", "venv", "--without-pip", venv], os.path.join(out, "venv.log"))
    py = os.path.join(venv, "bin", "python")
    # the versions installed here; torch's local label (+cpu) is left to the index (a CPU wheel on this platform)
    torch_version = importlib.metadata.version("torch").split("+")[0]
    run("installing the wheel", [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-compile",
                                 "--disable-pip-version-check", wheel, f"torch=={torch_version}",
                                 f"deepspeed=={importlib.metadata.version('deepspeed')}"],
        os.path.join(out, "install.log"), env=outside_env())
    return py


def smoke(out: str, py: str) -> None:
    work = os.path.join(out, "run")
    os.makedirs(work)
    shutil.copy(SMOKE, work)
    docs = []
    for page in ("README.md", os.path.join("docs", "getting-started.md"), os.path.join("docs", "recovery.md")):
        docs.append(os.path.basename(page))
        shutil.copy(os.path.join(ROOT, page), work)
    env = outside_env(PATH=os.path.dirname(py) + os.pathsep + os.environ.get("PATH", ""), DS_ACCELERATOR="cpu",
                      TORCH_EXTENSIONS_DIR=os.path.join(out, "torch_extensions"), PYTHONUNBUFFERED="1")
    # DeepSpeed's own CPU op, built by the checkout's runs for the same torch and DeepSpeed: a cache, not code
    ds_cache = os.path.join(ROOT, "build", "torch_extensions")
    cmd = [py, "smoke.py", "--config", DEMO_CONFIG, "--source-tree", ROOT, "--docs", *docs,
           "--ds-cache", ds_cache if os.path.isdir(os.path.join(ds_cache, "deepspeed_shm_comm")) else ""]
    proc = subprocess.run(cmd, cwd=work, env=env)
    if proc.returncode != 0:
        raise StepFailed(f"the smoke run of the installed wheel failed (exit {proc.returncode}): {' '.join(cmd)}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the work directory (it is kept on failure anyway)")
    args = ap.parse_args(argv)
    # outside the source tree (the fresh venv must not live in it) and unique (parallel runs, other checkouts)
    out = tempfile.mkdtemp(prefix="pdv_ext-wheel-test-")
    times: Dict[str, float] = {}
    t0 = time.monotonic()
    try:
        t = time.monotonic()
        paths = build(out)
        check_contents(paths, __version__)
        times["build + contents"] = time.monotonic() - t
        t = time.monotonic()
        py = fresh_env(out, paths["wheel"])
        times["fresh venv + install"] = time.monotonic() - t
        t = time.monotonic()
        smoke(out, py)
        times["smoke run"] = time.monotonic() - t
    except StepFailed as exc:
        print(f"[wheel] FAILED after {time.monotonic() - t0:.0f} s: {exc}\n[wheel] logs, venv and dist kept in {out}",
              file=sys.stderr)
        return 1
    if args.keep:
        print(f"[wheel] work directory kept: {out}")
    else:
        shutil.rmtree(out, ignore_errors=True)
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
    print(f"[wheel] ok: the installed wheel works; the wheel step took {time.monotonic() - t0:.0f} s ({parts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
