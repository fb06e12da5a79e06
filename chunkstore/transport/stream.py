"""The stream transport: entries over the daemon's gRPC ``Write`` and ``Read`` streams, in
pieces of at most ``WRITE_PIECE`` bytes each way. It serves any host and any pool: the
client's fallback wherever the pool cannot be reached."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import torch

from chunkstore.device.device_ipc import TensorDigest, keyed_run_sums
from chunkstore.errors import ChecksumMismatch
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.wire import MAX_RUNS, typed_error
from chunkstore.transport.base import (
    Digest,
    EntryAtATime,
    LeasedEntry,
    Outgoing,
    Settings,
    TransportName,
)

WRITE_PIECE = 1 << 20


def _update(digest: Digest, data: np.ndarray) -> None:
    """Feed host bytes to either kind of digest."""
    if isinstance(digest, TensorDigest):
        digest.update(torch.from_numpy(data))
    else:
        digest.update(data.data)


def _pieces(session: str, reservation_id: int, parts: list[np.ndarray]) -> Iterator[pb.WritePiece]:
    """An entry's bytes as ``Write`` messages; the first names the reservation."""
    first = True
    for part in parts:
        for lo in range(0, part.shape[0], WRITE_PIECE):
            data = part[lo : lo + WRITE_PIECE].tobytes()
            if first:
                yield pb.WritePiece(session_id=session, reservation_id=reservation_id, data=data)
            else:
                yield pb.WritePiece(data=data)
            first = False


class StreamTransport(EntryAtATime):
    name = TransportName.STREAM

    def __init__(self, hello: pb.HelloReply, settings: Settings) -> None:
        super().__init__(hello)
        self.stub, self.metadata = settings.calls.stub, settings.calls.metadata
        self.timeout = max(settings.calls.timeout, 120.0)  # an entry's whole stream

    @classmethod
    def open(cls, hello: pb.HelloReply, settings: Settings) -> StreamTransport:
        return cls(hello, settings)

    def stage(self, tensors: list[torch.Tensor]) -> Outgoing:
        """Hashed here, before it is sent (through a pool: as it is copied)."""
        outgoing = super().stage(tensors)
        for part in outgoing.parts:
            _update(outgoing.digest, part)
        return outgoing

    def write(self, session: str, reservation: pb.ReserveReply, outgoing: Outgoing) -> None:
        pieces = _pieces(session, reservation.reservation_id, outgoing.parts)
        try:
            self.stub.Write(pieces, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise typed_error(err) from None

    def read_entry(
        self, entry: LeasedEntry, out: torch.Tensor, digest: Digest, session: str
    ) -> None:
        target = out.numpy()
        self._receive(pb.ReadRequest(session_id=session, lease_id=entry.lease_id), target)
        _update(digest, target)

    def _receive(self, request: pb.ReadRequest, target: np.ndarray) -> None:
        """What a ``Read`` streams, into ``target``: every byte of it, or ChecksumMismatch."""
        offset = 0
        try:
            for piece in self.stub.Read(request, timeout=self.timeout, metadata=self.metadata):
                data = np.frombuffer(piece.data, dtype=np.uint8)
                if offset + data.shape[0] > target.shape[0]:
                    raise ChecksumMismatch(f"the daemon sent over {target.shape[0]} bytes")
                target[offset : offset + data.shape[0]] = data
                offset += data.shape[0]
        except grpc.RpcError as err:
            raise typed_error(err) from None
        if offset != target.shape[0]:
            raise ChecksumMismatch(f"read {offset} of {target.shape[0]} bytes")

    def read_runs(
        self, entry: LeasedEntry, starts: torch.Tensor, length: int, out: torch.Tensor, session: str
    ) -> torch.Tensor:
        """The daemon gathers the runs (``Read`` with ``run_starts``, at most ``MAX_RUNS`` a
        Read: more go over several, one after another into ``out``); summed here."""
        target = out.numpy()
        for first in range(0, starts.numel(), MAX_RUNS):
            these = starts[first : first + MAX_RUNS]
            request = pb.ReadRequest(
                session_id=session,
                lease_id=entry.lease_id,
                run_starts=these.tolist(),
                run_bytes=length,
            )
            lo = first * length
            self._receive(request, target[lo : lo + these.numel() * length])
        return keyed_run_sums(out, starts, length, entry.sum_tables())
