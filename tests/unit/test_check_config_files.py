"""`pdv check-config` loads what the launch will load (issue #27 item 5): the cluster YAML with its units, a
plan file, a profile, `module:function` solvers and `--import`ed plugins, and cross-checks their sizes
with `--world-size` / `--stages`; one line per problem, exit 2. A cluster YAML given directly is checked as
a cluster; a config with no "pdv" section is an error; defaults a cluster fills are warnings."""
import json
import textwrap
import warnings

import pytest

from pdv_ext.config_cli import main as check_config
from pdv_ext.placement.cluster import Cluster, ClusterDefaultWarning

CLUSTER4 = textwrap.dedent("""\
    devices:
      - {name: a0, host: a, throughput: 1.0}
      - {name: a1, host: a, throughput: 1.0}
      - {name: b0, host: b, throughput: 0.5}
      - {name: b1, host: b, throughput: 0.5}
    links:
      intra_host: {bandwidth: 1 Gbit/s, latency: 100us}
      inter_host: {bandwidth: 100 Mbit/s, latency: 2ms}
    """)


def run(capsys, *argv):
    code = check_config([str(a) for a in argv])
    return code, capsys.readouterr().out.splitlines()


def config(tmp_path, pdv, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "pdv": pdv}))
    return path


def cluster_file(tmp_path, text=CLUSTER4, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def planned(tmp_path, cluster, **more):
    return config(tmp_path, {"placement": {"cluster": cluster, "input_shape": [8, 64], "input_dtype": "int64", **more}})


def test_a_valid_planning_config_is_ok_and_its_world_size_is_the_clusters(tmp_path, capsys):
    path = planned(tmp_path, cluster_file(tmp_path))
    assert run(capsys, path) == (0, ["ok"])
    assert run(capsys, path, "--world-size", 4) == (0, ["ok"])
    code, out = run(capsys, path, "--world-size", 8)
    assert code == 2 and out == [f"pdv.placement.cluster: describes 4 devices (device i is rank i) but --world-size 8"]


def test_missing_cluster_file_is_an_error(tmp_path, capsys):
    code, out = run(capsys, planned(tmp_path, str(tmp_path / "nope.yaml")))
    assert code == 2 and len(out) == 1
    assert out[0].startswith(f"pdv.placement.cluster: {tmp_path / 'nope.yaml'}: cannot read cluster YAML")


def test_a_bad_unit_in_the_cluster_names_its_key(tmp_path, capsys):
    bad = cluster_file(tmp_path, CLUSTER4.replace("latency: 2ms", "latency: 2 Mbit/s"))
    code, out = run(capsys, planned(tmp_path, bad))
    assert code == 2 and len(out) == 1
    assert out[0].startswith(f"pdv.placement.cluster: {bad}.links.inter_host.latency: unknown time unit"), out


def test_stages_must_divide_the_clusters_devices(tmp_path, capsys):
    code, out = run(capsys, planned(tmp_path, cluster_file(tmp_path), num_stages=3))
    assert code == 2 and out == [f"pdv.placement.num_stages: 3 stages do not divide the 4 devices of "
                                 f"'{tmp_path / 'c.yaml'}' (DeepSpeed gives every stage the same number of ranks)"]


def test_profiling_at_start_up_needs_an_input_shape_and_a_given_profile_must_load(tmp_path, capsys):
    c = cluster_file(tmp_path)
    code, out = run(capsys, config(tmp_path, {"placement": {"cluster": c}}))
    assert code == 2 and len(out) == 1 and out[0].startswith("pdv.placement.input_shape: needed to profile the model")
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    code, out = run(capsys, config(tmp_path, {"placement": {"cluster": c, "profile": str(bad)}}))
    assert code == 2 and out and all(line.startswith(f"pdv.placement.profile: {bad}") for line in out), out


def test_a_module_function_solver_must_import(tmp_path, capsys):
    code, out = run(capsys, planned(tmp_path, cluster_file(tmp_path), solver="no_such_module_xyz:solve"))
    assert code == 2 and len(out) == 1
    assert out[0].startswith("pdv.placement.solver: cannot import module 'no_such_module_xyz'"), out


def test_a_plan_file_is_read_and_checked_against_the_job(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    missing = config(tmp_path, {"placement": {"plan": str(plan)}})
    code, out = run(capsys, missing)
    assert code == 2 and len(out) == 1 and out[0].startswith(f"pdv.placement.plan: cannot read plan '{plan}'")
    plan.write_text(json.dumps({"boundaries": [0, 3, 6], "rank_mapping": [[0, 0], [1, 2]]}))
    code, out = run(capsys, missing)
    assert code == 2 and out == [f"pdv.placement.plan: {plan}.rank_mapping: must use each rank 0..3 exactly once "
                                 f"(got [[0, 0], [1, 2]])"]
    plan.write_text(json.dumps({"boundaries": [0, 3, 6], "rank_mapping": [[0, 3], [1, 2]]}))
    assert run(capsys, missing) == (0, ["ok"])
    assert run(capsys, missing, "--world-size", 4) == (0, ["ok"])
    assert run(capsys, missing, "--world-size", 2) == (2, ["pdv.placement.plan: places 4 ranks but --world-size 2"])
    assert run(capsys, missing, "--world-size", 4, "--stages", 1) == (
        2, ["pdv.placement.plan: 2 stages, but --stages 1"])


def test_explicit_rank_mapping_is_checked_against_the_world_size(tmp_path, capsys):
    path = config(tmp_path, {"placement": {"boundaries": [0, 2, 4], "rank_mapping": [[0, 3], [1, 2]]}})
    assert run(capsys, path, "--world-size", 4) == (0, ["ok"])
    assert run(capsys, path, "--world-size", 6) == (2, ["pdv.placement.rank_mapping: places 4 ranks but --world-size 6"])


def test_a_cluster_yaml_given_directly_is_checked_as_a_cluster(tmp_path, capsys):
    good = cluster_file(tmp_path)
    assert run(capsys, good) == (0, ["ok (a cluster YAML: 4 devices on 2 hosts)"])
    assert run(capsys, good, "--world-size", 2) == (
        2, [f"{good}: describes 4 devices (device i is rank i) but --world-size 2"])
    bad = cluster_file(tmp_path, CLUSTER4.replace("100 Mbit/s", "100 Mbits"), "bad.yaml")
    code, out = run(capsys, bad)
    assert code == 2 and len(out) == 1 and out[0].startswith(f"{bad}.links.inter_host.bandwidth: unknown bandwidth unit")


def test_a_file_without_a_pdv_section_is_an_error_and_an_empty_one_is_ok(tmp_path, capsys):
    plain = tmp_path / "ds.json"
    plain.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8}))
    code, out = run(capsys, plain)
    assert code == 2 and len(out) == 1 and out[0].startswith(f"{plain}: no \"pdv\" section")
    assert "add \"pdv\": {} to mean that" in out[0]
    assert run(capsys, config(tmp_path, {})) == (0, ["ok"])


