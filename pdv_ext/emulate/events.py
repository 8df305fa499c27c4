"""The cluster's weather: a timeline of changes to a running emulation (a device slows down, a link congests).

Three kinds of event, each at a time after the timeline's zero (see `mark_start`) or at a training step::

    - {at: 40s, device: slow0, throughput: 0.33}             # the device's live CPU quota
    - {at: 60s, pair: {a: fast1, b: slow1}, bandwidth: 10 Mbit/s, latency: 5ms}   # both directions
    - {at: 90s, link: inter_host, bandwidth: 20 Mbit/s}       # every pair of that class (and host uplinks)
    - {at_step: 32, device: slow0, throughput: 0.33}          # once the job's 32nd step has finished
    - {at_fraction: 0.4, device: slow0, throughput: 0.33}     # at 40% of the run's steps (it declares them)

and faults, which run the job under torchrun's elastic agents (one per device, `launcher.Emulation`)::

    - {at_step: 30, host: hostB, down: true}      # every process of hostB's devices killed, its memory wiped
    - {at_step: 30, device: d3, down: true}       # one device stops
    - {at_step: 60, host: hostB, down: false}     # it comes back (empty) and joins the job again

`throughput` is relative, like the cluster YAML's; rates and latencies take the cluster YAML's units
(`placement.cluster.parse_quantity`); `at` is seconds or "500ms", "40s", "1.5min", "2h". When an event happens
is the base class's (`_Event`): exactly one of `at`, `at_step` or `at_fraction`, so every kind of event (a
later one too) is placed by time or by training progress alike. A timeline is either in seconds or by step,
not both (the order of a mix depends on the machine's speed). Events come from the cluster YAML's `events:`
list and from an events file (a list, or a mapping with an `events:` key whose other keys are ignored),
merged and sorted by `at` (or step). Every problem is one line naming the event's source, index and key,
raised before anything of a run exists; `check` validates the names against the emulated cluster.

This module is also imported by the ranks (`mark_start`, `mark_step`), so it stays light: no torch, no
emulator state.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, ClassVar, List, Literal, Optional, Sequence, Tuple, Union

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..config_base import ConfigError, StrictModel, format_errors
from ..placement.cluster import parse_quantity
from ..registry import did_you_mean
from .spec import EmuSpec

#: the file a rank creates to start the `mark` clock; the launcher exports its path to every rank
MARK_ENV = "PDV_EVENTS_MARK"
#: the file rank 0's `mark_step(n)` writes the number of finished training steps to (step events)
STEP_ENV = "PDV_EVENTS_STEP"
#: the keys that place an event: exactly one of them
WHEN_KEYS = ("at", "at_step", "at_fraction")
#: when the timeline's zero is: the ranks' start, or the first `mark_start()` call of any rank
CLOCKS = ("launch", "mark")
LINK_CLASSES = ("intra_host", "inter_host")

_TIME_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "min": 60.0, "h": 3600.0}


def parse_time(value: Any) -> float:
    """Seconds from a number or a string such as '500ms', '40s', '1.5min', '2h'."""
    unreadable = "cannot read a time: use seconds or a number with a unit (500ms, 40s, 1.5min, 2h)"
    if isinstance(value, bool):
        raise ValueError(unreadable)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-z]*)\s*", str(value))
        if not m or m.group(2) not in _TIME_UNITS:
            raise ValueError(unreadable)
        try:
            seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
        except ValueError:
            raise ValueError(unreadable) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("a time must be a finite number of seconds >= 0")
    return seconds


def _bandwidth(value: Any) -> float:
    return parse_quantity(value, "bandwidth")


def _latency(value: Any) -> Optional[float]:
    return None if value is None else parse_quantity(value, "latency")


def _relative(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a relative throughput such as 0.5")
    return value


def _whole_step(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a whole number of training steps >= 0")
    return value


def _share(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a share of the run's steps such as 0.4")
    return value


class _Event(StrictModel):
    """When an event happens, for every kind: `at` seconds after the timeline's zero, or `at_step: N` (once
    the job's step N has started, i.e. N steps finished, as rank 0 reports them through `mark_step`), or
    `at_fraction: F` (the step F x the run's declared steps, see `resolve_steps`). `parse_events` checks that
    exactly one is given."""

    at: Optional[float] = None
    at_step: Optional[int] = Field(default=None, ge=0)
    at_fraction: Optional[float] = Field(default=None, gt=0, lt=1, allow_inf_nan=False)
    kind: ClassVar[str] = ""
    _origin: str = PrivateAttr(default="event")  # "<file>: events[i]", for messages

    _at = field_validator("at", mode="before")(parse_time)
    _at_step = field_validator("at_step", mode="before")(_whole_step)
    _at_fraction = field_validator("at_fraction", mode="before")(_share)

    @property
    def origin(self) -> str:
        return self._origin

    @property
    def by_step(self) -> bool:
        """Placed by training progress (`at_step` or `at_fraction`) rather than in seconds."""
        return self.at is None

    @property
    def when(self) -> str:
        """'+40.0s', 'step 32', 'step 32 (0.4 of the run)' or '0.4 of the run' (steps not yet known)."""
        if self.at is not None:
            return f"+{self.at:.1f}s"
        share = f"{self.at_fraction:g} of the run" if self.at_fraction is not None else ""
        if self.at_step is None:
            return share
        return f"step {self.at_step}" + (f" ({share})" if share else "")

    @property
    def target(self) -> str:
        raise NotImplementedError


class DeviceEvent(_Event):
    """The device's live CPU quota becomes `throughput` x the cores per unit of throughput of the start; or,
    with `down: true`, the device stops: every process on it is killed (SIGKILL, no warning), and with
    `down: false` it comes back (a new torchrun agent joins the job)."""

    kind: ClassVar[str] = "device"
    device: str
    throughput: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    down: Optional[bool] = None
    _thr = field_validator("throughput", mode="before")(_relative)

    @model_validator(mode="after")
    def _one_change(self) -> "DeviceEvent":
        if (self.throughput is None) == (self.down is None):
            raise ValueError("a device event needs exactly one of 'throughput' (a slowdown) or 'down' (true: the "
                             "device stops, false: it comes back)")
        return self

    @property
    def target(self) -> str:
        return self.device

    @property
    def fault(self) -> bool:
        return self.down is not None


class HostEvent(_Event):
    """`down: true`: the host is lost - every process of its devices is killed at once, its memory (the
    folder the emulator gives it, `PDV_HOST_MEMORY`) is wiped and its uplink goes down; `down: false`: it
    comes back, empty, and its devices join the job again."""

    kind: ClassVar[str] = "host"
    host: str
    down: bool

    @property
    def target(self) -> str:
        return self.host

    @property
    def fault(self) -> bool:
        return True


class _RateEvent(_Event):
    bandwidth: float = Field(gt=0, allow_inf_nan=False)
    latency: Optional[float] = Field(default=None, ge=0, allow_inf_nan=False)  # None: unchanged

    _bw = field_validator("bandwidth", mode="before")(_bandwidth)
    _lat = field_validator("latency", mode="before")(_latency)


class PairEnds(StrictModel):
    a: str
    b: str


class PairEvent(_RateEvent):
    """One pair of devices, both directions (like the cluster YAML's `links.pairs`)."""

    kind: ClassVar[str] = "pair"
    pair: PairEnds

    @property
    def target(self) -> str:
        return f"{self.pair.a}<->{self.pair.b}"


class LinkEvent(_RateEvent):
    """Every pair of devices of that class (per-pair overrides included); inter_host also sets the hosts'
    shared uplinks, which the network shapes at the fastest of their pairs."""

    kind: ClassVar[str] = "link"
    link: Literal["intra_host", "inter_host"]

    @property
    def target(self) -> str:
        return self.link


Event = Union[DeviceEvent, PairEvent, LinkEvent, HostEvent]
_MODELS = {"device": DeviceEvent, "pair": PairEvent, "link": LinkEvent, "host": HostEvent}
_EXAMPLE = "{at: 40s, device: slow0, throughput: 0.33}"


def parse_events(items: Any, source: str) -> List[Event]:
    """Validate a list of raw events (from YAML/JSON); ConfigError with one line per bad event."""
    out, errors = _parse(items, source)
    if errors:
        raise ConfigError(errors)
    return out


def _parse(items: Any, source: str) -> Tuple[List[Event], List[str]]:
    """The valid events and one line per invalid one."""
    if items is None:
        return [], []
    if not isinstance(items, list):
        return [], [f"{source}: events: expected a list of events such as [{_EXAMPLE}] (got {items!r})"]
    out: List[Event] = []
    errors: List[str] = []
    for i, item in enumerate(items):
        where = f"{source}: events[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{where}: expected a mapping such as {_EXAMPLE} (got {item!r})")
            continue
        kinds = [k for k in _MODELS if k in item]
        if len(kinds) != 1:
            what = "has " + " and ".join(repr(k) for k in kinds) if kinds else f"has keys {sorted(map(str, item))}"
            errors.append(f"{where}: an event needs exactly one of 'device', 'pair', 'link' or 'host' ({what})")
            continue
        whens = [k for k in WHEN_KEYS if k in item]
        if len(whens) != 1:
            what = "has " + " and ".join(repr(k) for k in whens) if whens else "has none"
            errors.append(f"{where}: an event needs exactly one of 'at' (seconds), 'at_step' (a training step) or "
                          f"'at_fraction' (a share of the run's steps) ({what})")
            continue
        model = _MODELS[kinds[0]]
        try:
            event = model.model_validate(item)
        except ValidationError as exc:
            lines = format_errors(exc, model, where)
            # a misspelt key is one problem: its did-you-mean line says it, not also "required key is missing"
            meant = {m.group(1) for m in (re.search(r"did you mean '([^']+)'", x) for x in lines) if m}
            errors.extend(x for x in lines if not any(x == f"{where}.{k}: required key is missing" for k in meant))
            continue
        event._origin = where
        out.append(event)
    return out, errors


def read_events_file(path: str) -> List[Event]:
    """Events from a YAML/JSON file: a list of events, or a mapping with an `events:` list (a scenario file;
    its other keys belong to whoever else reads it)."""
    return parse_events(_events_in_file(path), path)


def _events_in_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError([f"{path}: cannot read events file: {exc}"]) from exc
    if isinstance(data, dict):
        if "events" not in data:
            raise ConfigError([f"{path}: no 'events' key (an events file is a list of events or a mapping with "
                               f"an 'events:' list; found keys {sorted(map(str, data))})"])
        return data["events"]
    if not isinstance(data, list):
        raise ConfigError([f"{path}: expected a list of events or a mapping with an 'events:' list "
                           f"(got {type(data).__name__})"])
    return data


def _order(e: Event) -> Tuple[float, float]:
    if e.at is not None:
        return (e.at, 0.0)
    if e.at_step is not None:
        return (float(e.at_step), 0.0)
    return (math.inf, e.at_fraction or 0.0)  # a share whose steps are not known yet: after, in share order


def timeline(events: Sequence[Event]) -> List[Event]:
    """The events sorted by `at`, or by step (stable: events at the same time keep their order, the cluster's
    first). ConfigError when seconds and steps are mixed."""
    errors = _clock_errors(events)
    if errors:
        raise ConfigError(errors)
    return sorted(events, key=_order)


def by_step(events: Sequence[Event]) -> bool:
    """Whether this (unmixed) timeline is placed by training step."""
    return bool(events) and events[0].by_step


def _clock_errors(events: Sequence[Event]) -> List[str]:
    """One line per event placed otherwise than the first one (seconds and steps cannot be ordered before
    the run: that order depends on the machine's speed)."""
    if not events:
        return []
    first = events[0]
    key = lambda e: "at" if e.at is not None else ("at_step" if e.at_fraction is None else "at_fraction")  # noqa: E731
    return [f"{e.origin}.{key(e)}: a timeline places every event in seconds ('at') or every event by training "
            f"step ('at_step'/'at_fraction'), not both ({first.origin} uses '{key(first)}')"
            for e in events[1:] if e.by_step != first.by_step]


def resolve_steps(events: Sequence[Event], total_steps: Optional[int]) -> List[Event]:
    """The events with each `at_fraction` turned into its `at_step` (round(F x total_steps), kept beside it);
    again from the share when called again with another total. ConfigError naming each share when the run's
    steps are not known."""
    if total_steps is not None and (isinstance(total_steps, bool) or int(total_steps) < 1):
        raise ValueError(f"the run's total steps must be >= 1 (got {total_steps!r})")
    out, errors = [], []
    for e in events:
        if e.at_fraction is None:
            out.append(e)
        elif total_steps is None:
            errors.append(f"{e.origin}.at_fraction: a share of the run needs the run's total steps (pdv emulate "
                          "--total-steps N; a bench scenario's run.steps); or use 'at_step'")
        else:
            out.append(e.model_copy(update={"at_step": int(math.floor(e.at_fraction * int(total_steps) + 0.5))}))
    if errors:
        raise ConfigError(errors)
    return out


def load_timeline(cluster_events: Optional[list], cluster_source: str, events_path: Optional[str] = None,
                  spec: Optional[EmuSpec] = None, total_steps: Optional[int] = None) -> List[Event]:
    """The cluster YAML's `events:` (`Cluster.spec.events`, raw) and an events file's, merged; with `spec`,
    also checked against the cluster (`check`); with `total_steps`, each `at_fraction` resolved to its step
    (`resolve_steps`; without it they stay shares, resolved when the run's steps are known). ConfigError
    listing every bad event of both sources."""
    events, errors = _parse(cluster_events, cluster_source)
    if events_path:
        try:
            more, more_errors = _parse(_events_in_file(events_path), events_path)
        except ConfigError as exc:
            more, more_errors = [], exc.errors
        events, errors = events + more, errors + more_errors
    if spec is not None:
        errors += _check(events, spec)
    errors += _clock_errors(events)
    if total_steps is not None and not errors:
        events = resolve_steps(events, total_steps)
    if errors:  # in the order of the files and of the events in them
        sources = [cluster_source, events_path]
        raise ConfigError(sorted(errors, key=lambda line: _place(line, sources)))
    return timeline(events)


def _place(line: str, sources: List[Optional[str]]) -> Tuple[int, int]:
    m = re.match(r"(.*?): events\[(\d+)\]", line)
    if not m:
        return (0, -1) if line.startswith(f"{sources[0]}:") else (1, -1)
    return (0 if m.group(1) == sources[0] else 1, int(m.group(2)))


def _known(names: List[str], bad: str) -> str:
    hint = did_you_mean(bad, names)
    shown = ", ".join(names[:16]) + (f", ... ({len(names)} devices)" if len(names) > 16 else "")
    return f"{hint}; known devices: {shown}" if hint else f"; known devices: {shown}"


def check(events: Sequence[Event], spec: EmuSpec) -> None:
    """ConfigError naming each event whose device, pair, link class or host the emulated cluster does not
    have, and each fault out of order (`fault_errors`)."""
    errors = _check(events, spec)
    if not errors:
        errors = fault_errors(events, spec)
    if errors:
        raise ConfigError(errors)


def _check(events: Sequence[Event], spec: EmuSpec) -> List[str]:
    names = [d.name for d in spec.devices]
    known = set(names)
    hosts = [d.host for d in spec.devices]
    errors: List[str] = []
    for e in events:
        if isinstance(e, DeviceEvent):
            if e.device not in known:
                errors.append(f"{e.origin}.device: unknown device '{e.device}'{_known(names, e.device)}")
        elif isinstance(e, HostEvent):
            if e.host not in hosts:
                listed = sorted(set(hosts))
                hint = did_you_mean(e.host, listed)
                errors.append(f"{e.origin}.host: unknown host '{e.host}'{hint}; known hosts: {', '.join(listed)}")
        elif isinstance(e, PairEvent):
            bad = [(end, n) for end, n in (("a", e.pair.a), ("b", e.pair.b)) if n not in known]
            for end, n in bad:
                errors.append(f"{e.origin}.pair.{end}: unknown device '{n}'{_known(names, n)}")
            if not bad and e.pair.a == e.pair.b:
                errors.append(f"{e.origin}.pair: a and b are the same device '{e.pair.a}' (a pair is two devices)")
        elif isinstance(e, LinkEvent):
            same_host = len(set(hosts)) < len(hosts)
            if e.link == "intra_host" and not same_host:
                errors.append(f"{e.origin}.link: no two devices of this cluster share a host, so no pair is "
                              "intra_host")
            if e.link == "inter_host" and len(set(hosts)) < 2:
                errors.append(f"{e.origin}.link: every device of this cluster is on host '{hosts[0]}', so no "
                              "pair is inter_host")
    return errors


def mark_start() -> None:
    """Start the `mark` clock: the events' times count from the first call of any rank (idempotent; a no-op
    outside `pdv emulate --events-clock mark`). A benchmark calls it when training starts, so events land at
    the same point of training in every run, however long start-up took."""
    path = os.environ.get(MARK_ENV)
    if not path:
        return
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))  # its mtime is the zero
    except FileExistsError:
        pass


