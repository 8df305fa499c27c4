"""Comm over a torch.distributed process group (gloo on CPU, nccl on GPU) — what DeepSpeed uses.

On NCCL a TorchComm may carry a `host_group`: a gloo twin of its group (same members, same order) that
carries CPU tensors. Then the small host-made payloads (flags, metric scalars, pickled objects) travel on
the CPU and reading them back costs no device synchronisation; without it they must go through a GPU
(`payload_device`) and every read of one waits for the device to finish its queued work. `host_twin`
builds the twin; pdv's DeepSpeed integration and policy engine do so whenever the backend is NCCL.
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Comm, Message, parts

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

#: in-place recovery's signal that a peer is lost or a recovery began (`set_interrupt`): a collective on a
#: gloo group then waits in slices and gives up once it is set
_interrupt: Optional[threading.Event] = None
_SLICE = timedelta(seconds=0.25)


class InterruptedCollective(RuntimeError):
    """A collective given up because in-place recovery said a peer is lost (the words say so: recovery takes
    it for a lost peer, as it takes gloo's own errors)."""


def set_interrupt(event: Optional[threading.Event]) -> None:
    """Have this process's collectives on gloo groups give up when `event` is set (None: wait as the backend
    does). In-place recovery passes its heartbeat's `interrupted`: a collective that no closed connection
    ends (seen on the emulated cluster: a survivor's gradient all-reduce waiting on peers that had already
    left for the recovery, its connections all closed) then raises, and the rank joins the recovery."""
    global _interrupt
    _interrupt = event


def interrupted() -> bool:
    """Whether in-place recovery has said (`set_interrupt`) that a peer is lost or a recovery began: every wait
    of this process that may wait on a peer gives up then (a collective here, the snapshot in flight)."""
    ev = _interrupt
    return ev is not None and ev.is_set()


def _finish(work: Any, gloo: bool) -> None:
    """Wait for `work`: whole, or on gloo with an interrupt set, in slices that look at it. Not on NCCL: a
    wait with a timeout there blocks the host until the GPU is done."""
    if work is None:
        return
    ev = _interrupt
    if ev is None or not gloo:
        work.wait()
        return
    while True:
        try:
            work.wait(timeout=_SLICE)
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc):
                raise
        if ev.is_set():
            raise InterruptedCollective("pdv: a collective given up: a peer was lost (in-place recovery began)")


