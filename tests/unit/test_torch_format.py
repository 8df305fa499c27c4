"""torch.save's file format made in two halves (pdv_ext.recovery.torch_format): the pickle where torch is, the
archive where it is not. What comes out must be what torch.save writes, as torch.load reads it: every dtype and
shape of a training state, with torch's restricted loader, memory-mapped, records aligned as torch aligns them."""
import io
import zipfile

import pytest
import torch

from pdv_ext.recovery.keeper import ALIGN, TensorRef, flatten
from pdv_ext.recovery.torch_format import archive, data_pickle

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def _made(obj):
    """`obj` as a keeper makes it: tensors staged contiguously into one buffer, the pickle, the archive."""
    tensors = []
    flat = flatten(obj, tensors)
    layout, spans, buf, off = [], [], bytearray(), 0
    for t in tensors:
        n = t.numel() * t.element_size()
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if n else b""
        buf += raw + bytes(-(-n // ALIGN) * ALIGN - n)
        layout.append((off, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
        spans.append((off, n))
        off += -(-n // ALIGN) * ALIGN
    pkl, used = data_pickle(flat, layout, TensorRef)
    view = memoryview(bytes(buf))
    return archive(pkl, [(i, view[spans[i][0]:spans[i][0] + spans[i][1]]) for i in used]), used


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _state():
    g = torch.Generator().manual_seed(0)
    tensors = {str(dt).replace("torch.", ""): (torch.randn(5, 3, generator=g) * 7).to(dt) for dt in DTYPES}
    return {"tensors": tensors, "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
            "not_contiguous": torch.randn(4, 6, generator=g).t(), "rng": torch.get_rng_state(),
            "plain": [1, 2.5, "adam", None, True, (0.9, 0.999), torch.Size([2, 3]), torch.bfloat16,
                      torch.device("cpu")], "nested": {"a": [torch.ones(2), {"b": torch.zeros(1, 1, 1)}]}}


@pytest.mark.parametrize("mmap", [False, True])
def test_the_archive_loads_as_the_state_with_weights_only(tmp_path, mmap):
    state = _state()
    data, used = _made(state)
    path = tmp_path / "layer_00.pt"
    path.write_bytes(data)
    assert _same(state, torch.load(path, weights_only=True, mmap=mmap))
    assert len(used) == len(set(used)) == 1 + len(DTYPES) + 5  # every tensor its own record


def test_the_records_are_torch_saves_own_and_aligned():
    state = _state()
    data, _ = _made(state)
    ref = io.BytesIO()
    torch.save(state, ref)
    ours, theirs = (zipfile.ZipFile(io.BytesIO(b)) for b in (data, ref.getvalue()))
    assert sorted(i.filename for i in ours.infolist()) == sorted(i.filename for i in theirs.infolist())
    for name in ("archive/version", "archive/byteorder", "archive/.format_version", "archive/.storage_alignment"):
        assert ours.read(name) == theirs.read(name), name
    assert ours.testzip() is None  # every record's CRC holds
    for info in ours.infolist():
        if "/data/" in info.filename and info.file_size:
            start = info.header_offset + 30 + len(info.filename) + len(info.extra)
            assert start % ALIGN == 0, info.filename


def test_a_file_holds_only_its_own_tensors():
    """One staging of several files: each archive has the records of the tensors its structure refers to."""
    files = {"layer_00.pt": {"w": torch.ones(1000)}, "layer_01.pt": {"w": torch.zeros(3), "b": torch.ones(2)}}
    tensors = []
    flat = flatten(files, tensors)
    layout = [(0, str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in tensors]
    assert data_pickle(flat["layer_00.pt"], layout, TensorRef)[1] == [0]
    assert data_pickle(flat["layer_01.pt"], layout, TensorRef)[1] == [1, 2]
