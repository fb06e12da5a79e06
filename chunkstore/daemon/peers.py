"""Pulling an entry from a peer daemon (docs/daemon.md#cluster-directory-optional): what the
cluster directory needs
of a transport, and the two built: the peer's gRPC ``Read`` stream (everywhere) and Mooncake's
Transfer Engine (a one-sided read of the peer's pool, ``transfer.py``), which falls back to the
stream whenever it cannot serve a pull.

Either way the puller holds a lease on the entry in the peer's daemon (Acquire over gRPC) for
as long as it reads, so the peer neither evicts nor reuses those blocks meanwhile; a puller
that dies stops renewing and the lease expires with the peer's lease TTL. A puller trusts
nothing it is sent: the bytes must hash to the checksum the peer committed, else the pull
fails with ``ChecksumMismatch`` and nothing is stored.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from chunkstore.daemon.index import Index
from chunkstore.daemon.transfer import MooncakeEngine, read_runs
from chunkstore.errors import ChecksumMismatch, InvalidRequest, NotFound, Unavailable
from chunkstore.kv.entry import EntryLayout
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.convert import Endpoint, LeasedEntry
from chunkstore.protocol.shm import EntryDigest
from chunkstore.protocol.wire import MAX_MESSAGE, typed_error

log = logging.getLogger("chunkstore.daemon.peers")


@dataclass
class Pulled:
    """What a pull did: the entry's bytes, the transport that moved them ("grpc" or the
    engine's name), and whether it was stored (False: it was stored here meanwhile)."""

    nbytes: int
    transport: str
    stored: bool


class PeerSource(Protocol):
    def pull(self, peer: str, key: bytes, index: Index, tenant: str = "") -> Pulled | None:
        """Store the entry ``key`` of ``tenant``'s namespace as ``peer`` holds it in
        ``index``, checksum-verified; None if the peer does not hold it (any more). Raises a
        ``StoreError`` if the peer cannot serve it (or does not know ``tenant``)."""

    def forget(self, peer: str) -> None:
        """Drop what is kept for ``peer`` (after a failure: the next pull reconnects)."""

    def close(self) -> None: ...


@dataclass
class PeerLease:
    """A lease this daemon holds on an entry in a peer's daemon."""

    lease: LeasedEntry
    layout: EntryLayout
    block_size: int  # the peer's
    tenant: str  # whose entry: stored here as theirs


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
        self.endpoint: Endpoint | None = None  # where its transfer engine reads its pool

    def _call(self, method: grpc.UnaryUnaryMultiCallable, request: object) -> object:
        try:
            return method(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise typed_error(err) from None

    def _hello(self) -> None:
        request = pb.HelloRequest(client_name="peer-fetch", hostname=socket.gethostname())
        reply = self._call(self.stub.Hello, request)
        self.session = reply.session_id  # type: ignore[attr-defined]
        self.endpoint = Endpoint.from_proto(reply.transfer)  # type: ignore[attr-defined]

    def acquire(self, key: bytes, tenant: str = "") -> PeerLease | None:
        """A lease on ``tenant``'s entry ``key`` in the peer's daemon, or None if it holds
        no such entry."""
        if not self.session:
            self._hello()
        request = pb.AcquireRequest(session_id=self.session, keys=[key], tenant=tenant)
        try:
            reply = self._call(self.stub.Acquire, request)
        except NotFound:  # the peer reaped our idle session (or restarted)
            self._hello()
            request.session_id = self.session
            reply = self._call(self.stub.Acquire, request)
        if len(reply.leases) != 1:  # type: ignore[attr-defined]
            raise InvalidRequest(f"peer answered {len(reply.leases)} leases for one key")  # type: ignore[attr-defined]
        [message] = reply.leases  # type: ignore[attr-defined]
        lease = LeasedEntry.from_proto(message)
        if lease is None:
            return None
        try:
            layout = lease.layout
            layout.validate()  # a malformed answer is a failed pull, not a crash
            if layout.nbytes != lease.nbytes:
                raise InvalidRequest(f"peer leased {lease.nbytes} bytes for a layout of {layout}")
        except BaseException:
            self.release(lease)
            raise
        return PeerLease(lease, layout, reply.block_size, tenant)  # type: ignore[attr-defined]

    def release(self, lease: LeasedEntry) -> None:
        request = pb.ReleaseRequest(session_id=self.session, lease_ids=[lease.lease_id])
        self._call(self.stub.Release, request)

    def read(self, lease: LeasedEntry) -> np.ndarray:
        """The leased entry's bytes over the gRPC stream, checked against its checksum."""
        data = np.empty(lease.nbytes, dtype=np.uint8)
        digest = EntryDigest()
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

    def pull(self, peer: str, key: bytes, index: Index, tenant: str = "") -> Pulled | None:
        connection = self._peers.get(peer)
        if connection is None:
            connection = self._peers[peer] = _Peer(peer, self.token, self.timeout, self.tls)
        held = connection.acquire(key, tenant)
        if held is None:
            return None
        try:
            return self._store(connection, held, index)
        finally:
            connection.release(held.lease)

    def _store(self, connection: _Peer, held: PeerLease, index: Index) -> Pulled:
        data = connection.read(held.lease)
        stored = index.store(held.lease.key, held.layout, data, held.lease.checksum, held.tenant)
        return Pulled(held.layout.nbytes, "grpc", stored)

    def forget(self, peer: str) -> None:
        connection = self._peers.pop(peer, None)
        if connection is not None:
            connection.close()

    def close(self) -> None:
        for peer in list(self._peers):
            self.forget(peer)


class EnginePeers(StreamPeers):
    """Pulls over the transfer engine, one-sidedly into blocks reserved in this daemon's pool,
    under a lease taken over gRPC; over the stream when the engine cannot serve a pull, each
    time counted in ``fell_back`` by why: "engine_unavailable" (this daemon's did not start),
    "peer_without_engine", "read_failed"."""

    def __init__(
        self,
        engine: MooncakeEngine | None,
        fell_back: Callable[[str], None],
        token: str | None,
        timeout: float = 10.0,
        tls: PeerTLS | None = None,
    ) -> None:
        super().__init__(token, timeout, tls)
        self.engine = engine
        self.fell_back = fell_back

    def _store(self, connection: _Peer, held: PeerLease, index: Index) -> Pulled:
        engine, peer = self.engine, connection.endpoint
        if engine is None:
            reason = "engine_unavailable"
        elif peer is None:
            reason = "peer_without_engine"
        else:
            lease = held.lease

            def read(blocks: list[int]) -> None:
                runs = read_runs(
                    blocks, index.pool.block_size, lease.blocks, held.block_size, lease.nbytes
                )
                engine.read(peer, runs)

            try:
                stored = index.store_with(lease.key, held.layout, read, lease.checksum, held.tenant)
                return Pulled(lease.nbytes, engine.endpoint.engine, stored)
            except Unavailable as err:
                log.warning("%s; pulling over the gRPC stream instead", err)
                reason = "read_failed"
        self.fell_back(reason)
        return super()._store(connection, held, index)
