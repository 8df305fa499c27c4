"""The Comm protocol: the only way aggregators, policies and solvers talk to other ranks.

Every algorithm is written once against `Comm`; `TorchComm` (torch.distributed, used inside DeepSpeed)
and `HorovodComm` (horovod.torch) implement it. The primitive set is deliberately small and
*collective*: point-to-point traffic goes through `exchange`, which every rank of the group calls at the
same time with the tensors it sends to and receives from each peer. That maps onto batched isend/irecv in
torch.distributed and onto `alltoall` with splits in Horovod (which has no p2p).
Ranks in this API are always ranks *within the group* (0 .. size-1).
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

OPS = ("sum", "max", "min", "avg")

#: what `exchange` moves between two ranks: one tensor, or a list of tensors sent as one logical message
#: (so an algorithm can send pieces of several tensors without first copying them into one buffer)
Message = Union[torch.Tensor, Sequence[torch.Tensor]]


def parts(msg: Message) -> List[torch.Tensor]:
    """The tensors of a message, in order."""
    return [msg] if isinstance(msg, torch.Tensor) else list(msg)


class Comm:
    """Base class: subclasses implement the primitives; derived helpers come for free."""

    rank: int
    size: int
    #: a short name for logs and benchmarks ("torch", "horovod", "local")
    backend: str = "abstract"

    @property
    def payload_device(self) -> torch.device:
        """Where small host-made payloads (scalars, pickled objects) travel: the CPU, except on backends
        that reduce device tensors only (NCCL), where it is the current GPU."""
        return torch.device("cpu")

    # ---- primitives -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` in place across the group; returns it."""
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all ranks), indexed by group rank."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` in place with group rank `src`'s; returns it."""
        raise NotImplementedError

    def exchange(self, sends: Dict[int, Message], recvs: Dict[int, Message],
                 device: Optional[torch.device] = None) -> None:
        """Collective point-to-point: send `sends[peer]` to each peer and fill `recvs[peer]` from each.

        Every rank of the group must call it (with possibly empty dicts); the pattern must be
        symmetric in the sense that what rank a sends to b, b expects from a with the same size (for a
        list message: the same number of parts with the same sizes, in order). `device`: where the
        other ranks' tensors live, for a rank with nothing to send (a backend whose exchange is one
        collective, Horovod's alltoall, needs every rank's message on the same kind of device).
        """
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    # ---- plain point-to-point (torch only; algorithms use `exchange`) -----------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no unmatched send; use exchange()")

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no unmatched recv; use exchange()")

    # ---- derived helpers --------------------------------------------------------------------------
    def all_gather_into(self, out: torch.Tensor) -> torch.Tensor:
        """Fill the rows of `out` (shape `(size, ...)`) with every rank's row; `out[rank]` holds this
        rank's own on entry. An algorithm writes its row in place and gets the others straight into
        theirs: no list of tensors to stack (a 256 MB copy for 4 x 64 MB). Returns `out`."""
        if out.shape[0] != self.size:
            raise ValueError(f"all_gather_into: out has {out.shape[0]} rows, the group {self.size} ranks")
        if self.size > 1:
            self._gather_rows(out)
        return out

    def _gather_rows(self, out: torch.Tensor) -> None:
        """The transfer behind `all_gather_into` (shape checked, size > 1); backends may do it better."""
        for r, t in enumerate(self.all_gather(out[self.rank])):
            if r != self.rank:
                out[r].copy_(t)

    def all_gather_varsize(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        """All-gather 1-D tensors whose lengths differ between ranks."""
        flat = tensor.reshape(-1)
        n = torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device)
        sizes = [int(s.item()) for s in self.all_gather(n)]
        longest = max(sizes) if sizes else 0
        padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        return [t[:s] for t, s in zip(self.all_gather(padded), sizes)]

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every rank's picklable `obj`, by group rank."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.payload_device)
        return [pickle.loads(t.cpu().numpy().tobytes()) for t in self.all_gather_varsize(data)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Group rank `src`'s picklable `obj`, on every rank."""
        if self.size == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == src else b""
        dev = self.payload_device
        n = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        self.broadcast(n, src)
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(buf, src)
        return pickle.loads(buf.cpu().numpy().tobytes())

    def all_reduce_scalars(self, values: Sequence[float], op: str = "sum") -> List[float]:
        """All-reduce a few Python floats in one float64 message."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.payload_device)
        self.all_reduce(t, op)
        return t.tolist()


class LocalComm(Comm):
    """A group of one (no distributed run): every collective is the identity. Handy for tests and tools."""

    backend = "local"

    def __init__(self) -> None:
        self.rank, self.size = 0, 1

    def all_reduce(self, tensor, op="sum"):
        return tensor

    def all_gather(self, tensor):
        return [tensor.clone()]

    def broadcast(self, tensor, src=0):
        return tensor

    def exchange(self, sends, recvs, device=None):
        if sends or recvs:
            raise ValueError("LocalComm has no peers to exchange with")

    def barrier(self):
        return None
