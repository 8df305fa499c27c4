"""Packaging metadata (pyproject.toml) against the code it describes, the wheel-content rules of
`make test-wheel`, and where an installed package caches its JIT build. The wheel itself is built, installed
and run by `make test-wheel` (tests/wheel/check_wheel.py), not here."""
import glob
import io
import os
import re

import pytest

import pdv_ext
from pdv_ext import cli, source_tree, spawn
from pdv_ext.aggregation import AGGREGATORS
from pdv_ext.kernels import cpu
from pdv_ext.placement.solvers import SOLVERS
from pdv_ext.policy.base import POLICIES
from pdv_ext.registry import load_object
from tests.wheel import dist_contents

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTRAS = {"horovod", "mpi", "plot", "docs", "dev"}


@pytest.fixture(scope="module")
def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def test_one_version_shown_by_the_cli(pyproject, capsys):
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pdv_ext.__version__"}
    assert "version" not in pyproject["project"]
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+|\.dev\d+)?", pdv_ext.__version__)
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"pdv_ext {pdv_ext.__version__}\n"
    assert not os.path.exists(os.path.join(ROOT, "setup.py"))  # no second place for metadata


def test_console_script_and_extras(pyproject):
    project = pyproject["project"]
    assert load_object(project["scripts"]["pdv"]) is cli.main
    assert set(project["optional-dependencies"]) == EXTRAS
    assert project["license"] == "Apache-2.0" and os.path.isfile(os.path.join(ROOT, "LICENSE"))
    assert project["readme"] == "README.md"


