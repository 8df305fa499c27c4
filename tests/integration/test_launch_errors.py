"""A launch with a bad config says why once (issue #27 item 5): `deepspeed --num_gpus 4 launch/train_gpt.py
--deepspeed_config BAD.json` printed the same ConfigError traceback once per rank (about 110 lines). Now rank
0 prints the error's lines, every rank exits with status 2, no traceback, and it fails before any process
group starts. `--import` makes a decorator-registered policy name usable."""
import glob
import json
import os
import sys
import textwrap

import pytest

from pdv_ext.spawn import free_port, run_command

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch(tmp_path, pdv, *extra):
    cfg = json.load(open(os.path.join(ROOT, "launch/configs/demo.json"), encoding="utf-8"))
    cfg["pdv"] = pdv
    path = tmp_path / "BAD.json"
    path.write_text(json.dumps(cfg))
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return run_command([deepspeed, "--num_gpus", "4", "--master_port", str(free_port()),
                        os.path.join(ROOT, "launch/train_gpt.py"), "--deepspeed_config", str(path), *extra],
                       env=env, timeout=240, tail_lines=400)


def test_a_bad_config_is_reported_once_without_traceback(tmp_path):
    plugin = tmp_path / "fh_plateau.py"
    plugin.write_text(textwrap.dedent("""\
        from pdv_ext.policy import Policy, register_policy

        @register_policy("fh_halve_on_plateau")
        class HalveOnPlateau(Policy):
            pass
        """))
    rc, out = launch(tmp_path, {"aggregation": {"type": "adasun"},
                                "policy": {"plugins": [{"name": "fh_halve_on_plateau"}]}},
                     "--import", str(plugin))
    assert rc == 2, out
    assert "Traceback" not in out, out
    assert out.count("pdv_ext: invalid configuration") == 1, out
    mentions = [line for line in out.splitlines() if "adasun" in line and "--deepspeed_config" not in line]
    assert len(mentions) == 1 and mentions[0].strip().startswith(
        "pdv.aggregation.type: unknown aggregator 'adasun' (did you mean 'adasum'?)"), out
    assert "fh_halve_on_plateau" not in out.replace(str(plugin), "")  # the --import'ed name was known
    assert "deepspeed_shm_comm" not in out  # failed before init_distributed


def test_a_missing_import_is_a_config_error_too(tmp_path):
    rc, out = launch(tmp_path, {}, "--import", "no_such_module_fh")
    assert rc == 2 and "Traceback" not in out, out
    lines = [line.strip() for line in out.splitlines() if "no_such_module_fh" in line and "spawned" not in line
             and "launch.py" not in line and "cmd = " not in line]  # not the launcher's command lines
    assert len(lines) == 1 and lines[0].startswith("--import: cannot import module 'no_such_module_fh'"), out


def test_initialize_without_the_decorator_is_reported_once_too(tmp_path):
    """issue #35 item 3: a script without `@exit_on_config_error` that hands a bad "pdv" section to
    `pdv_ext.initialize` (after the process group its PipelineModule needs) printed a traceback per rank and
    exited 1; the ConfigError nothing catches now ends each rank with the lines once (rank 0) and status 2."""
    script = tmp_path / "no_decorator.py"
    script.write_text(textwrap.dedent("""\
        import deepspeed
        import torch
        from deepspeed.pipe import PipelineModule

        import pdv_ext
        from pdv_ext.models import mlp_layers

        deepspeed.init_distributed(dist_backend="gloo")
        model = PipelineModule(layers=mlp_layers(4, 8, 8, 2), num_stages=2, loss_fn=torch.nn.CrossEntropyLoss())
        pdv_ext.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                               "pdv": {"aggregation": {"type": "adasun"}}})
        print("not reached")
        """))
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port = free_port()
    rc, out = run_command([deepspeed, "--num_gpus", "2", "--master_port", str(port), str(script)],
                          env=env, timeout=240, tail_lines=400)
    left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    for path in left:
        os.remove(path)
    assert not left, f"DeepSpeed's shm workspaces left behind by a failed start-up: {left}"
    assert rc == 2, out
    assert "Traceback" not in out and "not reached" not in out, out
    assert out.count("pdv_ext: invalid configuration") == 1, out
    assert out.count("pdv.aggregation.type: unknown aggregator 'adasun'") == 1, out
