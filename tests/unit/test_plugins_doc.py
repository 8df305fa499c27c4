"""docs/plugins.md's examples run as written and do what the page says (issue #27 item 5): the policy file
is not called my_policy.py, its LR change keeps a warm-up scheduler's LR (no `lr = 0.0` on the demo's
WarmupLR), the aggregator reports what the Monitor reads, and a module shadowed by launch/my_policy.py is
named in the error."""
import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from pdv_ext.comm.base import LocalComm
from pdv_ext.policy import build_policy
from pdv_ext.policy.metrics import _report_scalars
from pdv_ext.policy.runner import PolicyRunner
from tests.threadcomm import run_threads

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")


def example(filename):
    """The ```python block of plugins.md that starts with `# <filename>`."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)
    found = [b for b in blocks if b.startswith(f"# {filename}\n")]
    assert len(found) == 1, f"plugins.md has {len(found)} examples named {filename}"
    return found[0]


def load(tmp_path, filename):
    path = tmp_path / filename
    path.write_text(example(filename))
    spec = importlib.util.spec_from_file_location(f"plugins_doc_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_policy_example_is_not_named_after_the_shipped_template():
    assert "# my_policy.py" not in PAGE and (ROOT / "launch" / "my_policy.py").exists()
    example("lr_plateau.py")


class WarmupApplier:
    """The demo's LR: WarmupLR from 0.0 to 0.002 over 30 steps, set by the scheduler after every step."""

    def __init__(self):
        self.step, self.lrs = 0, [0.0]

    def sched(self):
        return 0.002 * min(self.step / 30, 1.0)

    def batch_geometry(self):
        return 8, 4, 2

    def get_lr(self):
        return list(self.lrs)

    def set_lr(self, lrs):
        self.lrs = list(lrs)


def test_the_lr_example_halves_the_schedulers_lr_instead_of_setting_zero(tmp_path):
    module = load(tmp_path, "lr_plateau.py")
    from pdv_ext.policy import POLICIES

    try:
        policy = build_policy({"name": "halve_lr_on_plateau", "patience": 5})
        assert isinstance(policy, module.HalveOnPlateau)
        applier = WarmupApplier()
        runner = PolicyRunner([policy], LocalComm(), applier)
        runner.on_train_begin(0)  # what the engine glue does; ctx.lr is the warm-up's 0.0
        used = []
        for step in range(1, 41):
            used.append(applier.lrs[0])  # what the step's update uses
            applier.step = step
            applier.lrs = [applier.sched()]  # the scheduler after the update
            runner.sync_lr()
            runner.after_step({"step": step, "loss": 2.0})  # a plateau from the start
        acted = [s for s, _ in runner.action_log]
        assert acted == [6, 11, 16, 21, 26, 31, 36]  # step 1 sets the best; then every 5 steps without progress
        assert all(lr > 0 for lr in used[1:])  # never the 0.0 an absolute `lr=ctx.lr / 2` gave
        assert used[-1] == pytest.approx(0.002 * 0.5 ** 7)  # the scheduler's LR, halved seven times
    finally:
        POLICIES.unregister("halve_lr_on_plateau")


def test_the_aggregator_example_drops_the_outlier_and_reports_what_the_monitor_reads(tmp_path):
    module = load(tmp_path, "my_aggs.py")
    from pdv_ext.aggregation import AGGREGATORS, build_aggregator

    try:
        grads = [[torch.full((4,), 1.0), torch.full((2,), 2.0)], [torch.full((4,), 3.0), torch.full((2,), 4.0)],
                 [torch.full((4,), 1e3), torch.full((2,), 1e3)]]

        def rank(comm):
            agg = build_aggregator({"type": "norm_filtered_mean", "max_norm": 50.0})
            assert isinstance(agg, module.NormFilteredMean)
            out = agg.aggregate([g.clone() for g in grads[comm.rank]], comm)
            return out, agg.report

        results = run_threads(3, rank)
        for out, report in results:
            assert torch.equal(out[0], torch.full((4,), 2.0)) and torch.equal(out[1], torch.full((2,), 3.0))
            assert report == {"dropped": [2]}
            assert _report_scalars(report)[0] == 1.0  # the Monitor's `dropped`: one replica
    finally:
        AGGREGATORS.unregister("norm_filtered_mean")


def test_a_shadowed_module_is_named_in_the_error(tmp_path):
    """A script in a folder with its own my_policy.py (as launch/ has) imports that one, not the user's
    my_policy.py in the working directory: the error says which file it imported and what it hid."""
    scripts, work = tmp_path / "launchdir", tmp_path / "work"
    scripts.mkdir()
    work.mkdir()
    (scripts / "my_policy.py").write_text("class PlateauLR:\n    pass\n")
    (work / "my_policy.py").write_text("class HalveOnPlateau:\n    pass\n")
    (scripts / "run.py").write_text(textwrap.dedent("""\
        from pdv_ext.policy import build_policy
        from pdv_ext.registry import RegistryError
        try:
            build_policy({"name": "my_policy:HalveOnPlateau"})
        except RegistryError as exc:
            print(exc)
        """))
    proc = subprocess.run([sys.executable, str(scripts / "run.py")], cwd=work, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"module 'my_policy' ({scripts / 'my_policy.py'}) has no attribute 'HalveOnPlateau' (from "
        "'my_policy:HalveOnPlateau'); my_policy.py in the working directory has the same module name and was not "
        "imported: rename it")


def test_a_plugin_module_that_fails_while_importing_is_named_with_its_error(tmp_path, monkeypatch):
    from pdv_ext.registry import RegistryError, import_user_modules, load_object

    (tmp_path / "fh_broken_dep.py").write_text("import fh_no_such_dependency\nclass P:\n    pass\n")
    (tmp_path / "fh_bad_syntax.py").write_text("def f(:\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError) as exc:
        load_object("fh_broken_dep:P")
    assert str(exc.value) == ("importing module 'fh_broken_dep' (fh_broken_dep.py) for 'fh_broken_dep:P' failed: "
                              "ModuleNotFoundError: No module named 'fh_no_such_dependency'")
    with pytest.raises(RegistryError) as exc:
        import_user_modules(["fh_bad_syntax"])
    assert str(exc.value).startswith("importing module 'fh_bad_syntax' (fh_bad_syntax.py) failed: SyntaxError")
    with pytest.raises(RegistryError) as exc:
        import_user_modules(["fh_not_there"])
    assert str(exc.value).startswith("cannot import module 'fh_not_there': No module named 'fh_not_there' (looked on")
