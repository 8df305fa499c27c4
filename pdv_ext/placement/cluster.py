"""Cluster description: devices (host, compute throughput, memory) and links (bandwidth, latency).

YAML layout (units: bandwidth in bytes/s or a string such as "1 Gbit/s", "10 GB/s"; latency in seconds
or "50us"/"2ms"; memory in bytes or "16 GiB"; throughput in FLOP/s or any relative unit)::

    devices:                       # list order = global rank order
      - {name: a0, host: a, throughput: 2.0, memory: 8 GiB}
    hosts:                         # shorthand: N identical devices per host (appended after `devices`)
      - {name: b, devices: 2, throughput: 1.0, memory: 8 GiB}
    links:
      intra_host: {bandwidth: 2 Gbit/s, latency: 50us}
      inter_host: {bandwidth: 100 Mbit/s, latency: 1ms}
      pairs:                       # per-pair overrides (symmetric)
        - {a: a0, b: b0, bandwidth: 50 Mbit/s, latency: 2ms}
    reference_throughput: 2.0      # throughput of the device the layer profile was measured on
                                   # (default: the fastest device in the cluster)
    events: [...]                  # `pdv emulate`'s timeline (pdv_ext.emulate.events); placement ignores it

Defaults (docs/placement.md, "Defaults"): a device's `throughput` 1.0, its `memory` unlimited, a link's
`latency` 0; `links.intra_host` 10 GB/s (80 Gbit/s) and 10 us, `links.inter_host` 1.25 GB/s (10 Gbit/s)
and 50 us. A missing throughput or a missing link that the cluster uses (intra_host: a host with two
devices or more; inter_host: two hosts or more) changes the plan, so each gets one ClusterDefaultWarning
naming the key and the value assumed.
"""
from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ..config_base import ConfigError, StrictModel, format_errors

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}


def parse_quantity(value: Union[str, int, float], kind: str) -> float:
    """'1 Gbit/s' -> 1.25e8 bytes/s, '50us' -> 5e-5 s, '16 GiB' -> bytes. Numbers pass through."""
    if isinstance(value, bool):
        raise ValueError(f"expected a {kind}, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    s = str(value).strip().replace(" ", "")
    m = re.fullmatch(r"([0-9.eE+-]+)([A-Za-z/]*)", s)
    if not m:
        raise ValueError(f"cannot read {kind} {value!r}")
    num, unit = float(m.group(1)), m.group(2)
    if not unit:
        return num
    u = unit.lower()
    if kind == "latency":
        scale = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}.get(u)
        if scale is None:
            raise ValueError(f"unknown time unit in {value!r} (use s, ms, us, ns)")
        return num * scale
    if kind == "bandwidth":
        m2 = re.fullmatch(r"([kKmMgGtT]i?)?(bit/s|bps|Bit/s|b/s|B/s|byte/s|bytes/s|Byte/s)", unit)
        if m2:
            prefix = (m2.group(1) or "").lower()
            bits = m2.group(2).lower() in ("bit/s", "bps", "b/s") and m2.group(2) != "B/s"
            return num * _PREFIX[prefix] / (8.0 if bits else 1.0)
        raise ValueError(f"unknown bandwidth unit in {value!r} (use e.g. '1 Gbit/s', '100 Mbit/s', '10 GB/s')")
    if kind == "memory":
        u2 = u[:-1] if u.endswith("b") else u
        if u2 in _PREFIX:
            return num * _PREFIX[u2]
        raise ValueError(f"unknown memory unit in {value!r} (use e.g. '16 GiB', '512 MB')")
    return num


DEFAULT_THROUGHPUT = 1.0
DEFAULT_INTRA_HOST = {"bandwidth": 1e10, "latency": 1e-5}   # 10 GB/s (80 Gbit/s), 10 us
DEFAULT_INTER_HOST = {"bandwidth": 1.25e9, "latency": 5e-5}  # 1.25 GB/s (10 Gbit/s), 50 us


class ClusterDefaultWarning(UserWarning):
    """A value the cluster YAML left out and that changes the plan was filled with its default."""


class Link(StrictModel):
    """A link: bandwidth (bytes/s) and latency (s)."""

    bandwidth: float = Field(gt=0, allow_inf_nan=False)
    latency: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    @field_validator("bandwidth", mode="before")
    @classmethod
    def _bw(cls, v: Any) -> float:
        return parse_quantity(v, "bandwidth")

    @field_validator("latency", mode="before")
    @classmethod
    def _lat(cls, v: Any) -> float:
        return parse_quantity(v, "latency")


