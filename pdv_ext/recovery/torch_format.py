"""torch.save's file format in two halves: the small pickle made where torch is, the tensors' bytes put around it
where torch is not.

Why: the snapshot keeper turns each snapshot into files that load with `torch.load(weights_only=True)`, as
every pdv checkpoint does. With `torch.save` it needed torch, whose import is ~1.4 s of CPU per keeper at the
job's start, on the cores the workers start on (and `torch.save` copies and checksums every tensor once more).
Here the worker pickles each file's structure with its tensors as storage references (what `torch.save`
pickles; microseconds), and the keeper writes the zip archive `torch.load` reads (the `archive/data.pkl`
record, one `archive/data/<key>` record per tensor from the shared buffer, the version records) with the
standard library only.

The archive is the one `torch.save` writes (zip, stored, each tensor's record 64-byte aligned):
`tests/unit/test_torch_format.py` loads it with `torch.load(weights_only=True)` for every dtype and shape
the training state has, and compares with `torch.save`'s own archive.
"""
from __future__ import annotations

import io
import pickle
import sys
import uuid
import zipfile
from typing import Any, Iterable, List, Sequence, Tuple

ALIGN = 64  # torch.save aligns each tensor's bytes in the file (torch.load(mmap=True) maps them in place)
PROTOCOL = 2  # torch.save's default pickle protocol


class _Storage:
    """A tensor's storage in the pickle: its persistent id names record `data/<i>` (i: the staged tensor)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def data_pickle(obj: Any, layout: Sequence[Tuple[int, str, Tuple[int, ...]]], ref_type: type) -> Tuple[bytes, List[int]]:
    """(worker side, torch imported) `obj`'s `archive/data.pkl` with each `ref_type` instance (an index into
    `layout`: offset, dtype name, shape) pickled as torch.save pickles a contiguous CPU tensor of that dtype and
    shape; returns the pickle and the indices it refers to, in order."""
    import collections

    import torch

    used: List[int] = []
    types = torch.storage._dtype_to_storage_type_map()  # what torch.save names each dtype's storage
    rebuild = torch._utils._rebuild_tensor_v2

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _Storage):
                _, dtype, shape = layout[o.i]
                used.append(o.i)
                return ("storage", getattr(torch, types[getattr(torch, dtype)]), str(o.i), "cpu", _numel(shape))
            return None

        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, ref_type):
                _, _, shape = layout[o.i]
                shape = tuple(int(d) for d in shape)
                return rebuild, (_Storage(o.i), 0, shape, _contiguous_stride(shape), False,
                                 collections.OrderedDict())
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=PROTOCOL).dump(obj)
    return buf.getvalue(), used


def archive(pkl: bytes, records: Iterable[Tuple[int, Any]], name: str = "archive") -> bytes:
    """(keeper side, no torch) The file torch.save would write: `pkl` from `data_pickle` and each tensor's
    bytes (index, a bytes-like object) as its record, aligned as torch.save aligns them."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        z.writestr(_info(f"{name}/data.pkl", 0, out), pkl)
        z.writestr(_info(f"{name}/.format_version", 0, out), b"1")
        z.writestr(_info(f"{name}/.storage_alignment", 0, out), str(ALIGN).encode())
        z.writestr(_info(f"{name}/byteorder", 0, out), sys.byteorder.encode())
        for i, data in records:
            z.writestr(_info(f"{name}/data/{i}", ALIGN, out), data)
        z.writestr(_info(f"{name}/version", 0, out), b"3\n")
        z.writestr(_info(f"{name}/.data/serialization_id", 0, out), str(uuid.uuid4().int).zfill(40)[:40].encode())
    return out.getvalue()


def _info(filename: str, align: int, out: io.BytesIO) -> zipfile.ZipInfo:
    """A stored record's header, padded (an extra field, as torch's writer pads) so that its bytes start at a
    multiple of `align` in the file."""
    info = zipfile.ZipInfo(filename, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    if align:
        start = out.tell() + 30 + len(filename.encode()) + 4  # local header, name, the extra field's own header
        info.extra = b"FB" + ((-start) % align).to_bytes(2, "little") + b"Z" * ((-start) % align)
    return info