class TorchComm(Comm):
    """`TorchComm(group, host_group=None)`; `group=None` is the default (world) group. `host_group`, a gloo
    group with the same members in the same order (`host_twin`), carries every CPU tensor."""

    backend = "torch"

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 host_group: Optional[dist.ProcessGroup] = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchComm needs torch.distributed initialised (init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self._global = [self._to_global(r) for r in range(self.size)]
        self._p2p_ready = False
        self.host_group = host_group
        self._gloo: Dict[int, bool] = {}  # by id of the group: whether it is gloo (a collective's wait, `_wait`)
        if host_group is not None:
            twin = [dist.get_global_rank(host_group, r) if host_group is not dist.group.WORLD else r
                    for r in range(dist.get_world_size(host_group))]
            if twin != self._global:
                raise ValueError(f"host_group: its members (global ranks {twin}) must be the group's, in the "
                                 f"same order ({self._global})")

    @property
    def payload_device(self) -> torch.device:
        if self.host_group is None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _pg(self, *tensors: torch.Tensor) -> Optional[dist.ProcessGroup]:
        """The host group for CPU tensors (when there is one), the group otherwise."""
        return self._pg_for([t.device for t in tensors])

    def _pg_for(self, devices: List[torch.device]) -> Optional[dist.ProcessGroup]:
        if self.host_group is not None and devices and all(d.type == "cpu" for d in devices):
            return self.host_group
        return self.group

    def _wait(self, work: Any, pg: Optional[dist.ProcessGroup]) -> None:
        gloo = self._gloo.get(id(pg))
        if gloo is None:
            gloo = self._gloo[id(pg)] = dist.get_backend(pg) == "gloo"
        _finish(work, gloo)

    def _to_global(self, r: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of a member of this group."""
        return self._global[group_rank]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.size == 1:
            return tensor
        if op == "avg":
            pg = self._pg(tensor)
            self._wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg, async_op=True), pg)
            return tensor.div_(self.size)
        pg = self._pg(tensor)
        self._wait(dist.all_reduce(tensor, op=_OPS[op], group=pg, async_op=True), pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        if self.size == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        pg = self._pg(tensor)
        self._wait(dist.all_gather(out, tensor.contiguous(), group=pg, async_op=True), pg)
        return out

    def _gather_rows(self, out: torch.Tensor) -> None:
        """On gloo a ring of `exchange`s, each row received in place: gloo's all_gather stages every
        tensor through its own buffers (4 x 64 MB on 4 CPU ranks: 0.8-1.3 s, plus the stacking copy,
        against 0.26 s for the ring). Elsewhere (nccl) the backend's in-place all_gather_into_tensor."""
        if not out.is_contiguous():
            raise ValueError("all_gather_into: out must be contiguous")
        pg = self._pg(out)
        if dist.get_backend(pg) != "gloo":
            dist.all_gather_into_tensor(out.view(-1), out[self.rank].view(-1), group=pg)
            return
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        for step in range(1, self.size):  # pass on the row received in the previous step
            self.exchange({right: out[(self.rank - step + 1) % self.size]}, {left: out[(self.rank - step) % self.size]})

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            pg = self._pg(tensor)
            self._wait(dist.broadcast(tensor, src=self._global[src], group=pg, async_op=True), pg)
        return tensor

    def exchange(self, sends: Dict[int, Message], recvs: Dict[int, Message],
                 device: Optional[torch.device] = None) -> None:
        mine = [t for m in (sends, recvs) for msg in m.values() for t in parts(msg)]
        # the group the others use: by this rank's tensors, or, with none, by the caller's device hint
        pg = self._pg_for([t.device for t in mine] if mine else [torch.device(device)] if device is not None else [])
        if pg is self.group and not self._p2p_ready:
            self._ready_for_p2p()
        ops = []
        staged = []  # (caller's non-contiguous destination, contiguous buffer received into)
        # post receives first, then sends, in peer order: deterministic and deadlock-free on gloo; the
        # parts of a list message go as separate messages, matched in order on the other side
        for peer in sorted(recvs):
            if peer != self.rank:
                for t in parts(recvs[peer]):
                    if not t.is_contiguous():  # the backends receive into contiguous memory only
                        staged.append((t, torch.empty_like(t, memory_format=torch.contiguous_format)))
                        t = staged[-1][1]
                    ops.append(dist.P2POp(dist.irecv, t, self._global[peer], pg))
        for peer in sorted(sends):
            if peer != self.rank:
                ops += [dist.P2POp(dist.isend, t.contiguous(), self._global[peer], pg)
                        for t in parts(sends[peer])]
        if self.rank in sends and self.rank in recvs:
            for dst, src in zip(parts(recvs[self.rank]), parts(sends[self.rank])):
                dst.copy_(src)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                self._wait(req, pg)
        for dst, buf in staged:
            dst.copy_(buf)

    def _ready_for_p2p(self) -> None:
        """NCCL: with a lazily created communicator, the first `batch_isend_irecv` on a group must involve
        every rank, and an exchange may leave ranks idle (adasum's fold on a group that is not a power of
        two). So the first exchange on an NCCL group starts with one all-reduce of one element, which every
        rank makes (exchange is collective). Nothing on gloo."""
        self._p2p_ready = True
        if self.size > 1 and dist.get_backend(self.group) == "nccl":
            dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())), group=self.group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        pg = self._pg(tensor)
        self._wait(dist.isend(tensor.contiguous(), self._global[dst], group=pg), pg)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        pg = self._pg(buf)
        self._wait(dist.irecv(buf, self._global[src], group=pg), pg)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def barrier(self) -> None:
        if self.size > 1:
            self._wait(dist.barrier(group=self.group, async_op=True), self.group)


def world_comm() -> TorchComm:
    """A TorchComm over the world, with its gloo twin where the backend needs one (collective: every rank
    calls it at the same point)."""
    return TorchComm(host_group=host_twin([list(range(dist.get_world_size()))]))


def host_twin(rank_lists: Sequence[Sequence[int]], force: Optional[bool] = None) -> Optional[dist.ProcessGroup]:
    """A gloo group with the members of the list holding this rank, for `TorchComm(host_group=...)`; None
    where payloads need no twin (the default backend already carries CPU tensors, as gloo does).

    Collective over the world, like `dist.new_group`: every rank calls it with the same lists in the same
    order (one new group per list). `force` (default: env PDV_HOST_GROUPS=1/0, else "when NCCL") builds
    the twins whatever the backend: the tests exercise them on gloo."""
    if force is None:
        env = os.environ.get("PDV_HOST_GROUPS", "").strip().lower()
        force = True if env in ("1", "true", "yes") else False if env in ("0", "false", "no") else None
    if force is None:
        force = dist.get_backend() == "nccl"
    if not force:
        return None
    me, mine = dist.get_rank(), None
    for ranks in rank_lists:
        pg = dist.new_group(ranks=list(ranks), backend="gloo")
        if me in ranks:
            mine = pg
    return mine
