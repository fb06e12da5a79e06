"""Conversions between the gRPC messages and chunkstore's own types, shared by the server
and the client."""

from __future__ import annotations

from chunkstore.entry import EntryLayout
from chunkstore.rpc import chunkstore_pb2 as pb

MAX_MESSAGE = 64 << 20  # bytes in one gRPC message, both ways


def layout_from_proto(msg: pb.EntryLayout) -> EntryLayout:
    return EntryLayout(
        msg.num_layers,
        msg.num_kv_heads,
        msg.head_dim,
        msg.dtype,
        msg.kind,
        msg.num_tokens,
        msg.virtual_start,
    )


def layout_to_proto(layout: EntryLayout) -> pb.EntryLayout:
    return pb.EntryLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        kind=layout.kind,
        num_tokens=layout.num_tokens,
        virtual_start=layout.virtual_start,
    )
