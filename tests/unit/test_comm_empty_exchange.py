"""A rank with nothing to send in `Comm.exchange` (adasum's fold on 3 or 5 ranks, gossip's odd peer graphs)
still takes part in Horovod's alltoall: its empty message must be on the device the others' are on
(Horovod refuses a collective mixing CPU and GPU tensors). Checked with a stand-in for Horovod whose
alltoall records the payload's device; "meta" plays the GPU."""
import torch

from pdv_ext.comm.horovod_comm import HorovodComm


class _Set:
    def __init__(self, rank, size):
        self._r, self._s = rank, size
        self.process_set_id = 0

    def rank(self):
        return self._r

    def size(self):
        return self._s


class _Hvd:
    def __init__(self, incoming):
        self.payloads, self.incoming = [], incoming

    def alltoall(self, payload, splits, name=None, process_set=None):
        self.payloads.append(payload)
        total = sum(self.incoming)
        return torch.zeros(total, dtype=torch.uint8, device=payload.device), torch.tensor(self.incoming)


def _comm(rank, size, incoming):
    comm = object.__new__(HorovodComm)
    comm._hvd, comm.process_set, comm.prefix = _Hvd(incoming), _Set(rank, size), "test"
    return comm


def test_idle_rank_sends_its_empty_message_on_the_given_device():
    comm = _comm(2, 3, [0, 0, 0])
    comm.exchange({}, {}, device=torch.device("meta"))
    assert comm._hvd.payloads[0].device.type == "meta" and comm._hvd.payloads[0].numel() == 0
    comm.exchange({}, {})  # no hint: the host
    assert comm._hvd.payloads[1].device.type == "cpu"


def test_receive_only_rank_uses_the_receive_buffers_device():
    comm = _comm(0, 3, [0, 0, 16])
    dst = torch.empty(4, dtype=torch.float32, device="meta")
    comm.exchange({}, {2: dst})
    assert comm._hvd.payloads[0].device.type == "meta"
