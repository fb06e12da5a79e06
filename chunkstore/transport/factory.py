"""Which transport a session moves bytes over: the first back end that serves the daemon
from here, in ``BACK_ENDS``' order (the stream serves every daemon). A new back end is a
module beside the others and a line here."""

from __future__ import annotations

from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.transport.base import Settings, Transport
from chunkstore.transport.device import DevicePoolTransport
from chunkstore.transport.shared_memory import SharedMemoryTransport
from chunkstore.transport.stream import StreamTransport

BACK_ENDS: tuple[type[Transport], ...] = (
    DevicePoolTransport,
    SharedMemoryTransport,
    StreamTransport,
)


def open_transport(
    hello: pb.HelloReply, settings: Settings, previous: Transport | None = None
) -> Transport:
    """The transport of the session ``hello`` opened. ``previous``: the transport of the
    session it replaces, kept where it still serves (the same device pool's import), else
    closed before another is opened."""
    if previous is not None:
        if previous.keeps(hello):
            return previous
        previous.close()
    for back_end in BACK_ENDS:
        transport = back_end.open(hello, settings)
        if transport is not None:
            return transport
    raise AssertionError("the stream serves every daemon")
