"""``ChunkStoreClient``: the Python client of the daemon.

It opens a session (kept alive by a heartbeat stream, held by the daemon before the constructor
returns: if this process dies, the daemon drops its leases and reservations at once; if it is
paused, the session waits for it), then moves bytes the cheapest way it can: straight
through the shared-memory pool when it can map it (same host), else over the gRPC streams.
Every read is checked against the checksum stored at commit; a mismatch raises
ChecksumMismatch and the bytes are never returned.

What lies beneath is ``chunkstore/transport/``: the calls (gRPC, the fast path), the
session, the transport the session's bytes move over, chosen when it opens, and the checked
reads of leased entries (``checked_reads.py``), which this class inherits.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from chunkstore.errors import (
    AlreadyExists,
    InvalidRequest,
    StoreError,
)
from chunkstore.kv.entry import EntryLayout, layout_of, tensors_of, torch_dtype
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import streamcopy
from chunkstore.protocol.convert import layout_to_proto
from chunkstore.protocol.endpoints import default_address as default_address  # re-exported
from chunkstore.protocol.shm import (
    Pieces as Pieces,  # re-exported: where read_each puts an entry in pieces
)
from chunkstore.protocol.wire import MAX_BATCH
from chunkstore.transport.base import LeasedEntry as LeasedEntry  # re-exported
from chunkstore.transport.base import Settings, TransportName, Wanted
from chunkstore.transport.base import as_bytes as as_bytes  # re-exported
from chunkstore.transport.calls import DaemonCalls, open_channel
from chunkstore.transport.checked_reads import CheckedReads
from chunkstore.transport.session import Session

log = logging.getLogger("chunkstore.client")


def load_copy_kernel() -> None:
    """Load the pool's streaming copy (numba's machine code, compiled where no cache is yet)
    now, not in the first put or get over shared memory."""
    streamcopy.copy(np.zeros(8, np.uint8), np.ones(8, np.uint8))


def _batches(keys: Sequence[bytes]) -> Iterator[list[bytes]]:
    keys = list(keys)
    for start in range(0, len(keys), MAX_BATCH):
        yield keys[start : start + MAX_BATCH]


@dataclass
class StoredKV:
    keys: torch.Tensor
    values: torch.Tensor | None
    layout: EntryLayout


class ChunkStoreClient(CheckedReads):
    """The daemon's client: its session, the index and admin calls, writes, and (from
    ``CheckedReads``, ``transport/checked_reads.py``) the checked reads of leased entries."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        transport: str = "auto",
        root_certificates: bytes | None = None,
        client_cert_chain: bytes | None = None,
        client_key: bytes | None = None,
        timeout: float = 10.0,
        name: str = "",
        fast: bool = True,
        copy_threads: int = 2,
        pin_for: str = "",
        populate: bool = False,
    ) -> None:
        """``address``: ``unix:/path/to.sock`` or ``host:port``. ``transport``: "auto" (through
        the pool when this host can reach it: a shared-memory map, or a device pool opened by
        IPC), "shm" (through the pool, required) or "stream". ``fast``: make
        Lookup, Acquire, Release, Reserve and Commit over the daemon's fast path when it
        offers one on this host (``protocol/fast.py``; gRPC otherwise, and after any failure of it).
        ``copy_threads``: threads a read or a put copies through the pool with (1 or 2).
        ``pin_for``: "cuda" (or "npu") registers a mapped shared-memory pool with that
        runtime, page-locked, so copies between it and the device run as DMA; where it
        cannot, a warning says why and the pool is used pageable. ``populate``: map every
        page of a mapped shared-memory pool on a background thread at the lowest priority
        (``shm.populate``), so that reads do not pay for it on their first touch of a page
        (a pinned pool is mapped already).

        Raises:
            InvalidRequest: an unknown ``transport``.
            Unavailable: the daemon cannot be reached; with "shm", its pool cannot be.
        """
        if transport not in tuple(Wanted):
            raise InvalidRequest(f"unknown transport {transport!r}: auto, shm or stream")
        self.address, self.timeout, self.copy_threads = address, timeout, copy_threads
        channel = open_channel(address, root_certificates, client_cert_chain, client_key)
        self._calls = DaemonCalls(channel, token, timeout, fast)
        self.channel, self.stub, self.metadata = channel, self._calls.stub, self._calls.metadata
        self.name = name or f"pid-{os.getpid()}"
        self.requested_transport = Wanted(transport)
        self.pin_for, self.populate = pin_for, populate
        self._shm_reads: dict[int, int] = {}  # lease id -> bytes copied out of the pool
        settings = Settings(self.requested_transport, self._calls, copy_threads, pin_for, populate)
        self._session = Session(address, self.name, settings)

    # What the session holds now: a lost one is opened again, with a transport of its own.

    @property
    def session(self) -> str:
        return self._session.id

    @property
    def server_info(self) -> pb.HelloReply:
        return self._session.hello

    @property
    def block_size(self) -> int:
        return self._session.hello.block_size

    @property
    def sessions_reopened(self) -> int:
        """Sessions lost (the daemon restarted, or this process paused past the TTL)."""
        return self._session.reopened

    @property
    def posted_calls_lost(self) -> int:
        """Calls sent without waiting (``release(wait=False)``) that a failed fast path did
        not carry and gRPC could not make after it (each logged)."""
        return self._calls.posted_lost

    @property
    def transport(self) -> TransportName:
        """What the session moves bytes over: "shm", "ipc" (a device pool) or "stream"."""
        return self._session.transport.name

    @property
    def region(self) -> np.ndarray | None:
        """The daemon's shared-memory pool, mapped here (the shm transport's)."""
        return self._session.transport.region

    @property
    def device_pool(self) -> torch.Tensor | None:
        """The daemon's device pool, opened here (the ipc transport's)."""
        return self._session.transport.device_pool

    @property
    def pinned(self) -> bool:
        """Whether the mapped pool is registered with the device runtime (``pin_for``)."""
        return self._session.transport.pinned

    @property
    def fast(self) -> bool:
        """Whether Lookup, Acquire, Release, Reserve and Commit go over the fast path now."""
        return self._calls.fast

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        return self._calls.call(method, request, timeout)

    def close(self) -> None:
        """End the session (the daemon releases whatever it still holds) and the channel."""
        if self._session.closed:
            return
        self._session.close()
        self._calls.close()

    def __enter__(self) -> ChunkStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Index --------------------------------------------------------------------------------

    # Any call raises Unavailable where the daemon cannot be reached, and Unauthenticated for
    # a token it does not take; each Raises section names what else.

    def lookup(
        self,
        keys: Sequence[bytes],
        num_tokens: Sequence[int] | None = None,
        entry_kind: str = "chunk",
        probe: bool = False,
    ) -> list[int | None]:
        """Token count of each key's committed entry, or None (``entry_kind``: what the
        keys are, for the daemon's metrics by kind; ``probe``: a placement probe, neither
        counted in the hit rate nor fetched from peers).

        Raises:
            InvalidRequest: a malformed key, or over MAX_BATCH of them.
        """
        request = pb.LookupRequest(
            keys=list(keys),
            num_tokens=list(num_tokens or []),
            entry_kind=entry_kind,
            probe=probe,
        )
        reply = self._call(self.stub.Lookup, request)
        return [n if p else None for p, n in zip(reply.present, reply.num_tokens, strict=True)]

    def stats(self) -> pb.StatsReply:
        """The daemon's counts: entries, bytes, leases, sessions, hits (``StatsReply``)."""
        return self._call(self.stub.Stats, pb.StatsRequest())

    # Admin calls need the admin token. Those of keys take any number, in calls of MAX_BATCH
    # keys each; ``tenant``: whose keys they are ("": the shared namespace's; tenants.py).

    def evict(self, keys: Sequence[bytes], tenant: str = "") -> pb.EvictReply:
        """Evict entries now (a leased one is counted busy, and stays).

        Raises:
            Forbidden: not the admin token (or the daemon has none). NotFound: no such tenant.
        """
        total = pb.EvictReply()
        for batch in _batches(keys):
            reply = self._call(self.stub.Evict, pb.EvictRequest(keys=batch, tenant=tenant))
            total.evicted += reply.evicted
            total.busy += reply.busy
        return total

    def clear(self) -> pb.ClearReply:
        """Evict every entry that is not leased, of every tenant.

        Raises:
            Forbidden: not the admin token (or the daemon has none).
        """
        return self._call(self.stub.Clear, pb.ClearRequest())

    def pin(self, keys: Sequence[bytes], tenant: str = "") -> int:
        """Pin entries; each call of MAX_BATCH keys is all or nothing.

        Raises:
            NotFound: a key with no entry (nothing of its batch changed), or no such tenant.
            Forbidden: not the admin token (or the daemon has none).
        """
        return self._set_pinned(self.stub.Pin, keys, tenant)

    def unpin(self, keys: Sequence[bytes], tenant: str = "") -> int:
        """Unpin entries, as ``pin`` pins them (raising as it does)."""
        return self._set_pinned(self.stub.Unpin, keys, tenant)

    def _set_pinned(self, method: Any, keys: Sequence[bytes], tenant: str) -> int:
        """Entries whose pin changed, over calls of MAX_BATCH keys."""
        return sum(
            int(self._call(method, pb.PinRequest(keys=batch, tenant=tenant)).changed)
            for batch in _batches(keys)
        )

    def undrain(self) -> bool:
        """Serve reads and writes again after a drain; whether it was draining.

        Raises:
            Forbidden: not the admin token (or the daemon has none).
        """
        return bool(self._call(self.stub.Undrain, pb.UndrainRequest()).was_draining)

    def drain(self, timeout: float = 0.0) -> int:
        """Refuse new reads and writes, and wait up to ``timeout`` s (0: the daemon's own)
        for the leases held to end; how many are left.

        Raises:
            Forbidden: not the admin token (or the daemon has none).
        """
        reply = self._call(
            self.stub.Drain,
            pb.DrainRequest(timeout_ms=int(timeout * 1000)),
            timeout=timeout + self.timeout,
        )
        return int(reply.leases_left)

    # Writes -------------------------------------------------------------------------------

    def put(
        self,
        key: bytes,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        virtual_start: int,
        entry_kind: str = "chunk",
    ) -> bool:
        """Store one segment's KV ([layers, tokens, kv_heads, head_dim]; values None for an
        MLA latent). False if the key is stored (or being stored) already.

        Raises:
            LayoutError: tensors that do not make an entry.
            Exhausted: no room in the pool (``PoolFull``), or over the tenant's quota.
            WrongState: the daemon is draining.
            StoreError: another refusal, or the daemon cannot be reached (``Unavailable``).
        """
        return self.put_checksummed(key, keys, values, virtual_start, entry_kind) is not None

    def put_checksummed(
        self,
        key: bytes,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        virtual_start: int,
        entry_kind: str = "chunk",
        hold: float = 0.0,
    ) -> int | None:
        """``put``, returning the checksum the daemon committed the entry under (what a
        lease on it carries), or None if the key is stored (or being stored) already.
        ``hold`` > 0: the daemon keeps the entry from eviction until its first read, or
        for ``hold`` seconds (at most its lease TTL; not where held entries would pass half
        its pool): for a prompt sent only to store its chunks for a request that follows.

        Raises: as ``put``.
        """
        layout = layout_of(keys, values, virtual_start, entry_kind)
        tensors = [keys] + ([values] if values is not None else [])
        return self._put(key, layout, tensors, hold)

    def put_packed(
        self, key: bytes, layout: EntryLayout, blocks: torch.Tensor, hold: float = 0.0
    ) -> bool:
        """Store an entry held as a serving engine's cache blocks (``layout.packing`` names
        their layout; ``blocks``: exactly ``layout.nbytes`` bytes, in the stored dtype);
        ``hold``: as ``put_checksummed``'s.

        Raises:
            InvalidRequest: a layout with no packing, or blocks that do not hold it.
            Exhausted, WrongState, StoreError: as ``put``.
        """
        if not layout.packing:
            raise InvalidRequest("put_packed needs a layout with a packing")
        layout.validate()
        nbytes = blocks.numel() * blocks.element_size()
        if blocks.dtype != torch_dtype(layout.dtype) or nbytes != layout.nbytes:
            raise InvalidRequest(f"{nbytes} bytes of {blocks.dtype} do not hold layout {layout}")
        return self._put(key, layout, [blocks], hold) is not None

    def _put(
        self, key: bytes, layout: EntryLayout, tensors: list[torch.Tensor], hold: float = 0.0
    ) -> int | None:
        transport = self._session.transport
        outgoing = transport.stage(tensors)
        try:
            reply = self._session.call(
                self.stub.Reserve,
                lambda session: pb.ReserveRequest(
                    session_id=session,
                    key=key,
                    layout=layout_to_proto(layout),
                    nbytes=layout.nbytes,
                ),
                retry=True,
            )
        except AlreadyExists:
            return None
        session = self.session  # the reservation's
        if self._session.transport is not transport:  # reserved in a reopened session's pool
            transport = self._session.transport
            outgoing = transport.stage(tensors)
        try:
            transport.write(session, reply, outgoing)
            checksum = outgoing.digest.intdigest()
            self._session.call(
                self.stub.Commit,
                lambda _: pb.CommitRequest(
                    session_id=session,
                    reservation_id=reply.reservation_id,
                    checksum=checksum,
                    hold_ms=min(round(hold * 1000), 0xFFFFFFFF),
                ),
                retry=False,
            )
        except BaseException:
            with contextlib.suppress(StoreError):  # already gone: a failed commit aborts it
                self._call(
                    self.stub.Abort,
                    pb.AbortRequest(session_id=session, reservation_id=reply.reservation_id),
                )
            raise
        return checksum

    # Reads --------------------------------------------------------------------------------

    def acquire(
        self,
        keys: Sequence[bytes],
        num_tokens: Sequence[int] = (),
        entry_kind: str = "chunk",
        summed: bool = False,
    ) -> list[LeasedEntry | None]:
        """Leases on the keys' entries (None where absent). Release them when done.
        ``num_tokens`` (one per key) makes the daemon count this as a lookup too, of
        ``entry_kind`` entries. ``summed``: each lease carries a fresh secret key and its
        entry's keyed sums under it too (``LeasedEntry.summed``, ``keyed_digest``), which
        parts of it read apart (``read_runs``) are checked against; the daemon adds them up
        at each such lease, in a pass over the bytes that checks them (an entry that fails
        is evicted: None).

        Raises:
            InvalidRequest: a malformed key, or over MAX_BATCH of them.
            WrongState: the daemon is draining.
        """
        reply = self._session.call(
            self.stub.Acquire,
            lambda session: pb.AcquireRequest(
                session_id=session,
                keys=list(keys),
                num_tokens=list(num_tokens),
                entry_kind=entry_kind,
                summed=summed,
            ),
            retry=True,
        )
        return [LeasedEntry.from_proto(lease) for lease in reply.leases]

    def release(self, lease_ids: Sequence[int], shm_bytes_read: int = 0, wait: bool = True) -> None:
        """End leases. ``shm_bytes_read``: bytes other clients copied out of the pool under
        them (see ``read_into``), for the daemon's transport metrics; reported even with no
        lease left to end (a request that finished before its readers reported).
        ``wait=False``: return at once where the fast path carries it (a round trip less
        per get: 0.21 ms of a 1 MiB get's ~0.33 here): the call goes out with this client's
        next call, or alone 2 ms later (``FastChannel.post``); its answer is read before
        the next call's, and a failure is logged, not raised; if the fast path fails first,
        gRPC carries it. What was read under the leases was checked already, so nothing
        depends on it.

        Raises:
            NotFound: a lease that is not held (it expired, or ended); ``SessionLost``: the
                session that held them is gone (a new one is open for the next call).
        """
        if not lease_ids and not shm_bytes_read:
            return
        shm_bytes = shm_bytes_read + sum(self._shm_reads.pop(i, 0) for i in lease_ids)

        def request(session: str) -> pb.ReleaseRequest:
            return pb.ReleaseRequest(
                session_id=session, lease_ids=list(lease_ids), shm_bytes_read=shm_bytes
            )

        if not wait and self._session.calls.post(self.stub.Release, request(self.session)):
            return
        self._session.call(self.stub.Release, request, retry=False)

    def get(self, key: bytes) -> StoredKV | None:
        """One entry's KV, checked against its checksum, or None if absent.

        Raises:
            ChecksumMismatch: the stored bytes are not those committed.
            LeaseLapsed: this process paused past the lease TTL while reading (try again).
            StoreError: as ``acquire`` and ``read_into``.
        """
        [entry] = self.acquire([key])
        if entry is None:
            return None
        try:
            buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
            self.read_into(entry, buffer)
        finally:
            self.release([entry.lease_id], wait=False)
        keys, values = tensors_of(buffer, entry.layout)
        return StoredKV(keys, values, entry.layout)
