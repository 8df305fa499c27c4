"""The in-process ThreadComm the multi-rank unit tests run on."""
import torch

from tests.threadcomm import run_threads


def test_threadcomm_collectives_and_exchange():
    def fn(comm):
        t = torch.tensor([float(comm.rank + 1)])
        comm.all_reduce(t, "sum")
        got = torch.zeros(1)
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        comm.exchange({right: torch.tensor([float(comm.rank)])}, {left: got})
        return t.item(), got.item(), [x.item() for x in comm.all_gather(torch.tensor([comm.rank * 2.0]))]

    out = run_threads(3, fn)
    assert [o[0] for o in out] == [6.0] * 3
    assert [o[1] for o in out] == [2.0, 0.0, 1.0]
    assert out[1][2] == [0.0, 2.0, 4.0]


def test_all_gather_into_default_fills_every_row():
    def fn(comm):
        out = torch.full((comm.size, 2, 3), -1.0)
        out[comm.rank] = comm.rank + torch.arange(6.0).view(2, 3)
        return comm.all_gather_into(out)

    for out in run_threads(3, fn):
        assert torch.equal(out, torch.stack([r + torch.arange(6.0).view(2, 3) for r in range(3)]))

