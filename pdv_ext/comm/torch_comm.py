"""Comm over a torch.distributed process group (gloo on CPU, nccl on GPU) — what DeepSpeed uses."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .base import Comm, Message, parts

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchComm(Comm):
    """`TorchComm(group)`; `group=None` is the default (world) group."""

    backend = "torch"

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchComm needs torch.distributed initialised (init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self._global = [self._to_global(r) for r in range(self.size)]

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
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            return tensor.div_(self.size)
        dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        if self.size == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(tensor, src=self._global[src], group=self.group)
        return tensor

    def exchange(self, sends: Dict[int, Message], recvs: Dict[int, Message]) -> None:
        ops = []
        # post receives first, then sends, in peer order: deterministic and deadlock-free on gloo; the
        # parts of a list message go as separate messages, matched in order on the other side
        for peer in sorted(recvs):
            if peer != self.rank:
                ops += [dist.P2POp(dist.irecv, t, self._global[peer], self.group) for t in parts(recvs[peer])]
        for peer in sorted(sends):
            if peer != self.rank:
                ops += [dist.P2POp(dist.isend, t.contiguous(), self._global[peer], self.group)
                        for t in parts(sends[peer])]
        if self.rank in sends and self.rank in recvs:
            for dst, src in zip(parts(recvs[self.rank]), parts(sends[self.rank])):
                dst.copy_(src)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), self._global[dst], group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, self._global[src], group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
