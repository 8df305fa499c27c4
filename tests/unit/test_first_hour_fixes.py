"""Issue #35's first-hour fixes: data shares that do not add up fail `pdv check-config` (item 2), a user's own
model profiles through `pdv profile --model module:function` (item 6), relative paths in a config file are read
from the file's folder (item 7), and the smaller ones of item 8 (no scheduler wording without a scheduler; the
start-up cluster error names its key)."""
import json
import logging
import os

import pytest

from pdv_ext.comm.base import LocalComm
from pdv_ext.config import ConfigError, check_file, split_config
from pdv_ext.config_cli import main as check_config
from pdv_ext.log import logger
from pdv_ext.placement.config import PlacementConfig
from pdv_ext.policy import Policy, SetLearningRate
from pdv_ext.policy.runner import PolicyRunner

CLUSTER = ("hosts: [{name: h, devices: 2, throughput: 1.0}]\n"
           "links: {intra_host: {bandwidth: 1 GB/s, latency: 10us}}\n")


# ---- item 2: data shares against the global batch -------------------------------------------------
def _ds(tmp_path, shares, **batch):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({**batch, "pdv": {"data_shares": shares}}))
    return str(p)


@pytest.mark.parametrize("argv", [[], ["--world-size", "2"]])
def test_check_config_refuses_shares_that_do_not_add_up_to_the_global_batch(tmp_path, capsys, argv):
    p = _ds(tmp_path, [5, 2], train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=4)
    assert check_config([p] + argv) == 2
    out = capsys.readouterr().out.splitlines()
    assert out == ["pdv.data_shares: [5, 2] add up to 7 micro-batches, but the global batch has 8 "
                   "(train_micro_batch_size_per_gpu 8, gradient_accumulation_steps 4 over 2 data-parallel replicas); "
                   "the shares split the step's batch, they do not change it"]


@pytest.mark.parametrize("shares, batch, ok", [
    ([5, 3], {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}, True),
    ([6, 2], {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, True),   # 64 / 8 = 8 micro-batches
    ([6, 3], {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, False),
    ([1, 1], {"train_batch_size": 16}, True),                                        # accumulation defaults to 1
    ([2, 1], {"train_batch_size": 16}, False),
])
def test_shares_are_checked_as_deepspeed_derives_the_batch(tmp_path, shares, batch, ok):
    assert (check_file(_ds(tmp_path, shares, **batch)) == []) is ok


def test_a_wrong_share_count_is_named_once(tmp_path):
    p = _ds(tmp_path, [5, 2], train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=4)
    errors = check_file(p, world_size=4)
    assert len(errors) == 1 and errors[0].startswith("pdv.data_shares: 2 values, but 4 ranks")


# ---- item 7: relative paths read from the config file's folder --------------------------------------
def _placement_config(folder, cluster_path):
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "pdv": {"placement": {
        "cluster": cluster_path, "input_shape": [4, 16]}}}))
    return p


