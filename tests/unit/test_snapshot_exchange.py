"""The copies for another host go both ways at once (`snapshots.exchange`): a rank that sends its stage's copy
and receives another host's gets every message whole, from every sender, whatever the sizes."""
import pytest

from pdv_ext.integrations.deepspeed.snapshots import pack_files, unpack_files
from pdv_ext.spawn import run_ranks


def test_files_packed_into_one_message_come_back_alike():
    files = {"layer_00.pt": b"\x00" * 7, "layer_01.pt": b"", "meta.pt": bytes(range(256)) * 3}
    assert unpack_files(pack_files(files)) == files
    assert unpack_files(pack_files({})) == {}


def test_a_cut_message_is_an_error_not_a_file():
    with pytest.raises(ValueError, match="does not match its header"):
        unpack_files(pack_files({"layer_00.pt": b"abc"})[:-1])


def exchange_worker():
    import torch.distributed as dist

    from pdv_ext.integrations.deepspeed.snapshots import exchange
    from pdv_ext.spawn import init_torch_distributed

    init_torch_distributed("gloo")
    rank = dist.get_rank()
    msg = {r: bytes([r]) * (100_000 * (r + 1)) for r in range(3)}
    # 0 <-> 1 both ways at once; 2 -> 0 as well (0 receives from two); 2 sends an empty message to 1
    outgoing = {0: {1: msg[0]}, 1: {0: msg[1]}, 2: {0: msg[2], 1: b""}}[rank]
    incoming = {0: [1, 2], 1: [0, 2], 2: []}[rank]
    got = exchange(outgoing, incoming)
    dist.barrier()
    return {src: (len(data), data[:1]) for src, data in got.items()}


@pytest.mark.timeout(120)
def test_every_rank_receives_what_was_sent_to_it_while_it_sends():
    res = run_ranks("tests.unit.test_snapshot_exchange:exchange_worker", 3, timeout=90)
    assert res[0] == {1: (200_000, b"\x01"), 2: (300_000, b"\x02")}
    assert res[1] == {0: (100_000, b"\x00"), 2: (0, b"")}
    assert res[2] == {}
