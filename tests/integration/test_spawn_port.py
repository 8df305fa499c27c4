"""run_ranks starts again on another port when its rendezvous port was taken between free_port() and rank 0's
store listening (seen on a GPU machine with the tier's tests in parallel: EADDRINUSE failed a benchmark)."""
import socket

import pytest

from pdv_ext import spawn

pytestmark = pytest.mark.timeout(120)


def world_sum(value: int = 1) -> int:
    """A rank: join the process group, all-reduce `value`."""
    import torch
    import torch.distributed as dist

    spawn.init_torch_distributed("gloo")
    t = torch.tensor([value])
    dist.all_reduce(t)
    spawn.shutdown_distributed()
    return int(t.item())


def test_a_taken_port_is_replaced(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = spawn.free_port
        given = []

        def first_taken():
            port = next(ports, None) or real()
            given.append(port)
            return port
        monkeypatch.setattr(spawn, "free_port", first_taken)
        assert spawn.run_ranks(f"{__name__}:world_sum", 2, {"value": 3}, timeout=60) == [6, 6]
    assert given[0] == taken and len(given) == 2


def test_other_failures_are_not_retried(monkeypatch):
    calls = []
    real = spawn.free_port
    monkeypatch.setattr(spawn, "free_port", lambda: calls.append(1) or real())
    with pytest.raises(spawn.RankFailed, match="ValueError"):
        spawn.run_ranks(f"{__name__}:world_sum", 1, {"value": "x"}, timeout=60)
    assert len(calls) == 1
