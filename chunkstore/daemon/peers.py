"""Pulling an entry from a peer daemon (DESIGN.md, "Cluster"): what the cluster directory needs
of a transport, and the one built so far, the peer's gRPC ``Read`` stream.

A puller trusts nothing it is sent: the bytes must hash to the checksum the peer committed,
else the pull fails with ``ChecksumMismatch`` and nothing is stored. Another transport (a
collective, Mooncake's Transfer Engine) is another class with the same ``pull``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
import xxhash

from chunkstore.errors import ChecksumMismatch, InvalidRequest, NotFound
from chunkstore.kv.entry import EntryLayout
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.wire import MAX_MESSAGE, layout_from_proto, typed_error


@dataclass
class PulledEntry:
    """A peer's entry, checked against the checksum it committed."""

    layout: EntryLayout
    data: np.ndarray  # uint8, the entry's bytes
    checksum: int


class PeerSource(Protocol):
    def pull(self, peer: str, key: bytes) -> PulledEntry | None:
        """The entry ``key`` as ``peer`` holds it, or None if it does not (any more).
        Raises a ``StoreError`` if the peer cannot serve it."""

    def forget(self, peer: str) -> None:
        """Drop what is kept for ``peer`` (after a failure: the next pull reconnects)."""

    def close(self) -> None: ...


class _Peer:
    """One peer daemon: a channel and a session (no heartbeat: a pull holds its lease for
    one read, and a session the peer reaped for idleness is opened again)."""

    def __init__(
        self, address: str, token: str | None, timeout: float, tls: PeerTLS | None
    ) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE)]
        if tls is not None:
            credentials = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.ChunkStoreStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        self.session = ""

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> object:
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise typed_error(err) from None

    def _hello(self) -> None:
        request = pb.HelloRequest(client_name="peer-fetch", hostname=socket.gethostname())
        reply = self._call(self.stub.Hello, request)
        self.session = reply.session_id  # type: ignore[attr-defined]

    def _acquire(self, key: bytes) -> pb.Lease:
        request = pb.AcquireRequest(session_id=self.session, keys=[key])
        [lease] = self._call(self.stub.Acquire, request).leases  # type: ignore[attr-defined]
        return lease

    def pull(self, key: bytes) -> PulledEntry | None:
        if not self.session:
            self._hello()
        try:
            reply = self._call(
                self.stub.Acquire, pb.AcquireRequest(session_id=self.session, keys=[key])
            )
        except NotFound:  # the peer reaped our idle session (or restarted)
            self._hello()
            reply = self._call(
                self.stub.Acquire, pb.AcquireRequest(session_id=self.session, keys=[key])
            )
        if len(reply.leases) != 1:  # type: ignore[attr-defined]
            raise InvalidRequest(f"peer answered {len(reply.leases)} leases for one key")  # type: ignore[attr-defined]
        [lease] = reply.leases  # type: ignore[attr-defined]
        if not lease.lease_id:
            return None
        try:
            layout = layout_from_proto(lease.layout)
            layout.validate()  # a malformed answer is a failed pull, not a crash
            if layout.nbytes != lease.nbytes:
                raise InvalidRequest(f"peer leased {lease.nbytes} bytes for a layout of {layout}")
            data = self._read(lease)
        finally:
            self._call(
                self.stub.Release,
                pb.ReleaseRequest(session_id=self.session, lease_ids=[lease.lease_id]),
            )
        return PulledEntry(layout, data, lease.checksum)

    def _read(self, lease: pb.Lease) -> np.ndarray:
        data = np.empty(lease.nbytes, dtype=np.uint8)
        digest = xxhash.xxh3_64()
        offset = 0
        request = pb.ReadRequest(session_id=self.session, lease_id=lease.lease_id)
        try:
            for piece in self.stub.Read(
                request, timeout=max(self.timeout, 120.0), metadata=self.metadata
            ):
                if offset + len(piece.data) > lease.nbytes:
                    raise ChecksumMismatch(f"peer sent more than the {lease.nbytes} bytes leased")
                chunk = np.frombuffer(piece.data, dtype=np.uint8)
                data[offset : offset + chunk.shape[0]] = chunk
                digest.update(piece.data)
                offset += chunk.shape[0]
        except grpc.RpcError as err:
            raise typed_error(err) from None
        if offset != lease.nbytes:
            raise ChecksumMismatch(f"read {offset} of {lease.nbytes} bytes")
        if digest.intdigest() != lease.checksum:
            raise ChecksumMismatch(
                f"entry {lease.key.hex()} hashes to {digest.intdigest():#x}, committed as "
                f"{lease.checksum:#x}: not used"
            )
        return data

    def close(self) -> None:
        self.channel.close()  # the peer releases what the session held when it expires


@dataclass(frozen=True)
class PeerTLS:
    """Dial peers over TLS: their server certificates must chain to ``ca``; ``cert`` and
    ``key`` (PEM) are this daemon's, shown to peers that require a client certificate."""

    ca: bytes
    cert: bytes
    key: bytes


class StreamPeers:
    """Pulls over each peer's gRPC ``Read`` stream, sending ``token`` (the cluster's peer
    credential, never the client token), over TLS when ``tls`` is given."""

    def __init__(
        self, token: str | None, timeout: float = 10.0, tls: PeerTLS | None = None
    ) -> None:
        self.token = token
        self.timeout = timeout
        self.tls = tls
        self._peers: dict[str, _Peer] = {}

    def pull(self, peer: str, key: bytes) -> PulledEntry | None:
        connection = self._peers.get(peer)
        if connection is None:
            connection = self._peers[peer] = _Peer(peer, self.token, self.timeout, self.tls)
        return connection.pull(key)

    def forget(self, peer: str) -> None:
        connection = self._peers.pop(peer, None)
        if connection is not None:
            connection.close()

    def close(self) -> None:
        for peer in list(self._peers):
            self.forget(peer)
