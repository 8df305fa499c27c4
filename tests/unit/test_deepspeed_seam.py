"""One seam with DeepSpeed (issue #34): every DeepSpeed private name pdv_ext relies on is named in
`pdv_ext/integrations/deepspeed/internals.py` and nowhere else, and the installed DeepSpeed has them all.

What counts as a DeepSpeed private name is read from DeepSpeed's own source (not a list kept by hand): every
`_name` (one leading underscore) that DeepSpeed defines - a method or class attribute, an attribute it sets
on `self`, a module global. pdv_ext's source outside internals.py may not use one as an attribute
(`x._name`), in getattr/hasattr/setattr strings, or in an import. It may not patch a DeepSpeed method on an
instance either (`optimizer.average_tensor = ...`): assigning to an attribute that DeepSpeed defines as a
method of the DeepSpeed classes pdv works on. A private name pdv_ext itself defines (its own `_t0`, `_lock`)
and torch.nn.Module's own are not DeepSpeed's.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

import pdv_ext

deepspeed = pytest.importorskip("deepspeed")

PACKAGE = Path(pdv_ext.__file__).parent
SEAM = PACKAGE / "integrations" / "deepspeed" / "internals.py"
DS_ROOT = Path(deepspeed.__file__).parent
#: the parts of DeepSpeed a training job's engine is made of (inference, ops' builders and the launcher are not)
DS_PARTS = ("runtime", "utils", "pipe", "comm", "moe", "accelerator", "__init__.py")

def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _defined_private_names(files, any_object: bool = True) -> Set[str]:
    """Every `_name` the source files define: module globals, functions, classes, methods, class
    attributes, attributes stored on `self` (with `any_object`, on any object)."""
    names: Set[str] = set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except (SyntaxError, UnicodeDecodeError):
            continue
        inherited = set()  # in a subclass of a DeepSpeed class, `self._x` is DeepSpeed's attribute, not pdv's own
        if not any_object:
            for cls in ast.walk(tree):
                if isinstance(cls, ast.ClassDef) and any(n in ast.unparse(b) for b in cls.bases for n in DS_BASES):
                    inherited |= {id(n) for n in ast.walk(cls)}
        for node in ast.walk(tree):
            if id(node) in inherited:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name) and _private(t.id):
                        names.add(t.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) and (
                    any_object or (isinstance(node.value, ast.Name) and node.value.id == "self")):
                names.add(node.attr)  # on self, or on objects DeepSpeed hands out (a parameter's _hp_mapping)
    return names


#: base classes that make a pdv class a DeepSpeed subclass (its `self._x` are DeepSpeed's attributes)
DS_BASES = ("EngineSeam", "PipelineEngine", "DeepSpeedEngine", "PipelineModule", "ProcessTopology",
            "PipelineParallelGrid")

#: the DeepSpeed classes whose instances pdv works on: patching one of their methods on an instance is a reach
PATCHED_CLASSES = ("deepspeed.runtime.pipe.engine:PipelineEngine", "deepspeed.runtime.pipe.module:PipelineModule",
                   "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer",
                   "deepspeed.runtime.bf16_optimizer:BF16_Optimizer",
                   "deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer",
                   "deepspeed.runtime.pipe.topology:PipelineParallelGrid",
                   "deepspeed.runtime.pipe.topology:ProcessTopology")


@lru_cache(maxsize=1)
def deepspeed_names() -> Tuple[Set[str], Set[str]]:
    """(DeepSpeed's private names that are not also pdv's own or torch.nn.Module's, the public methods of
    the DeepSpeed classes pdv works on)."""
    import importlib

    import torch

    files = [p for part in DS_PARTS for p in ((DS_ROOT / part).rglob("*.py") if (DS_ROOT / part).is_dir()
                                              else [DS_ROOT / part])]
    # pdv's own: what it defines on its own objects (not what it stores on another's), the seam left out
    ours = _defined_private_names([p for p in sorted(PACKAGE.rglob("*.py")) if p != SEAM], any_object=False)
    torch_module = {n for n in set(dir(torch.nn.Module)) | set(vars(torch.nn.Module())) if _private(n)}
    private = _defined_private_names(files) - ours - torch_module
    methods: Set[str] = set()
    base = set(dir(torch.nn.Module)) | set(dir(torch.optim.Optimizer)) | set(dir(object))
    for spec in PATCHED_CLASSES:
        mod, _, cls = spec.partition(":")
        klass = getattr(importlib.import_module(mod), cls)
        methods |= {n for n in dir(klass) if not n.startswith("_") and n not in base
                    and callable(getattr(klass, n, None)) and not isinstance(getattr(klass, n, None), type)}
    return private, methods


def _root(node: ast.AST) -> str:
    """The name an attribute chain starts from (`torch` for torch._utils._flatten_dense_tensors)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


#: attribute chains rooted at these names are torch's or the standard library's, never DeepSpeed's objects
#: (torch._utils._flatten_dense_tensors; os._exit, which a rank that must leave abruptly or without the
#: interpreter's finalisation calls, while DeepSpeed happens to define an `_exit` of its own)
NOT_DEEPSPEED = ("torch", "os", "sys")


