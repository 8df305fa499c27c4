"""Comm over horovod.torch collectives and process sets — what `pdv_ext.horovod` runs aggregators on.

Horovod matches collectives across ranks by *name*, so every call gets a deterministic name built from
the process set, the primitive and the tensor signature that all ranks share. Calls are synchronous, so
reusing a name for the next call of the same signature is safe, and Horovod's response cache hits on the
steady-state pattern of a training loop (the same layer sizes every step). The names carry no per-process
counter: after an elastic reset a fresh worker and a survivor still agree on them.

Horovod has no point-to-point messages: `exchange` is one `alltoall` with per-peer splits over the bytes
of the tensors (so peers may exchange tensors of mixed dtypes in one call).

Tensors of any layout and precision: Horovod 0.28 refuses non-contiguous tensors ("Tensor is required to
be contiguous") and bfloat16 in every collective ("Tensor type torch.BFloat16Tensor is not supported"),
before anything is sent. Here non-contiguous tensors travel as contiguous copies (results copied back),
bfloat16 is reduced in float32 (rounded once on the way back) and gathered or broadcast bit for bit as
int16; float16 is Horovod's own.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from .base import Comm, Message, parts


def _hvd():
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("HorovodComm needs Horovod with PyTorch support (pip install 'pdv_ext[horovod]')") from exc
    return hvd


def _flat_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-D, stride-1 view of `t`'s memory, or None when its elements are not one dense run. A tensor of
    at most one element counts as contiguous whatever its stride (a one-element piece of a matrix column
    has stride 9 and `view(torch.uint8)` refuses it): it is re-strided here."""
    if not t.is_contiguous():
        return None
    if t.numel() <= 1:
        return t.as_strided((t.numel(),), (1,))
    return t.view(-1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `t`'s elements (a copy only when `t` is not one dense run)."""
    flat = _flat_view(t)
    if flat is None:
        flat = t.contiguous().view(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


#: dtypes Horovod 0.28's collectives refuse, and what they travel as: reductions in a wider float (rounded
#: once on the way back), bit-exact transfers (gather, broadcast) as a same-sized integer view
_REDUCE_AS = {torch.bfloat16: torch.float32}
_MOVE_AS = {torch.bfloat16: torch.int16}


class HorovodComm(Comm):
    """`HorovodComm(process_set=None)`: the group is a Horovod `ProcessSet` (None = the global set).

    Ranks are ranks within the process set. `rank` and `size` are read from Horovod on every access,
    so one object stays valid across elastic resets of the global set.
    """

    backend = "horovod"

    def __init__(self, process_set=None, prefix: str = "pdv"):
        hvd = _hvd()
        if not hvd.is_initialized():
            raise RuntimeError("HorovodComm needs Horovod initialised (call hvd.init() first)")
        self._hvd = hvd
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        if not self.process_set.included():
            raise ValueError(f"this rank ({hvd.rank()}) is not a member of {self.process_set}")
        self.prefix = prefix
        self._ops = {"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min, "avg": hvd.Average}

    # ---- group membership ------------------------------------------------------------------------
    @property
    def rank(self) -> int:  # type: ignore[override]
        return int(self.process_set.rank())

    @property
    def size(self) -> int:  # type: ignore[override]
        return int(self.process_set.size())

    def _is_global(self) -> bool:
        return self.process_set.process_set_id == 0

    def global_rank(self, group_rank: int) -> int:
        """The global Horovod rank of a member of this process set."""
        if self._is_global():
            return group_rank
        return int(self.process_set.ranks[group_rank])

    def _name(self, kind: str, t: Optional[torch.Tensor] = None, shape: bool = True) -> str:
        sig = ""
        if t is not None:
            dims = tuple(t.shape) if shape else tuple(t.shape[1:])
            sig = f".{str(t.dtype).replace('torch.', '')}.{'x'.join(map(str, dims)) or 's'}"
        return f"{self.prefix}.ps{self.process_set.process_set_id}.{kind}{sig}"

    # ---- primitives ------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in self._ops:
            raise ValueError(f"unknown reduction op '{op}' (known: {', '.join(self._ops)})")
        if self.size == 1:
            return tensor
        hvd_op = self._ops[op]
        if op == "avg" and not tensor.is_floating_point():
            hvd_op = self._ops["sum"]  # Horovod averages floats only; sum then divide, like TorchComm
        wide = _REDUCE_AS.get(tensor.dtype)
        if wide is not None:
            work = tensor.to(wide, memory_format=torch.contiguous_format)
        else:
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._hvd.allreduce_(work, op=hvd_op, name=self._name(f"allreduce.{op}", work),
                             process_set=self.process_set)
        if op == "avg" and not tensor.is_floating_point():
            work.div_(self.size)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        if self.size == 1:
            return [tensor.clone()]
        work = tensor.contiguous().unsqueeze(0)
        moved = _MOVE_AS.get(work.dtype)
        if moved is not None:
            work = work.view(moved)
        out = self._hvd.allgather(work, name=self._name("allgather", work, shape=False),
                                  process_set=self.process_set)
        if moved is not None:
            out = out.view(tensor.dtype)
        return list(out.unbind(0))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size == 1:
            return tensor
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        moved = _MOVE_AS.get(work.dtype)
        send = work.view(moved) if moved is not None else work  # shares work's memory: received in place
        self._hvd.broadcast_(send, root_rank=self.global_rank(src), name=self._name(f"broadcast.{src}", send),
                             process_set=self.process_set)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def exchange(self, sends: Dict[int, Message], recvs: Dict[int, Message],
                 device: Optional[torch.device] = None) -> None:
        me, n = self.rank, self.size
        for peer in list(sends) + list(recvs):
            if not 0 <= peer < n:
                raise ValueError(f"exchange: peer {peer} is not a rank of this group (size {n})")
        if me in sends and me in recvs:
            for dst, src in zip(parts(recvs[me]), parts(sends[me])):
                dst.copy_(src)
        if n == 1:
            return
        chunks, splits = [], []
        for peer in range(n):
            bs = [_bytes(t) for t in parts(sends[peer])] if peer in sends and peer != me else []
            chunks += bs
            splits.append(sum(b.numel() for b in bs))
        if chunks:
            payload = torch.cat(chunks)
        else:  # nothing to send: an empty message on the device the others' messages are on
            where = [t.device for m in recvs.values() for t in parts(m)][:1] or [device or torch.device("cpu")]
            payload = torch.empty(0, dtype=torch.uint8, device=where[0])
        out, got = self._hvd.alltoall(payload, splits=torch.tensor(splits, dtype=torch.int32),
                                      name=self._name("alltoall"), process_set=self.process_set)
        got = [int(x) for x in got.tolist()]
        offset = 0
        for peer in range(n):
            size = got[peer]
            if peer in recvs and peer != me:
                dsts = parts(recvs[peer])
                want = sum(d.numel() * d.element_size() for d in dsts)
                if size != want:
                    raise RuntimeError(f"exchange: rank {me} expected {want} bytes from rank {peer}, got {size}")
                pos = offset
                for dst in dsts:
                    nb = dst.numel() * dst.element_size()
                    flat = _flat_view(dst)
                    if flat is not None:  # straight into place
                        (flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat).copy_(out[pos:pos + nb])
                    else:
                        dst.copy_(out[pos:pos + nb].clone().view(dst.dtype).view(dst.shape))
                    pos += nb
            elif size:
                raise RuntimeError(f"exchange: rank {peer} sent {size} bytes to rank {me}, which expected none")
            offset += size

    def barrier(self) -> None:
        if self.size > 1:
            self._hvd.barrier(process_set=self.process_set)

    # ---- faster derived helpers (Horovod's allgather takes ragged first dimensions) ----------------
    def all_gather_varsize(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        flat = tensor.reshape(-1).contiguous()
        if self.size == 1:
            return [flat.clone()]
        n = torch.tensor([flat.numel()], dtype=torch.int64)
        sizes = self._hvd.allgather(n, name=self._name("allgather.sizes"), process_set=self.process_set).tolist()
        moved = _MOVE_AS.get(flat.dtype)
        send = flat.view(moved) if moved is not None else flat
        out = self._hvd.allgather(send, name=self._name("allgather.var", send, shape=False),
                                  process_set=self.process_set)
        if moved is not None:
            out = out.view(flat.dtype)
        return list(torch.split(out, [int(s) for s in sizes]))

    def __repr__(self) -> str:
        return f"HorovodComm(process_set={self.process_set}, rank={self.rank}, size={self.size})"
