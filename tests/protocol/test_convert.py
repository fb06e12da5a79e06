"""The messages' Python faces: each converts to its message and back unchanged, and the
bytes on the wire are those of the message written field by field (the format is fixed:
daemons and clients of different releases talk)."""

from __future__ import annotations

from chunkstore.kv.entry import EntryLayout
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.convert import (
    Endpoint,
    IpcHandle,
    LeasedEntry,
    layout_from_proto,
    layout_to_proto,
    lease_to_proto,
)
from chunkstore.protocol.keyed_digest import SumKey, Summed

LAYOUT = EntryLayout(30, 3, 64, "bfloat16", "kv", 40, 12, "prefix", "")


def test_a_layout_goes_to_its_message_and_back() -> None:
    message = layout_to_proto(LAYOUT)
    assert layout_from_proto(message) == LAYOUT
    assert (
        message.SerializeToString()
        == pb.EntryLayout(
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
            dtype="bfloat16",
            kind="kv",
            num_tokens=40,
            virtual_start=12,
            entry_kind="prefix",
        ).SerializeToString()
    )
    assert layout_from_proto(pb.EntryLayout()).entry_kind == "chunk"  # an old sender's


def test_a_lease_the_daemon_grants_is_the_entry_the_client_reads() -> None:
    summed = Summed(SumKey((2**64 - 1, 5)), (2**31 - 2, 0))
    message = lease_to_proto(LAYOUT, LAYOUT.nbytes, [4, 5, 9], 0xFEED, summed)
    assert LeasedEntry.from_proto(message) is None  # no lease id: no entry
    message.lease_id, message.key = 7, b"k" * 16
    assert LeasedEntry.from_proto(message) == LeasedEntry(
        7, b"k" * 16, LAYOUT, LAYOUT.nbytes, [4, 5, 9], 0xFEED, summed
    )
    message.keyed_sums.pop()  # lanes without their sums: not summed, read whole
    assert LeasedEntry.from_proto(message).summed is None  # type: ignore[union-attr]


def test_endpoints_and_device_pool_handles_go_to_their_messages_and_back() -> None:
    endpoint = Endpoint("mooncake", "tcp", "10.0.0.1:1234", 1 << 40, 1 << 30)
    assert Endpoint.from_proto(endpoint.to_proto()) == endpoint
    assert Endpoint.from_proto(pb.TransferEndpoint()) is None  # no engine
    handle = IpcHandle("cuda", "GPU-1", b"h", 1 << 20, 4096, b"r", 8, b"e", True)
    assert IpcHandle.from_proto(handle.to_proto()) == handle
