"""Cluster YAML: units, validation errors naming the key, link lookup, shipped examples."""
import glob
import os

import pytest

from pdv_ext.config_base import ConfigError
from pdv_ext.placement.cluster import Cluster, parse_quantity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_units():
    assert parse_quantity("1 Gbit/s", "bandwidth") == 1.25e8
    assert parse_quantity("10 GB/s", "bandwidth") == 1e10
    assert parse_quantity("100Mbit/s", "bandwidth") == 1.25e7
    assert parse_quantity("50us", "latency") == pytest.approx(5e-5)
    assert parse_quantity("2ms", "latency") == pytest.approx(2e-3)
    assert parse_quantity("16 GiB", "memory") == 16 * 2 ** 30
    assert parse_quantity(3.5, "bandwidth") == 3.5


def test_errors_name_the_key():
    with pytest.raises(ConfigError) as exc:
        Cluster.from_dict({"devices": [{"name": "a", "host": "h", "throughput": -1, "colour": "red"}],
                           "links": {"inter_host": {"bandwidth": "5 parsecs"}}}, source="c.yaml")
    text = "\n".join(exc.value.errors)
    assert "c.yaml.devices.0.throughput" in text
    assert "c.yaml.devices.0.colour: unknown key" in text
    assert "c.yaml.links.inter_host.bandwidth" in text and "parsecs" in text


def test_unknown_pair_device_and_duplicates():
    with pytest.raises(ConfigError, match="unknown device 'zz'"):
        Cluster.from_dict({"devices": [{"name": "a", "host": "h"}],
                           "links": {"pairs": [{"a": "a", "b": "zz", "bandwidth": 1}]}})
    with pytest.raises(ConfigError, match="unique"):
        Cluster.from_dict({"devices": [{"name": "a", "host": "h"}, {"name": "a", "host": "g"}]})
    with pytest.raises(ConfigError, match="at least one device"):
        Cluster.from_dict({})


def test_links_and_speeds():
    c = Cluster.from_dict({
        "devices": [{"name": "x", "host": "h0", "throughput": 2.0}],
        "hosts": [{"name": "h1", "devices": 2, "throughput": 1.0, "memory": "1 GiB"}],
        "links": {"intra_host": {"bandwidth": "8 Gbit/s", "latency": "10us"},
                  "inter_host": {"bandwidth": "800 Mbit/s", "latency": "1ms"},
                  "pairs": [{"a": "x", "b": "h1/1", "bandwidth": "80 Mbit/s", "latency": "2ms"}]}})
    assert len(c) == 3 and c.hosts == ["h0", "h1"]
    assert c.speed(0) == 1.0 and c.speed(1) == 0.5
    assert c.memory(1) == 2 ** 30 and c.memory(0) == float("inf")
    assert c.link(1, 2).bandwidth == 1e9            # same host
    assert c.link(0, 1).bandwidth == 1e8            # across hosts
    assert c.link(2, 0).bandwidth == 1e7            # per-pair override, symmetric
    assert c.p2p_time(0, 1, 1e8) == pytest.approx(1e-3 + 1.0)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "launch", "clusters", "*.yaml"))))
def test_examples_load(path):
    c = Cluster.load(path)
    assert len(c) >= 4


def test_save_load_roundtrip(tmp_path):
    c = Cluster.load(os.path.join(ROOT, "launch", "clusters", "slow_interhost.yaml"))
    c.save(str(tmp_path / "c.yaml"))
    d = Cluster.load(str(tmp_path / "c.yaml"))
    assert [x.name for x in d.devices] == [x.name for x in c.devices]
    assert d.link(3, 4).bandwidth == c.link(3, 4).bandwidth
