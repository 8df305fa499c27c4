"""What each event of a timeline changes on the emulated cluster, worked out before anything runs.

`Weather(spec, cores)` is the cluster as the emulation starts it; `plan(events)` walks the timeline in order
and returns one `Change` per event: the values before and after (logged), and the concrete settings to write
(a device's cores, directed pair rates and delays, host uplink rates). The dry run prints these, the event
player applies them, so both see the same numbers; a value the kernel cannot hold is an error here, before
any namespace, cgroup or rank exists.

A device's new quota is its new throughput times the cores per unit of throughput the emulation gave it at
start (`cores[i] / speed[i]`), so a device at a third of its start throughput gets a third of its start quota.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config_base import ConfigError
from . import cgroup
from .events import DeviceEvent, Event, HostEvent, LinkEvent, PairEvent
from .netns import uplink_bandwidth
from .spec import EmuSpec

MIN_RATE = 1000.0  # bytes/s: the network's smallest rate (8 kbit/s, netns._rate)


@dataclass
class Change:
    index: int  # position in the timeline
    event: Event
    before: Dict[str, Any]  # throughput and cores, or bandwidth (bytes/s) and latency (s)
    after: Dict[str, Any]
    text: str  # "device slow0 throughput 1 -> 0.33 (0.275 -> 0.091 cores)"
    cores: Optional[Tuple[int, float]] = None  # (device, cores)
    rates: List[Tuple[int, int, float]] = field(default_factory=list)  # (from device, to device, bytes/s)
    delays: List[Tuple[int, int, float]] = field(default_factory=list)  # (from device, to device, seconds)
    uplinks: List[Tuple[int, int, float]] = field(default_factory=list)  # (from host, to host, bytes/s)
    down: List[int] = field(default_factory=list)  # devices that stop (every process on them killed)
    up: List[int] = field(default_factory=list)  # devices that come back (a new agent each)
    hosts_down: List[int] = field(default_factory=list)  # hosts lost: uplink down, memory wiped
    hosts_up: List[int] = field(default_factory=list)  # hosts back: uplink up (memory empty)

    @property
    def kind(self) -> str:
        return self.event.kind

    @property
    def target(self) -> str:
        return self.event.target


def mbit(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 8 / 1e6:.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:g}"


class Weather:
    """The emulated cluster's live settings: per device throughput and cores, per directed pair bandwidth and
    latency, per link class its last value, per ordered host pair its uplink rate."""

    def __init__(self, spec: EmuSpec, cores: Sequence[float]):
        self.spec = spec
        self.names = [d.name for d in spec.devices]
        self.scale = [c / d.speed for c, d in zip(cores, spec.devices)]  # cores per unit of throughput
        self.throughput = [d.speed for d in spec.devices]
        self.cores = list(cores)
        self.bandwidth = copy.deepcopy(spec.bandwidth)
        self.latency = copy.deepcopy(spec.latency)
        self.links = dict(spec.links)
        hosts = len(spec.hosts)
        self.uplinks = {(k, q): uplink_bandwidth(spec, spec.bandwidth, k, q)
                        for k in range(hosts) for q in range(hosts) if k != q}

    # -- one event --------------------------------------------------------------------------------------
    def change(self, index: int, event: Event) -> Change:
        """What `event` changes from the current state (the state itself is not touched: see `commit`).
        ValueError when the result is outside what the kernel can hold."""
        if isinstance(event, (DeviceEvent, HostEvent)) and event.fault:
            return self._fault(index, event)
        if isinstance(event, DeviceEvent):
            return self._device(index, event)
        if isinstance(event, PairEvent):
            a, b = self.names.index(event.pair.a), self.names.index(event.pair.b)
            before = {"bandwidth": self.bandwidth[a][b], "latency": self.latency[a][b]}
            return self._pairs(index, event, [(a, b), (b, a)], before, f"pair {event.target}")
        if isinstance(event, LinkEvent):
            same = event.link == "intra_host"
            n = len(self.names)
            pairs = [(i, j) for i in range(n) for j in range(n)
                     if i != j and (self.spec.host_index(i) == self.spec.host_index(j)) == same]
            i, j = pairs[0]
            bw, lat = self.links.get(event.link, (self.bandwidth[i][j], self.latency[i][j]))
            before: Dict[str, Any] = {"bandwidth": bw, "latency": lat}
            # pairs of the class that an override or a pair event had set apart; the class event sets them too
            keys = ["bandwidth"] + (["latency"] if event.latency is not None else [])
            was = {"bandwidth": self.bandwidth, "latency": self.latency}
            apart = {f"{self.names[i]}<->{self.names[j]}": {k: was[k][i][j] for k in keys}
                     for i, j in pairs if i < j and any(was[k][i][j] != before[k] for k in keys)}
            if apart:
                before["pairs"] = apart
            return self._pairs(index, event, pairs, before, f"link {event.link}")
        raise TypeError(f"not an event: {event!r}")

    def _fault(self, index: int, e: Any) -> Change:
        """A device or a host stopping or coming back (which devices; `check` ruled out nonsense orders)."""
        if isinstance(e, HostEvent):
            devs = [i for i, d in enumerate(self.spec.devices) if d.host == e.host]
            hosts = [self.spec.hosts.index(e.host)]
            what = f"host {e.host} ({', '.join(self.names[i] for i in devs)})"
        else:
            devs, hosts, what = [self.names.index(e.device)], [], f"device {e.device}"
        text = f"{what} " + ("down: its processes killed" + (", its memory wiped, its uplink down" if hosts else "")
                             if e.down else "back: a new agent joins the job")
        before, after = {"down": not e.down}, {"down": e.down}
        if e.down:
            return Change(index, e, before, after, text, down=devs, hosts_down=hosts)
        return Change(index, e, before, after, text, up=devs, hosts_up=hosts)

    def _device(self, index: int, e: DeviceEvent) -> Change:
        i = self.names.index(e.device)
        cores = round(e.throughput * self.scale[i], 6)
        if cores < cgroup.MIN_CORES:
            raise ValueError(f"{e.origin}.throughput: {e.throughput:g} gives {e.device} {cores:.6f} cores "
                             f"({self.scale[i]:.4f} cores per unit of throughput at start), below the smallest CPU "
                             f"quota ({cgroup.MIN_CORES} of a core)")
        before = {"throughput": self.throughput[i], "cores": self.cores[i]}
        after = {"throughput": e.throughput, "cores": cores}
        text = (f"device {e.device} throughput {self.throughput[i]:g} -> {e.throughput:g} "
                f"({self.cores[i]:.3f} -> {cores:.3f} cores)")
        return Change(index, e, before, after, text, cores=(i, cores))

    def _pairs(self, index: int, e, pairs: List[Tuple[int, int]], before: Dict[str, Any], what: str) -> Change:
        if e.bandwidth < MIN_RATE:
            raise ValueError(f"{e.origin}.bandwidth: {e.bandwidth * 8:g} bit/s is below the emulated network's "
                             f"smallest rate ({MIN_RATE * 8 / 1e3:g} kbit/s)")
        latency = before["latency"] if e.latency is None else e.latency
        after = {"bandwidth": e.bandwidth, "latency": latency}
        rates = [(i, j, e.bandwidth) for i, j in pairs if self.bandwidth[i][j] != e.bandwidth]
        delays = [] if e.latency is None else [(i, j, latency) for i, j in pairs if self.latency[i][j] != latency]
        bw = [row[:] for row in self.bandwidth]
        for i, j in pairs:
            bw[i][j] = e.bandwidth
        hosts = {(self.spec.host_index(i), self.spec.host_index(j)) for i, j in pairs}
        uplinks = []
        for k, q in sorted(hosts):
            if k != q:
                new = uplink_bandwidth(self.spec, bw, k, q)
                if new != self.uplinks[(k, q)]:
                    uplinks.append((k, q, new))
        text = f"{what} bandwidth {mbit(before['bandwidth'])} -> {mbit(e.bandwidth)} Mbit/s"
        if e.latency is not None:
            text += f", latency {ms(before['latency'])} -> {ms(latency)} ms"
        ups = f"{len(uplinks)} host uplink{'s' if len(uplinks) != 1 else ''}"
        if isinstance(e, LinkEvent):
            n = len(pairs) // 2
            text += f" ({n} pair{'s' if n != 1 else ''}" + (f", {ups})" if uplinks else ")")
            if before.get("pairs"):
                text += "; before it " + ", ".join(
                    f"{name} was at {mbit(v['bandwidth'])} Mbit/s"
                    + (f", {ms(v['latency'])} ms" if "latency" in v else "") for name, v in before["pairs"].items())
        elif uplinks:
            text += f" (and {ups})"
        return Change(index, e, before, after, text, rates=rates, delays=delays, uplinks=uplinks)

    def commit(self, c: Change) -> None:
        """The state after `c` has been applied."""
        if c.cores is not None:
            i, cores = c.cores
            self.cores[i] = cores
            self.throughput[i] = c.after["throughput"]
        for i, j, bw in c.rates:
            self.bandwidth[i][j] = bw
        for i, j, lat in c.delays:
            self.latency[i][j] = lat
        for k, q, bw in c.uplinks:
            self.uplinks[(k, q)] = bw
        if isinstance(c.event, LinkEvent):
            self.links[c.event.link] = (c.after["bandwidth"], c.after["latency"])

    # -- a whole timeline -------------------------------------------------------------------------------
    def plan(self, events: Sequence[Event]) -> List[Change]:
        """Every event's change in timeline order, from a copy of this state; ConfigError listing every event
        the kernel could not hold."""
        state = copy.deepcopy(self)
        out, errors = [], []
        for index, event in enumerate(events):
            try:
                c = state.change(index, event)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            state.commit(c)
            out.append(c)
        if errors:
            raise ConfigError(errors)
        return out