def test_requirements_dev_installs_what_the_metadata_asks_for(pyproject):
    """make setup installs pdv_ext editable without dependencies and takes them from requirements-dev.txt:
    everything the package and its extras (but Horovod, built separately, and torch, pinned) need is there."""
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        listed = {_name(line.strip()) for line in f if line.strip() and not line.startswith("#")}
    project = pyproject["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in ("mpi", "plot", "docs", "dev"):
        wanted |= {_name(r) for r in project["optional-dependencies"][extra]}
    assert wanted - {"torch"} - listed == set()


def test_entry_point_groups_are_the_registries_and_are_documented(pyproject):
    groups = {AGGREGATORS.group, POLICIES.group, SOLVERS.group}
    assert groups == {"pdv_ext.aggregators", "pdv_ext.policies", "pdv_ext.solvers"}
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        toml_text = f.read()
    with open(os.path.join(ROOT, pyproject["project"]["readme"])) as f:
        readme = f.read()  # the long description users of the metadata read
    for group in groups:
        assert f'"{group}"' in toml_text, group
        assert f"`{group}`" in readme, group


def test_kernel_sources_are_package_data(pyproject):
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pdv_ext.kernels"]
    shipped = {p for pat in patterns for p in glob.glob(os.path.join(ROOT, "pdv_ext", "kernels", pat))}
    assert cpu.SOURCE in shipped and os.path.isfile(cpu.SOURCE)
    # every C++ source of the project lives there (none left at the top as before)
    cpp = {p for p in glob.glob(os.path.join(ROOT, "**", "*.cpp"), recursive=True)
           if not os.path.relpath(p, ROOT).startswith(("build", ".venv"))}
    assert cpp == shipped


# ---- the rules `make test-wheel` applies to the built distributions -----------------------------------
GOOD_WHEEL = {
    "pdv_ext/__init__.py": 900, "pdv_ext/py.typed": 0, "pdv_ext/cli.py": 3000,
    "pdv_ext/kernels/csrc/pdv_kernels.cpp": 30000, "pdv_ext/data/alpa_prof_database.json": 215185,
    "pdv_ext-0.1.0.dist-info/METADATA": 9000, "pdv_ext-0.1.0.dist-info/entry_points.txt": 40,
    "pdv_ext-0.1.0.dist-info/licenses/LICENSE": 11000, "pdv_ext-0.1.0.dist-info/RECORD": 9000,
}
PACKAGE = ["pdv_ext/__init__.py", "pdv_ext/py.typed", "pdv_ext/cli.py", "pdv_ext/kernels/csrc/pdv_kernels.cpp",
           "pdv_ext/data/alpa_prof_database.json"]


def test_a_good_wheel_passes():
    assert dist_contents.wheel_problems(GOOD_WHEEL, "0.1.0", PACKAGE) == []


@pytest.mark.parametrize("change, complaint", [
    ({"tests/unit/test_x.py": 100}, "tests/unit/test_x.py does not belong"),
    ({"pdv_ext/tests/test_x.py": 100}, "pdv_ext/tests/test_x.py does not belong"),
    ({"pdv_ext/kernels/__pycache__/cpu.cpython-311.pyc": 100}, "does not belong"),
    ({"pdv_ext/kernels/pdv_kernels.so": 100}, "pdv_kernels.so does not belong"),
    ({"pdv_ext/data/weights.pt": 5_000_000}, "pdv_ext/data/weights.pt is 5000000 bytes"),
    ({"pdv_ext/data/alpa_prof_database.json": 900_000}, "alpa_prof_database.json is 900000 bytes"),
    ({"pdv_ext-0.1.0.data/data/share/pdv_ext/kernels/pdv_kernels.cpp": 30000}, "is outside pdv_ext/"),
    ({"pdv_ext/kernels/csrc/pdv_kernels.cpp": None}, "pdv_ext/kernels/csrc/pdv_kernels.cpp is missing"),
    ({"pdv_ext/cli.py": None}, "pdv_ext/cli.py is missing"),
    ({"pdv_ext-0.1.0.dist-info/licenses/LICENSE": None}, "licenses/LICENSE is missing"),
])
def test_a_bad_wheel_is_named(change, complaint):
    files = dict(GOOD_WHEEL)
    for name, size in change.items():
        if size is None:
            files.pop(name)
        else:
            files[name] = size
    problems = dist_contents.wheel_problems(files, "0.1.0", PACKAGE)
    assert any(complaint in p for p in problems), problems


def test_metadata_rules():
    ep = "[console_scripts]\npdv = pdv_ext.cli:main\n"
    meta = ("License-Expression: Apache-2.0\nRequires-Python: >=3.10\nProvides-Extra: plot\n\n"
            "groups `pdv_ext.aggregators`, `pdv_ext.policies`\n")
    assert dist_contents.metadata_problems(meta, ep, ["plot"]) == []
    problems = dist_contents.metadata_problems(meta.replace("Provides-Extra: plot", ""), "", ["plot"])
    assert any("console script" in p for p in problems) and any("extra 'plot'" in p for p in problems)


def test_sdist_must_hold_what_the_wheel_ships():
    sdist = {"pyproject.toml": 1, "README.md": 1, "LICENSE": 1, "PKG-INFO": 1,
             **{n: s for n, s in GOOD_WHEEL.items() if n.startswith("pdv_ext/")}}
    assert dist_contents.sdist_problems(sdist, GOOD_WHEEL) == []
    del sdist["pdv_ext/kernels/csrc/pdv_kernels.cpp"], sdist["pyproject.toml"]
    problems = dist_contents.sdist_problems(sdist, GOOD_WHEEL)
    assert "sdist: pdv_ext/kernels/csrc/pdv_kernels.cpp is missing" in problems
    assert "sdist: pyproject.toml is missing" in problems


def test_file_lists_are_read_from_real_archives(tmp_path):
    import tarfile
    import zipfile

    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pdv_ext/__init__.py", "x = 1\n")
    assert dist_contents.wheel_files(str(whl)) == {"pdv_ext/__init__.py": 6}
    sdist = tmp_path / "x.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        data = b"[project]\n"
        info = tarfile.TarInfo("pdv_ext-0.1.0/pyproject.toml")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    assert dist_contents.sdist_files(str(sdist)) == {"pyproject.toml": len(data)}


# ---- where the JIT build goes ---------------------------------------------------------------------------
def test_a_checkout_caches_builds_in_its_build_folder(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert source_tree.checkout_root() == ROOT
    assert cpu.extensions_dir() == os.path.join(ROOT, "build", "torch_extensions")
    assert spawn.default_env()["TORCH_EXTENSIONS_DIR"] == os.path.join(ROOT, "build", "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/else")
    assert cpu.extensions_dir() == "/somewhere/else" == spawn.default_env()["TORCH_EXTENSIONS_DIR"]


def test_an_installed_package_never_caches_beside_itself(monkeypatch, tmp_path):
    """Installed (no pyproject.toml above the package), the cache is torch's default, not site-packages/build."""
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(source_tree, "ROOT", str(tmp_path))  # stands for site-packages
    assert source_tree.checkout_root() is None
    assert cpu.extensions_dir() == cpp_extension.get_default_build_root()
    assert "TORCH_EXTENSIONS_DIR" not in spawn.default_env()
