"""Run one process per emulated device and remove everything the run made, whatever happens.

`Emulation(spec, command).run()` builds the network (`netns.Network`) and CPU groups (`cgroup.CpuGroups`),
starts each rank as `ip netns exec <device ns> <command>` inside its CPU group with the environment a
launcher gives, prefixes each output line with `[rank i]`, and returns the first failing rank's exit code.
All resources carry the run's unique name `pdv-<id>`, so tear-down (in `finally`) removes exactly them.
With `events=` a timeline (events.py) is worked out at construction (weather.py: a bad event is an error
before anything exists) and played on this run's cgroups and classes while the ranks run (player.py); the
player is stopped before tear-down, and an event that cannot be applied stops the run (`EventError`).
A timeline placed by training step (`at_step`; `at_fraction` needs `total_steps`) gets a step file whose path
the ranks find in `PDV_EVENTS_STEP` (rank 0 writes its finished steps there through `events.mark_step`).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import BinaryIO, Dict, List, Optional, Sequence

from ..emulated_device import ENTER_ENV as DEVICE_ENTER
from ..emulated_device import ENV as DEVICE_CGROUP
from ..emulated_device import STACKS_SIGNAL as DUMP_SIGNAL
from ..recovery.keeper import CGROUP_ENV as KEEPER_CGROUP
from ..spawn import default_env, kill_group
from . import cgroup, netns
from . import elastic as el
from .events import CLOCKS, MARK_ENV, STEP_ENV, Event, by_step, faults, resolve_steps, timeline
from .events import check as check_events
from .player import EventError, EventPlayer
from .spec import EmuSpec, device_ip
from .weather import Change, Weather

MASTER_PORT = 29500
TIMEOUT_EXIT = 124


class EmulationUnavailable(RuntimeError):
    """Not root, or no netns / tc / cgroup CPU controller: the caller prints one line and exits 2."""


def check_available() -> tuple:
    """Raise EmulationUnavailable with the reason; returns the detected cgroup (version, root)."""
    if os.geteuid() != 0:
        raise EmulationUnavailable("needs root (network namespaces, tc and cgroups); run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"needs the `{tool}` command (iproute2)")
    if not os.path.exists("/proc/self/ns/net"):
        raise EmulationUnavailable("this kernel has no network namespaces")
    det = cgroup.detect()
    if det is None:
        raise EmulationUnavailable("no cgroup CPU controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us)")
    return det


def new_run_name() -> str:
    return f"pdv-{secrets.token_hex(3)}"


#: share of the machine's cores all devices' quotas add up to by default: with 0.8 the fastest devices got
#: 10% less than their quota while the others ran (gloo threads, the kernel and the VM take the rest)
DEFAULT_BUDGET = 0.55


def default_cpu_budget() -> float:
    """The cores the emulated devices share unless a run says otherwise: DEFAULT_BUDGET of this machine's."""
    return DEFAULT_BUDGET * (os.cpu_count() or 1)