def test_relative_cluster_path_is_read_from_the_config_files_folder(tmp_path, monkeypatch):
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "two.yaml").write_text(CLUSTER)
    cfg = _placement_config(tmp_path / "configs", "../clusters/two.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert check_file(str(cfg), world_size=2) == []
    _, pdv = split_config(str(cfg))
    assert pdv.placement.cluster == str(tmp_path / "clusters" / "two.yaml")
    monkeypatch.chdir(tmp_path / "configs")  # the same from the config's own folder, given relative
    assert split_config("ds.json")[1].placement.cluster == str(tmp_path / "clusters" / "two.yaml")


def test_a_dict_config_keeps_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, pdv = split_config({"pdv": {"placement": {"cluster": "c.yaml", "input_shape": [4, 16]}}})
    assert pdv.placement.cluster == "c.yaml"


def test_a_path_that_only_the_working_directory_has_is_named_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    cfg = _placement_config(tmp_path / "configs", "c.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as exc:
        split_config(str(cfg))
    (line,) = exc.value.errors
    assert line.startswith("pdv.placement.cluster: 'c.yaml' is read from the config file's folder") and "'../c.yaml'" in line
    assert check_file(str(cfg)) == [line]


# ---- item 8: the start-up cluster error names its key; no scheduler wording without a scheduler --------
def test_the_start_up_cluster_error_names_its_key(tmp_path):
    import inspect

    from pdv_ext.placement.startup import make_plan

    extra = {"layers": []} if "layers" in inspect.signature(make_plan).parameters else {}
    with pytest.raises(ConfigError) as exc:  # the cluster is read first: no model needed to get there
        make_plan(None, PlacementConfig(cluster=str(tmp_path / "missing.yaml")), 2, **extra)
    assert exc.value.errors and all(e.startswith("pdv.placement.cluster: ") for e in exc.value.errors)


class _Halve(Policy):
    def after_step(self, metrics):
        return [SetLearningRate(scale=0.5)] if metrics["step"] == 2 else []


class _Applier:
    def __init__(self):
        self.lrs = [0.1]

    def batch_geometry(self):
        return 4, 2, 1

    def get_lr(self):
        return list(self.lrs)

    def set_lr(self, lrs):
        self.lrs = list(lrs)


@pytest.fixture
def lines():
    seen = []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Capture()
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


@pytest.mark.parametrize("scheduler", [False, True])
def test_the_lr_line_mentions_a_scheduler_only_when_there_is_one(lines, scheduler):
    applier = _Applier()
    runner = PolicyRunner([_Halve()], LocalComm(), applier)
    for step in (1, 2, 3):
        runner.after_step({"step": step})
        runner.sync_lr()
        if scheduler:  # a scheduler sets the next step's LR (WarmupLR-like)
            applier.lrs = [0.1 * (step + 1) * runner.lr_scale]
            runner.sync_lr()
    (line,) = [m for m in lines if "SetLearningRate" in m]
    assert ("scheduler" in line) is scheduler, line
    if not scheduler:
        assert line.endswith("lr 0.1 -> 0.05")


# ---- item 6: profiling a user's own model ----------------------------------------------------------
USER_MODEL = '''
import torch
from deepspeed.pipe import LayerSpec


def layers():
    return [LayerSpec(torch.nn.Linear, 16, 32), LayerSpec(torch.nn.ReLU), LayerSpec(torch.nn.Linear, 32, 4)]


def with_input():
    return {"layers": layers(), "input": torch.randn(4, 16), "labels": torch.randint(0, 4, (4,)),
            "loss_fn": torch.nn.functional.cross_entropy}
'''


@pytest.mark.parametrize("fn, extra", [("layers", ["--input-shape", "4,16"]), ("with_input", [])])
def test_pdv_profile_takes_a_users_model_and_pdv_plan_takes_its_profile(tmp_path, monkeypatch, capsys, fn, extra):
    from pdv_ext.cli import main as pdv
    from pdv_ext.placement.profile import Profile

    (tmp_path / "first_hour_model.py").write_text(USER_MODEL)
    (tmp_path / "two.yaml").write_text(CLUSTER)
    monkeypatch.chdir(tmp_path)  # the module is found in the working directory
    assert pdv(["profile", "--model", f"first_hour_model:{fn}", "--reps", "1", "--out", "prof.json", *extra]) == 0
    prof = Profile.load("prof.json")
    assert len(prof) == 3 and prof.meta["model"] == f"first_hour_model:{fn}"
    assert pdv(["plan", "--cluster", "two.yaml", "--profile", "prof.json", "--stages", "2", "--out", "plan.json"]) == 0
    assert os.path.exists("plan.json")


def test_pdv_profile_names_what_a_users_model_lacks(tmp_path, monkeypatch, capsys):
    from pdv_ext.cli import main as pdv

    (tmp_path / "first_hour_model.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        pdv(["profile", "--model", "first_hour_model:layers", "--out", "p.json"])
    assert exc.value.code == 2 and "--input-shape: needed with --model module:function" in capsys.readouterr().err