def test_cluster_defaults_are_warnings_naming_the_key_and_the_value(tmp_path, capsys):
    text = textwrap.dedent("""\
        devices:
          - {name: a0, host: a, throughput: 2.0}
          - {name: a1, host: a}
          - {name: b0, host: b, throughput: 1.0}
        links:
          intra_host: {bandwidth: 1 Gbit/s, latency: 100us}
        """)
    c = cluster_file(tmp_path, text)
    with pytest.warns(ClusterDefaultWarning) as seen:
        Cluster.load(c)
    lines = [str(w.message) for w in seen]
    assert lines == [f"{c}: devices.1.throughput: not given, 1.0 assumed (speeds are relative to "
                     "reference_throughput, by default the fastest device)",
                     f"{c}: links.inter_host: not given, bandwidth 1.25e+09 B/s (10 Gbit/s) and latency 50 us assumed"]
    code, out = run(capsys, c)
    assert code == 0 and out == [f"warning: {line}" for line in lines] + ["ok (a cluster YAML: 3 devices on 2 hosts)"]
    code, out = run(capsys, planned(tmp_path, c, num_stages=3))
    assert code == 0 and out == [f"warning: pdv.placement.cluster: {line}" for line in lines] + ["ok"]


def test_unused_links_and_given_values_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any ClusterDefaultWarning fails
        Cluster.from_dict({"devices": [{"name": "a", "host": "h", "throughput": 1.0}]})  # one device: no link used
        Cluster.from_dict({"hosts": [{"name": "h", "devices": 2, "throughput": 1.0}],
                           "links": {"intra_host": {"bandwidth": 1e9}}})  # one host: inter_host unused
        for path in ("launch/clusters/emulated_4dev.yaml", "launch/clusters/homogeneous.yaml",
                     "launch/clusters/slow_interhost.yaml", "launch/clusters/two_generations.yaml"):
            Cluster.load(path)  # the shipped examples are complete


def test_import_makes_decorator_registered_names_known(tmp_path, capsys, monkeypatch):
    plugin = tmp_path / "lr_plateau_fh.py"
    plugin.write_text(textwrap.dedent("""\
        from pdv_ext.policy import Policy, register_policy

        @register_policy("fh_test_plateau")
        class Plateau(Policy):
            pass
        """))
    path = config(tmp_path, {"policy": {"plugins": [{"name": "fh_test_plateau"}]}})
    monkeypatch.chdir(tmp_path)
    code, out = run(capsys, path)
    assert code == 2 and len(out) == 1 and out[0].startswith("pdv.policy.plugins.0.name: unknown policy 'fh_test_plateau'")
    assert "'module:Class'" in out[0] and "--import MODULE" in out[0]
    try:
        assert run(capsys, path, "--import", str(plugin)) == (0, ["ok"])
    finally:
        from pdv_ext.policy import POLICIES

        POLICIES.unregister("fh_test_plateau")
    code, out = run(capsys, path, "--import", "no_such_module_xyz")
    assert code == 2 and out[0].startswith("--import: cannot import module 'no_such_module_xyz'")