class Emulation:
    def __init__(self, spec: EmuSpec, command: Sequence[str], timeout: Optional[float] = None,
                 cpu_budget: Optional[float] = None, top_share: Optional[float] = None,
                 run_name: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                 out: Optional[BinaryIO] = None, grace: float = 2.0, log=None,
                 events: Optional[Sequence[Event]] = None, events_log: Optional[str] = None,
                 events_clock: str = "launch", total_steps: Optional[int] = None, elastic: Optional[bool] = None,
                 startup_on_host: bool = False):
        self.spec = spec
        #: workers start on their host's CPU and enter their device's quota at `pdv_ext.initialize`
        self.startup_on_host = bool(startup_on_host)
        self.command = list(command)
        self.timeout = timeout
        budget = cpu_budget if cpu_budget is not None else default_cpu_budget()
        self.cores = cgroup.shares([d.speed for d in spec.devices], budget, top_share)
        self.name = run_name or new_run_name()
        self.env = env or {}
        self.out = out or sys.stdout.buffer
        self.grace = grace
        self.log = log or (lambda msg: print(f"pdv emulate: {msg}", file=sys.stderr, flush=True))
        self.net: Optional[netns.Network] = None
        self.groups: Optional[cgroup.CpuGroups] = None
        self.procs: List[subprocess.Popen] = []
        self._lock = threading.Lock()
        self.failed_rank: Optional[int] = None
        # the timeline, checked and worked out now: a bad event is an error before anything exists
        if events_clock not in CLOCKS:
            raise ValueError(f"events clock must be one of {', '.join(CLOCKS)} (got {events_clock!r})")
        self.events: List[Event] = timeline(resolve_steps(events or [], total_steps))
        self.by_step = by_step(self.events)
        check_events(self.events, spec)
        self.changes: List[Change] = Weather(spec, self.cores).plan(self.events)
        # faults need elastic supervision (elastic.py): torchrun's agents, one per device
        self.elastic = faults(self.events) if elastic is None else bool(elastic)
        if self.elastic and len(spec.hosts) > 255:
            raise ValueError(f"{len(spec.hosts)} hosts: an elastic run needs the address of the 256th host for its "
                             "rendezvous store (at most 255 hosts)")
        self.agents: Dict[int, subprocess.Popen] = {}  # elastic: each device's current agent
        self.stopped: set = set()  # elastic: devices down (their agents were killed by an event)
        self.returned: set = set()  # elastic: devices whose agent an event started again
        self.forgiven: set = set()  # ... of which the agent came back after the job had ended
        self._late: Dict[int, float] = {}
        self._store: Optional[subprocess.Popen] = None
        if events_log is not None and not os.path.isdir(os.path.dirname(os.path.abspath(events_log))):
            raise ValueError(f"events log {events_log}: directory {os.path.dirname(os.path.abspath(events_log))} "
                             "does not exist")
        self.events_log = events_log
        self.events_clock = events_clock
        self.player: Optional[EventPlayer] = None
        self._mark_dir: Optional[str] = None

    # -------------------------------------------------------------------------------------------------
    def rank_env(self, i: int) -> Dict[str, str]:
        spec = self.spec
        d = spec.devices[i]
        return {**os.environ, **default_env(), **self.env,
                "RANK": str(i), "WORLD_SIZE": str(len(spec.devices)), "LOCAL_RANK": str(spec.local_rank(i)),
                "LOCAL_WORLD_SIZE": str(spec.local_size(i)), "MASTER_ADDR": device_ip(spec, 0),
                "MASTER_PORT": str(MASTER_PORT), "PDV_DEVICE_NAME": d.name, "PDV_HOST": d.host,
                "PDV_DEVICE_CORES": f"{self.cores[i]:.4f}", "PDV_EMULATION": self.name,
                **({KEEPER_CGROUP: self.groups.host_procs(d.host),
                    DEVICE_CGROUP: self.groups.paths[i]} if self.groups is not None else {}),
                **({DEVICE_ENTER: self.groups.procs_file(i)}
                   if self.groups is not None and self.startup_on_host else {}),
                "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1", **({MARK_ENV: self.mark_path} if self.mark_path else {}),
                **({STEP_ENV: self.step_path} if self.step_path else {})}

    @property
    def mark_path(self) -> Optional[str]:
        """The file `events.mark_start()` creates in a rank (the `mark` clock), or None."""
        return os.path.join(self._mark_dir, "mark") if self._mark_dir and self.events_clock == "mark" else None

    @property
    def step_path(self) -> Optional[str]:
        """The file `events.mark_step()` writes rank 0's finished steps to (a step timeline), or None."""
        return os.path.join(self._mark_dir, "step") if self._mark_dir and self.by_step else None

    def host_memory(self, host: str) -> str:
        """An elastic run's host memory (PDV_HOST_MEMORY): wiped when the host is lost."""
        return os.path.join(el.memory_root(self.name), host)

    def setup(self) -> None:
        _claim(self.name)  # `pdv emulate --cleanup` leaves a run alone while its owner lives
        self.net = netns.Network(self.spec, self.name)
        self.net.create()
        if self.elastic:
            self.net.add_store_host(el.STORE_IP)
        if not self.net.netem:
            self.log("kernel has no sch_netem: link latencies are not emulated (bandwidths are)")
        self.groups = cgroup.CpuGroups(self.name, self.cores)
        self.groups.create()
        if self.changes or self.events_log:
            if self.events_clock == "mark" or self.by_step:
                self._mark_dir = tempfile.mkdtemp(prefix=f"{self.name}-mark-")
            self.player = EventPlayer(self.changes, self._apply, self.events_clock, self.mark_path,
                                      self.events_log, log=self.log, step_path=self.step_path)

    def _apply(self, c: Change) -> List[str]:
        """One change on this run's own cgroups and classes (the player's thread)."""
        notes = []
        if c.cores is not None:
            self.groups.set_cores(*c.cores)
        for i, j, bw in c.rates:
            self.net.set_rate(i, j, bw)
        for k, q, bw in c.uplinks:
            self.net.set_uplink_rate(k, q, bw)
        if c.delays and not all(self.net.set_delay(i, j, d) for i, j, d in c.delays):
            notes.append("latency not emulated (the kernel has no sch_netem)")
        for i in c.down:  # a device stops: everything on it dies at once, its agent and its worker
            with self._lock:
                self.stopped.add(i)
                agent = self.agents.get(i)
            if agent is not None:
                kill_group(agent)
            self.groups.kill(i)
        for k in c.hosts_down:  # ... and a lost host's processes, memory and links with it
            self.groups.kill_host(self.spec.hosts[k])
            shutil.rmtree(self.host_memory(self.spec.hosts[k]), ignore_errors=True)
            self.net.set_host_link(k, False)
        for k in c.hosts_up:
            self.net.set_host_link(k, True)
        for i in c.up:
            with self._lock:
                self.stopped.discard(i)
                self.returned.add(i)
                self._start_agent(i)
        return notes

    def first_group(self, i: int) -> str:
        """The `cgroup.procs` file device i's worker starts in: the device's, or with `startup_on_host` its
        start-up group (no quota), left for the device's at `pdv_ext.initialize` (emulated_device.py)."""
        return self.groups.start_procs(i) if self.startup_on_host else self.groups.procs_file(i)

    def _start_agent(self, i: int) -> None:
        """Device i's torchrun agent (elastic runs) in its namespace; its worker in the device's CPU group."""
        spec = self.spec
        restarts = 3 + sum(len(c.down) for c in self.changes)  # every membership change restarts the workers
        cmd = el.agent_command(self.command, el.fewest_left(len(spec.devices), self.changes), len(spec.devices),
                               device_ip(spec, i), self.name, restarts, self.first_group(i))
        mem = self.host_memory(spec.devices[i].host)
        os.makedirs(mem, exist_ok=True)
        # nsenter, not `ip netns exec`: that one remounts /sys for the namespace, where the worker could no
        # longer reach its CPU group's file
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.net.dev_ns[i]}", *cmd],
                             env=el.agent_env(self.rank_env(i), mem), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.agents[i] = p
        self.procs.append(p)
        threading.Thread(target=self._pump, args=(f"[{spec.devices[i].name}] ", p.stdout), daemon=True).start()

    def launch(self) -> None:
        if self.elastic:
            self._store = subprocess.Popen(["ip", "netns", "exec", self.net.store_ns, *el.store_command()],
                                           env={**os.environ, **default_env()}, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(self._store)
            threading.Thread(target=self._pump, args=("[store] ", self._store.stdout), daemon=True).start()
            for i in range(len(self.spec.devices)):
                self._start_agent(i)
            if self.player is not None:
                self.player.start(time.monotonic())
            return
        for i in range(len(self.spec.devices)):
            # nsenter, not `ip netns exec`: that one remounts /sys for the namespace, where the rank could no
            # longer read its CPU group (its device clock, emulated_device.py) nor enter it (--startup-on-host)
            wrapper = ["sh", "-c", 'echo $$ > "$0" && ns="$1" && shift && exec nsenter --net="/run/netns/$ns" "$@"',
                       self.first_group(i), self.net.dev_ns[i], *self.command]
            p = subprocess.Popen(wrapper, env=self.rank_env(i), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(p)
            threading.Thread(target=self._pump, args=(f"[rank {i}] ", p.stdout), daemon=True).start()
        if self.player is not None:
            self.player.start(time.monotonic())

    def _pump(self, label: str, stream) -> None:
        prefix = label.encode()
        for line in iter(stream.readline, b""):
            with self._lock:
                try:
                    self.out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    self.out.flush()
                except (ValueError, OSError):
                    pass
        stream.close()

    def _live_agents(self) -> Dict[int, Optional[int]]:
        """Elastic runs: each device's agent's exit code (None: running), agents killed by a fault left out.
        An agent that came back after the job ended finds the rendezvous closed (as on a real cluster): once
        every agent that stayed has ended well it counts as 0, and for `grace` seconds it counts as running."""
        with self._lock:
            live = {i: p.poll() for i, p in self.agents.items() if i not in self.stopped}
        stayed = [c for j, c in live.items() if j not in self.returned]
        job_over = bool(stayed) and all(c == 0 for c in stayed)
        for i, c in live.items():
            if c not in (None, 0) and i in self.returned and i not in self.forgiven:
                since = self._late.setdefault(i, time.monotonic())
                if job_over:
                    self.forgiven.add(i)
                    self.log(f"{self.spec.devices[i].name} came back after the job had ended (exit {c}: its "
                             "rendezvous was closed); not counted")
                elif time.monotonic() - since < self.grace:
                    live[i] = None  # wait a little for the others to end
        return {i: (0 if i in self.forgiven else c) for i, c in live.items()}

    def wait(self) -> int:
        """Until every rank (elastic: every agent not killed by a fault) has ended; the first that fails stops
        the others after `grace`. Returns 0, the first failure's code, or 124 on timeout."""
        if self.elastic:
            poll, what = self._live_agents, (lambda i: f"the agent of {self.spec.devices[i].name}")
        else:
            poll, what = (lambda: dict(enumerate(p.poll() for p in self.procs))), (lambda i: f"rank {i}")
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        first: Optional[tuple] = None  # (rank or device, code)
        while True:
            if self.player is not None and self.player.error:
                self.log("stopping the run: an event could not be applied")
                raise EventError(self.player.error)
            codes = poll()
            if first is None:
                for i, c in codes.items():
                    if c not in (None, 0):
                        first = (i, c)
                        self.log(f"{what(i)} exited with {c}; stopping the others in {self.grace:.0f}s")
                        deadline = min(deadline or float("inf"), time.monotonic() + self.grace)
                        break
            if all(c is not None for c in codes.values()):
                break
            if deadline is not None and time.monotonic() > deadline:
                if first is None:
                    self.log(f"timed out after {self.timeout:.0f}s")
                    self.dump_stacks()
                    return TIMEOUT_EXIT
                break
            time.sleep(0.05)
        if first is None:
            return 0
        self.failed_rank = first[0]
        code = first[1]
        return 128 - code if code < 0 else code

    def dump_stacks(self, wait_s: float = 2.0) -> int:
        """Have every rank still running print its threads' stacks (SIGUSR1, which a rank under the emulator
        takes for that: `emulated_device.dump_stacks_on_signal`), and give their lines `wait_s` to come
        through. Only processes that catch the signal get it (its default action ends a process). Returns how
        many were asked."""
        import psutil

        n = 0
        for p in self.procs:
            try:
                procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
            except psutil.Error:
                continue
            for q in procs:
                if catches(q.pid, DUMP_SIGNAL):
                    try:
                        os.kill(q.pid, DUMP_SIGNAL)
                        n += 1
                    except OSError:
                        pass
        if n:
            self.log(f"asked {n} rank process(es) for their stacks")
            time.sleep(wait_s)
        return n

    def cleanup(self) -> None:
        """Stop the event player, then remove processes, cgroups and namespaces of this run (safe to call more
        than once)."""
        errors = []
        if self.player is not None:
            self.player.stop()  # returns with no change in flight: nothing is written to what is removed next
        if self._mark_dir:
            shutil.rmtree(self._mark_dir, ignore_errors=True)
        if self.elastic:
            shutil.rmtree(el.memory_root(self.name), ignore_errors=True)
        for p in self.procs:
            kill_group(p)
        det = cgroup.detect()
        for step in (lambda: det and cgroup.remove_tree(os.path.join(det[1], self.name)),  # also if setup failed
                     lambda: netns.Network(self.spec, self.name).destroy()):
            try:
                step()
            except Exception as exc:  # keep going: remove as much as possible
                errors.append(str(exc))
        time.sleep(0.05)
        _release(self.name)
        if errors:
            self.log("cleanup problems: " + "; ".join(errors))

    def run(self) -> int:
        """Set up, run the ranks, tear down. SIGTERM/SIGHUP become SystemExit, SIGINT KeyboardInterrupt;
        both pass through the `finally` that removes everything. A signal that arrives while the run is set
        up and its processes started is held until they all are (it takes well under a second): raised in
        the middle of `Popen`, it would leave a started rank that the clean-up does not know of."""
        old = {}
        main = threading.current_thread() is threading.main_thread()
        if main:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                old[sig] = signal.signal(sig, _raise_exit)
        try:
            with _signals_held(main):
                self.setup()
                self.launch()
            return self.wait()
        finally:
            if old:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop the clean-up
                for sig in old:
                    signal.signal(sig, signal.SIG_IGN)
            try:
                self.cleanup()
            finally:
                if old:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    for sig, h in old.items():
                        signal.signal(sig, h)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_held(main: bool):
    """Hold SIGINT, SIGTERM and SIGHUP for the block and raise the first that came once it is done
    (KeyboardInterrupt / SystemExit(128 + signal), as outside it). A handler that records, not a blocked
    signal mask: the processes started inside would inherit the mask and ignore a later SIGTERM."""
    if not main:
        yield
        return
    came: List[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in sigs}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    if came:
        if came[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + came[0])


def _owner_file(run_name: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{run_name}.owner")


def _claim(run_name: str) -> None:
    """Record this process (pid and start time: a pid can be reused) as the run's owner."""
    import psutil

    me = psutil.Process()
    with open(_owner_file(run_name), "w", encoding="utf-8") as f:
        f.write(f"{me.pid} {me.create_time()}\n")


def _release(run_name: str) -> None:
    try:
        os.remove(_owner_file(run_name))
    except OSError:
        pass


def live_runs() -> Dict[str, int]:
    """Runs whose `pdv emulate` is still running: {run name: its pid}. Owner files of dead owners go."""
    import psutil

    tmp, out = tempfile.gettempdir(), {}
    for n in sorted(os.listdir(tmp)):
        if not (n.endswith(".owner") and netns.STALE_RE.match(n[:-len(".owner")] + "-")):
            continue
        run = n[:-len(".owner")]
        try:
            with open(os.path.join(tmp, n), encoding="utf-8") as f:
                pid, started = f.read().split()
            alive = abs(psutil.Process(int(pid)).create_time() - float(started)) < 1e-3
        except (OSError, ValueError, psutil.Error):
            alive = False
        if alive:
            out[run] = int(pid)
        else:
            _release(run)
    return out


def _run_of(name: str) -> str:
    return os.path.basename(name)[:len("pdv-123456")]


def cleanup_stale(log=print) -> int:
    """Remove namespaces, cgroups, mark-clock folders and host memory of earlier runs (named
    `pdv-<6 hex>-...`) whose `pdv emulate` is gone; a run still running is left alone (a clean-up started
    beside it, e.g. by a test, killed a running benchmark's ranks). Returns how many were removed."""
    live = live_runs()
    for run, pid in live.items():
        log(f"left {run} alone: its pdv emulate (pid {pid}) is running")
    names = [n for n in netns.stale_namespaces() if _run_of(n) not in live]
    netns.remove_namespaces(names)
    groups = [g for g in cgroup.stale() if netns.STALE_RE.match(os.path.basename(g) + "-") and _run_of(g) not in live]
    for g in groups:
        cgroup.remove_tree(g)
    tmp = tempfile.gettempdir()
    marks = [os.path.join(tmp, n) for n in sorted(os.listdir(tmp))
             if netns.STALE_RE.match(n) and "-mark-" in n and _run_of(n) not in live]
    mem = os.path.dirname(el.memory_root("pdv-000000"))  # elastic runs' host memory
    marks += [os.path.join(mem, n) for n in sorted(os.listdir(mem))
              if netns.STALE_RE.match(n) and n.endswith("-memory") and _run_of(n) not in live]
    for m in marks:
        shutil.rmtree(m, ignore_errors=True)
    for item in names + groups + marks:
        log(f"removed {item}")
    return len(names) + len(groups) + len(marks)
