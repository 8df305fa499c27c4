"""An in-process Comm over threads, so multi-rank aggregator logic is unit-testable without processes.

`run_threads(size, fn)` calls `fn(comm)` on `size` threads, each with its own `ThreadComm`; every
collective is a barrier-synchronised exchange through a shared hub. Reductions add in rank order, so all
ranks get bit-identical results (like gloo).
"""
import threading
from typing import Any, Callable, Dict, List

import torch

from pdv_ext.comm.base import Comm, parts


class _Hub:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: List[Any] = [None] * size
        self.mail: Dict[Any, torch.Tensor] = {}


class ThreadComm(Comm):
    backend = "thread"

    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.calls: Dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gather(self, t: torch.Tensor) -> List[torch.Tensor]:
        self.hub.slots[self.rank] = t.detach().clone()
        self.hub.barrier.wait()
        out = [s.clone() for s in self.hub.slots]
        self.hub.barrier.wait()
        return out

    def all_reduce(self, tensor, op="sum"):
        self._count("all_reduce")
        vals = self._gather(tensor)
        acc = vals[0].clone()
        for v in vals[1:]:
            acc = acc + v if op in ("sum", "avg") else (torch.maximum(acc, v) if op == "max" else torch.minimum(acc, v))
        if op == "avg":
            acc = acc / self.size
        return tensor.copy_(acc)

    def all_gather(self, tensor):
        self._count("all_gather")
        return self._gather(tensor)

    def broadcast(self, tensor, src=0):
        self._count("broadcast")
        return tensor.copy_(self._gather(tensor)[src])

    def exchange(self, sends, recvs, device=None):
        self._count("exchange")
        for peer, msg in sends.items():
            self.hub.mail[(self.rank, peer)] = [t.detach().clone() for t in parts(msg)]
        self.hub.barrier.wait()
        for peer, msg in recvs.items():
            got = self.hub.mail.pop((peer, self.rank))
            dsts = parts(msg)
            assert [d.numel() for d in dsts] == [g.numel() for g in got], "exchange: parts differ in size"
            for dst, src in zip(dsts, got):
                dst.copy_(src.view_as(dst))
        self.hub.barrier.wait()

    def barrier(self):
        self.hub.barrier.wait()


def run_threads(size: int, fn: Callable[[ThreadComm], Any]) -> List[Any]:
    """fn(comm) on `size` threads; returns the results by rank, re-raising the first exception."""
    hub = _Hub(size)
    results: List[Any] = [None] * size
    errors: List[BaseException] = []

    def work(r):
        try:
            results[r] = fn(ThreadComm(hub, r))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results