_step_files: dict = {}  # STEP_ENV path -> the temporary name this process writes before renaming


def mark_step(step: int) -> None:
    """Report training progress: `step` training steps have finished (call it with 0 when training starts
    and with n after the n-th step). Events placed `at_step` (or `at_fraction`) are applied by the event player
    once the reported count reaches their step. Only rank 0's reports count (other ranks' calls, and any call
    outside `pdv emulate` with step events, are no-ops), so every rank may call it. Costs one small file
    write and a rename (atomic: the player never reads half a number), tens of microseconds."""
    path = os.environ.get(STEP_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return
    tmp = _step_files.get(path)
    if tmp is None:
        tmp = _step_files[path] = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            os.write(fd, b"%d\n" % int(step))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:  # the run is being torn down: progress no longer matters
        pass


def read_step(path: Optional[str]) -> Optional[int]:
    """The step count last reported through `mark_step` at `path` (None: none yet, or unreadable)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return int(f.read(64).strip())
    except (OSError, ValueError):
        return None


def faults(events: Sequence[Event]) -> bool:
    """Whether the timeline stops (or brings back) a device or host: the run then needs elastic supervision."""
    return any(getattr(e, "fault", False) for e in events)


def fault_errors(events: Sequence[Event], spec: EmuSpec) -> List[str]:
    """Faults that make no sense in order: a device or host brought down twice, or back when it was not down,
    or every device down at once (nothing left to train)."""
    down: set = set()
    errors: List[str] = []
    for e in events:
        if not getattr(e, "fault", False):
            continue
        devs = ([d.name for d in spec.devices if d.host == e.host] if isinstance(e, HostEvent) else [e.device])
        what = f"host '{e.host}'" if isinstance(e, HostEvent) else f"device '{e.device}'"
        if e.down and all(d in down for d in devs):
            errors.append(f"{e.origin}.down: {what} is already down at {e.when}")
        elif not e.down and not any(d in down for d in devs):
            errors.append(f"{e.origin}.down: {what} is not down at {e.when}, so it cannot come back")
        if e.down:
            down.update(devs)
        else:
            down.difference_update(devs)
        if len(down) == len(spec.devices):
            errors.append(f"{e.origin}: every device is down at {e.when}: nothing is left to train")
    return errors