class PairLink(Link):
    a: str
    b: str


class Links(StrictModel):
    intra_host: Link = Field(default_factory=lambda: Link(**DEFAULT_INTRA_HOST))
    inter_host: Link = Field(default_factory=lambda: Link(**DEFAULT_INTER_HOST))
    pairs: List[PairLink] = Field(default_factory=list)


def _memory(v: Any) -> Optional[float]:
    return None if v is None else parse_quantity(v, "memory")


class Device(StrictModel):
    name: str
    host: str
    throughput: float = Field(default=DEFAULT_THROUGHPUT, gt=0, allow_inf_nan=False)
    memory: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)  # None: unlimited
    _mem = field_validator("memory", mode="before")(_memory)


class HostGroup(StrictModel):
    name: str
    devices: int = Field(gt=0)
    throughput: float = Field(default=DEFAULT_THROUGHPUT, gt=0, allow_inf_nan=False)
    memory: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    _mem = field_validator("memory", mode="before")(_memory)


class ClusterSpec(StrictModel):
    """The YAML schema (validated; errors name the key path)."""

    devices: List[Device] = Field(default_factory=list)
    hosts: List[HostGroup] = Field(default_factory=list)
    links: Links = Field(default_factory=Links)
    reference_throughput: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    events: Optional[List[Any]] = None  # validated by the emulator (pdv_ext.emulate.events), not here

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        names = [d.name for d in self.all_devices()]
        if not names:
            raise ValueError("the cluster needs at least one device (under 'devices' or 'hosts')")
        dup = sorted(n for n, k in Counter(names).items() if k > 1)  # linear: host groups can be large
        if dup:
            raise ValueError(f"device names must be unique (repeated: {', '.join(dup)})")
        known = set(names)
        for i, p in enumerate(self.links.pairs):
            for end in (p.a, p.b):
                if end not in known:
                    raise ValueError(f"links.pairs.{i}: unknown device '{end}'")
        return self

    def defaults_used(self) -> List[str]:
        """One line per default that changes the plan: throughputs left out (one line for all of them),
        and a missing intra_host / inter_host link that some pair of devices uses."""
        lines = []
        missing = [f"devices.{i}.throughput" for i, d in enumerate(self.devices) if "throughput" not in d.model_fields_set]
        missing += [f"hosts.{i}.throughput" for i, h in enumerate(self.hosts) if "throughput" not in h.model_fields_set]
        if missing:
            keys = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            lines.append(f"{keys}: not given, {DEFAULT_THROUGHPUT} assumed (speeds are relative to "
                         "reference_throughput, by default the fastest device)")
        devices = self.all_devices()
        per_host = Counter(d.host for d in devices)
        for key, used, link in (("intra_host", max(per_host.values()) > 1, DEFAULT_INTRA_HOST),
                                ("inter_host", len(per_host) > 1, DEFAULT_INTER_HOST)):
            if used and key not in self.links.model_fields_set:
                lines.append(f"links.{key}: not given, bandwidth {link['bandwidth']:.3g} B/s "
                             f"({link['bandwidth'] * 8 / 1e9:g} Gbit/s) and latency {link['latency'] * 1e6:g} us "
                             "assumed")
        return lines

    def all_devices(self) -> List[Device]:
        out = list(self.devices)
        for h in self.hosts:
            out += [Device(name=f"{h.name}/{i}", host=h.name, throughput=h.throughput, memory=h.memory)
                    for i in range(h.devices)]
        return out


