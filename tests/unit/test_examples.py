"""The examples that ship in the package (issue #35 item 1): `pdv example` lists and copies them, a copy's
configs keep their relative paths, the package data covers every shipped data file, and the minimal program on
the getting-started page is the shipped `pdv_ext/examples/minimal.py`, character for character."""
import fnmatch
import os
import re
from pathlib import Path

import pytest

from pdv_ext import examples
from pdv_ext.cli import main as pdv
from pdv_ext.config import check_file

ROOT = Path(__file__).resolve().parents[2]


def minimal_block(page: str) -> str:
    """The ```python block of a docs page that starts with `# minimal.py`."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / page).read_text(encoding="utf-8"), re.M | re.S)
    found = [b for b in blocks if b.startswith("# minimal.py")]
    assert len(found) == 1, f"docs/{page} has {len(found)} blocks starting with '# minimal.py'"
    return found[0]


def test_the_docs_minimal_program_is_the_shipped_one():
    assert minimal_block("getting-started.md") == (ROOT / "pdv_ext/examples/minimal.py").read_text(encoding="utf-8")


def test_every_example_file_exists_and_is_package_data():
    import tomllib

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pdv_ext.examples"]
    names = examples.files(examples.ALL)
    assert {"minimal.py", "train_gpt.py", "my_policy.py", "my_aggregator.py", "configs/demo.json"} <= set(names)
    for name in names:
        assert os.path.isfile(examples.path(name)), name
    data = [str(p.relative_to(ROOT / "pdv_ext/examples")) for p in (ROOT / "pdv_ext/examples").rglob("*")
            if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts]
    assert data and all(any(fnmatch.fnmatch(d, g) for g in globs) for d in data), data


def test_pdv_example_lists_and_copies_with_the_layout(tmp_path, capsys, monkeypatch):
    assert pdv(["example"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in examples.EXAMPLES)
    dest = tmp_path / "job"
    assert pdv(["example", "configs", str(dest)]) == 0
    out = capsys.readouterr().out
    assert str(dest / "configs" / "placement.json") in out and "next: cd" in out
    monkeypatch.chdir(tmp_path)  # the copy's relative paths hold from anywhere
    assert check_file(str(dest / "configs" / "placement.json"), world_size=4) == []
    assert pdv(["example", "configs", str(dest)]) == 2  # no silent overwrite
    assert "--force" in capsys.readouterr().err
    assert pdv(["example", "configs", str(dest), "--force"]) == 0


def test_pdv_example_plugins_copy_checks_with_its_plugins(tmp_path, capsys, monkeypatch):
    assert pdv(["example", "plugins", str(tmp_path)]) == 0
    monkeypatch.chdir(tmp_path)  # "my_policy:PlateauLR" is found in the working directory
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_file("configs/my_plugins.json", world_size=4) == []


def test_pdv_example_unknown_name(capsys):
    assert pdv(["example", "minimall", "x"]) == 2
    assert "did you mean 'minimal'" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["demo.json", "placement.json", "horovod.yaml"])
def test_shipped_configs_check_in_place(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the installed folder's own relative paths
    assert check_file(examples.path(f"configs/{config}"), world_size=4) == []
