"""The README's example config is a shipped file that the demo's 4 ranks can run (issue #27 item 5: it named
an 8-device cluster, and `pdv check-config --world-size 4` said `ok` before the launch failed)."""
import json
import pathlib
import re

import pytest

from pdv_ext.config_cli import main as check_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_readme_example_is_launch_configs_placement_json():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", readme, flags=re.S)]
    shipped = json.loads((ROOT / "launch/configs/placement.json").read_text(encoding="utf-8"))
    assert shipped in blocks


@pytest.mark.parametrize("config, world", [("launch/configs/placement.json", 4), ("launch/configs/demo.json", 4),
                                           ("launch/configs/horovod.yaml", 4)])
def test_shipped_configs_pass_check_config_for_the_demo(monkeypatch, capsys, config, world):
    monkeypatch.chdir(ROOT)  # relative paths in a config file are read from its folder: any cwd works
    assert check_config([config, "--world-size", str(world)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok"


def test_the_placement_config_on_the_wrong_world_size_is_an_error(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert check_config(["launch/configs/placement.json", "--world-size", "8"]) == 2
    assert capsys.readouterr().out.splitlines() == [
        "pdv.placement.cluster: describes 4 devices (device i is rank i) but --world-size 8"]