def uses_of_private_names(path: Path, private: Set[str], methods: Set[str]) -> List[str]:
    """Every place in `path` that names one of `private` or patches one of `methods` on an object."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    where = path.relative_to(PACKAGE.parent)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private and _root(node) not in NOT_DEEPSPEED:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in private:
            found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
            found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
            for t in targets:
                for sub in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(sub, ast.Attribute) and sub.attr in methods and sub.attr not in OWN_PATCHABLE:
                        found.append(f"{where}:{node.lineno}: patches .{sub.attr}")
    return found


#: names of DeepSpeed methods that pdv sets on objects of its own (not DeepSpeed's), each with where
OWN_PATCHABLE: Dict[str, str] = {
    "scale": "emulate/weather.py: the emulated cluster's cores per unit of throughput",
    "gradient_predivide_factor": "integrations/horovod.py: pdv's Horovod DistributedOptimizer's own option",
}


def test_installed_deepspeed_has_every_name_the_seam_relies_on():
    from pdv_ext.integrations.deepspeed.internals import REQUIRED_NAMES, missing_names

    assert len(REQUIRED_NAMES) > 15
    missing = missing_names()
    assert not missing, (f"the installed DeepSpeed {deepspeed.__version__} lacks what "
                         f"pdv_ext/integrations/deepspeed/internals.py relies on: {', '.join(missing)}")


def test_missing_names_names_each_missing_one():
    from pdv_ext.integrations.deepspeed.internals import missing_names

    assert missing_names([("deepspeed.runtime.pipe.engine", "PipelineEngine._no_such_thing"),
                          ("deepspeed.no_such_module", "x"),
                          ("deepspeed.runtime.pipe.engine", "PipelineEngine._exec_reduce_grads")]) == [
        "deepspeed.runtime.pipe.engine:PipelineEngine._no_such_thing", "deepspeed.no_such_module:x"]


def test_no_deepspeed_private_name_outside_the_seam():
    private, methods = deepspeed_names()
    assert {"_INSTRUCTION_MAP", "_exec_reduce_grads", "_topo", "_hp_mapping", "_layer_specs"} <= private
    assert {"average_tensor", "buffered_reduce_fallback"} <= methods
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != SEAM:
            found += uses_of_private_names(path, private, methods)
    assert not found, ("DeepSpeed's private names (or patched methods) outside "
                       "pdv_ext/integrations/deepspeed/internals.py; put each behind a named function there:\n  "
                       + "\n  ".join(found))


def test_the_scan_finds_each_kind_of_reach(tmp_path):
    """The scan is not blind: an attribute, a getattr string, an import and an instance patch are found."""
    private, methods = deepspeed_names()
    bad = PACKAGE / "_seam_probe_tmp.py"
    bad.write_text("from deepspeed.runtime.pipe import p2p\n"
                   "def f(engine, opt, module):\n"
                   "    engine._exec_reduce_grads()\n"
                   "    getattr(module, '_layer_specs', None)\n"
                   "    opt.average_tensor = lambda t: t\n"
                   "    os._exit(0)\n"  # the standard library's, not DeepSpeed's `_exit`: not a reach
                   "    return p2p._groups\n")
    try:
        found = uses_of_private_names(bad, private, methods)
    finally:
        bad.unlink()
    assert {f.split(": ", 1)[1] for f in found} == {"._exec_reduce_grads", "getattr(..., '_layer_specs')",
                                                    "patches .average_tensor", "._groups"}, found


def test_release_shm_workspace_unlinks_this_ranks_name_only(tmp_path):
    """DeepSpeed's CPU all-reduce workspace names: this rank's of this job goes (its memory stays mapped), the
    other ranks' and other jobs' stay."""
    import os

    from pdv_ext.integrations.deepspeed.internals import release_shm_workspace
    from pdv_ext.spawn import SHM_WORKSPACE_PREFIX

    uid = os.getuid()
    names = [f"{SHM_WORKSPACE_PREFIX}_{uid}_127.0.0.1_29500_{r}" for r in range(3)] + \
        [f"{SHM_WORKSPACE_PREFIX}_{uid}_127.0.0.1_29501_1", f"{SHM_WORKSPACE_PREFIX}_{uid}_127.0.0.1_29500_11",
         f"{SHM_WORKSPACE_PREFIX}_{uid + 1}_127.0.0.1_29500_1"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    removed = release_shm_workspace(1, port="29500", shm_dir=str(tmp_path))
    assert [os.path.basename(p) for p in removed] == [names[1]]
    assert sorted(os.listdir(tmp_path)) == sorted(n for n in names if n != names[1])
    assert release_shm_workspace(1, port="29500", shm_dir=str(tmp_path)) == []  # gone already: nothing to do


def test_new_groups_time_out_after_sets_torch_s_default_for_groups_made_inside_only():
    """In-place recovery builds the survivors' engine inside `new_groups_time_out_after`: DeepSpeed's
    `new_group` calls pass no timeout, and torch's default for them (30 minutes) held the survivors when a
    member died while the engine's groups connected (the `build` phase of test_inplace_recovery.py). torch
    reads the default at call time; if a torch version stops doing so, this fails."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from pdv_ext.integrations.deepspeed.internals import new_groups_time_out_after

    before = c10d._get_default_timeout(c10d.Backend.GLOO)
    with new_groups_time_out_after(7.5):
        assert c10d._get_default_timeout(c10d.Backend.GLOO) == timedelta(seconds=7.5)
    assert c10d._get_default_timeout(c10d.Backend.GLOO) == before
    with pytest.raises(RuntimeError), new_groups_time_out_after(3.0):
        raise RuntimeError("a failed build")
    assert c10d._get_default_timeout(c10d.Backend.GLOO) == before  # restored on the way out of an error too