class Cluster:
    """Devices in global-rank order, with link lookup and relative speeds."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.devices: List[Device] = spec.all_devices()
        self.hosts: List[str] = list(dict.fromkeys(d.host for d in self.devices))
        self._index = {d.name: i for i, d in enumerate(self.devices)}
        self._pairs: Dict[Tuple[int, int], Link] = {}
        for p in spec.links.pairs:
            a, b = self._index[p.a], self._index[p.b]
            self._pairs[(a, b)] = self._pairs[(b, a)] = Link(bandwidth=p.bandwidth, latency=p.latency)
        self.reference = spec.reference_throughput or max(d.throughput for d in self.devices)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "cluster") -> "Cluster":
        if not isinstance(data, dict):
            raise ConfigError([f"{source}: expected a mapping with 'devices'/'hosts' and 'links'"])
        try:
            spec = ClusterSpec.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc, ClusterSpec, source)) from exc
        for line in spec.defaults_used():
            warnings.warn(f"{source}: {line}", ClusterDefaultWarning, stacklevel=2)
        return cls(spec)

    @classmethod
    def load(cls, path: str) -> "Cluster":
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError([f"{path}: cannot read cluster YAML: {exc}"]) from exc
        return cls.from_dict(data, source=path)

    def to_dict(self) -> Dict[str, Any]:
        return self.spec.model_dump(exclude_none=True)

    def with_throughputs(self, throughputs: Sequence[float], source: str = "cluster") -> "Cluster":
        """The same cluster with every device's throughput replaced (in rank order): what a cluster looks like
        after a device slowed down or recovered. Events and the hosts shorthand are not carried. Speeds stay
        relative to this cluster's reference (the profile's device did not change because one slowed down:
        without it, a cluster whose fastest device slowed had every speed re-scaled to the new fastest)."""
        d = self.to_dict()
        d.pop("hosts", None)
        d.pop("events", None)
        d["devices"] = [{**dev.model_dump(exclude_none=True), "throughput": float(t)}
                        for dev, t in zip(self.devices, throughputs)]
        d["reference_throughput"] = self.reference
        return Cluster.from_dict(d, source=source)

    def subset(self, indices: Sequence[int], source: str = "cluster") -> "Cluster":
        """The cluster of the devices `indices` (in that order: the order of the ranks that run on them), its
        links unchanged: what is left after devices or hosts were lost."""
        d = self.to_dict()
        d.pop("hosts", None)
        d.pop("events", None)
        d["devices"] = [self.devices[i].model_dump(exclude_none=True) for i in indices]
        d["reference_throughput"] = self.reference  # speeds stay relative to the whole cluster's reference
        return Cluster.from_dict(d, source=source)

    def devices_named(self, names: Sequence[Optional[str]]) -> Optional[List[int]]:
        """Which listed device each rank runs on, by the device names the ranks report; None unless every
        rank names a distinct listed device."""
        index = {d.name: i for i, d in enumerate(self.devices)}
        if not names or any(n not in index for n in names) or len(set(names)) != len(names):
            return None
        return [index[n] for n in names]

    def devices_of(self, hosts: Sequence[str], local_ranks: Sequence[int]) -> Optional[List[int]]:
        """Which listed device each rank runs on, for ranks on `hosts` with `local_ranks` (rank r: the
        local_ranks[r]-th device listed for hosts[r]); None when a host is not in the cluster or has fewer
        devices listed than ranks on it."""
        by_host: Dict[str, List[int]] = {}
        for i, dev in enumerate(self.devices):
            by_host.setdefault(dev.host, []).append(i)
        out = []
        for host, lr in zip(hosts, local_ranks):
            listed = by_host.get(host, [])
            if not 0 <= lr < len(listed):
                return None
            out.append(listed[lr])
        return out if len(set(out)) == len(out) else None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    # -- queries ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.devices)

    def host_of(self, i: int) -> str:
        return self.devices[i].host

    def speed(self, i: int) -> float:
        """Throughput relative to the device the profile was measured on."""
        return self.devices[i].throughput / self.reference

    def memory(self, i: int) -> float:
        m = self.devices[i].memory
        return float("inf") if m is None else m

    def link(self, a: int, b: int) -> Link:
        if (a, b) in self._pairs:
            return self._pairs[(a, b)]
        if self.devices[a].host == self.devices[b].host:
            return self.spec.links.intra_host
        return self.spec.links.inter_host

    def p2p_time(self, a: int, b: int, nbytes: float) -> float:
        if a == b:
            return 0.0
        ln = self.link(a, b)
        return ln.latency + nbytes / ln.bandwidth


def synthetic_cluster(num_devices: int, per_host: int = 8, generations: Tuple[float, ...] = (1.0, 0.5),
                      memory: Optional[float] = None, intra: str = "100 GB/s", inter: str = "25 Gbit/s") -> Cluster:
    """Hosts of `per_host` devices; host h has throughput generations[h % len]. For benchmarks and tests."""
    hosts = []
    for h in range(max(1, num_devices // per_host)):
        hosts.append({"name": f"h{h}", "devices": min(per_host, num_devices - h * per_host),
                      "throughput": generations[h % len(generations)], "memory": memory})
    return Cluster.from_dict({"hosts": hosts, "links": {"intra_host": {"bandwidth": intra, "latency": "5us"},
                                                        "inter_host": {"bandwidth": inter, "latency": "20us"}}})


def reference_device(cluster: "Cluster") -> int:
    """The device whose speed the profile's seconds are in (what `pdv emulate` profiles on): the one whose
    YAML speed is closest to 1."""
    return min(range(len(cluster)), key=lambda i: abs(cluster.speed(i) - 1.0))
