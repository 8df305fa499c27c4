"""One registry mechanism: decorators, "module:attr" strings, entry points, helpful errors."""
import subprocess
import sys
import textwrap

import pytest

from pdv_ext.registry import Registry, RegistryError


def test_register_get_and_names():
    reg = Registry("widget", None)

    @reg.register("a")
    class A:
        pass

    assert reg.get("a") is A and reg.names() == ["a"] and "a" in reg
    assert reg.build("a").__class__ is A
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a", object)


def test_unknown_name_did_you_mean():
    reg = Registry("widget", None)
    reg.register("adasum", object)
    with pytest.raises(RegistryError) as exc:
        reg.get("adsum")
    assert "did you mean 'adasum'" in str(exc.value) and "known: adasum" in str(exc.value)


def test_module_attr_spec():
    reg = Registry("widget", None)
    assert reg.get("collections:OrderedDict").__name__ == "OrderedDict"
    with pytest.raises(RegistryError, match="cannot import"):
        reg.get("no_such_module_x:Thing")
    with pytest.raises(RegistryError, match="no attribute"):
        reg.get("collections:NoSuchThing")


def test_entry_point_discovery(tmp_path):
    """A package that declares an entry point in group pdv_ext.aggregators is found by name."""
    pkg = tmp_path / "myagg.py"
    pkg.write_text(textwrap.dedent("""
        from pdv_ext.aggregation import Aggregator
        class Doubler(Aggregator):
            name = "doubler"
            def aggregate(self, grads, comm):
                return [g * 2 for g in grads]
    """))
    dist = tmp_path / "myagg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myagg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pdv_ext.aggregators]\ndoubler = myagg:Doubler\n")
    code = textwrap.dedent("""
        import torch
        from pdv_ext.aggregation import AGGREGATORS, build_aggregator
        from pdv_ext.comm import LocalComm
        assert "doubler" in AGGREGATORS.names(), AGGREGATORS.names()
        out = build_aggregator({"type": "doubler"}).aggregate([torch.ones(2)], LocalComm())
        assert out[0].tolist() == [2.0, 2.0]
        from pdv_ext.config import validate_pdv
        assert validate_pdv({"aggregation": {"type": "doubler"}})[1] == []
        print("found")
    """)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "found"
