"""A user aggregator shipped by another package (entry point group `pdv_ext.aggregators`) is found by name."""
import json
import os
import subprocess
import sys
import textwrap

PLUGIN = textwrap.dedent('''
    import torch
    from pdv_ext.aggregation import Aggregator
    from pdv_ext.config_base import StrictModel

    class Scaled(Aggregator):
        """Mean times a factor (a stand-in for any third-party aggregator)."""
        class Options(StrictModel):
            factor: float = 1.0

        def aggregate(self, grads, comm):
            for g in grads:
                comm.all_reduce(g, "avg")
                g.mul_(self.options.factor)
            return grads
''')

PROBE = textwrap.dedent('''
    import json, torch
    from pdv_ext.aggregation import AGGREGATORS, build_aggregator
    from pdv_ext.comm import LocalComm
    from pdv_ext.config import validate_pdv
    agg = build_aggregator({"type": "scaled_mean", "factor": 3})
    out = agg.aggregate([torch.ones(2)], LocalComm())
    print(json.dumps({"names": AGGREGATORS.names(), "out": out[0].tolist(), "cls": type(agg).__module__,
                      "ok": validate_pdv({"aggregation": {"type": "scaled_mean", "factor": 2}})[1],
                      "bad": validate_pdv({"aggregation": {"type": "scaled_mean", "factr": 2}})[1]}))
''')


def test_entry_point_aggregator_is_picked_up(tmp_path):
    (tmp_path / "my_pdv_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "my_pdv_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-pdv-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[pdv_ext.aggregators]\nscaled_mean = my_pdv_plugin:Scaled\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "scaled_mean" in res["names"] and "zeno" in res["names"]
    assert res["cls"] == "my_pdv_plugin" and res["out"] == [3.0, 3.0]
    assert res["ok"] == []
    assert res["bad"] and res["bad"][0].startswith("pdv.aggregation.factr")
