"""``ChunkStoreClient``: the Python client of the daemon.

It opens a session (kept alive by a heartbeat stream, held by the daemon before the constructor
returns: if this process dies, the daemon drops its leases and reservations at once; if it is
paused, the session waits for it), then moves bytes the cheapest way it can: straight
through the shared-memory pool when it can map it (same host), else over the gRPC streams.
Every read is checked against the checksum stored at commit; a mismatch raises
ChecksumMismatch and the bytes are never returned.

What lies beneath is ``chunkstore/transport/``: the calls (gRPC, the fast path), the
session, and the transport the session's bytes move over, chosen when it opens.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from chunkstore.errors import (
    AlreadyExists,
    ChecksumMismatch,
    InvalidRequest,
    LeaseLapsed,
    StoreError,
)
from chunkstore.kv.entry import EntryLayout, layout_of, tensors_of, torch_dtype
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import streamcopy
from chunkstore.protocol.convert import layout_to_proto
from chunkstore.protocol.endpoints import default_address as default_address  # re-exported
from chunkstore.protocol.keyed_digest import packed
from chunkstore.protocol.shm import (
    Pieces as Pieces,  # re-exported: where read_each puts an entry in pieces
)
from chunkstore.protocol.wire import MAX_BATCH
from chunkstore.transport.base import Digest, Reads, Settings, TransportName, Wanted
from chunkstore.transport.base import LeasedEntry as LeasedEntry  # re-exported
from chunkstore.transport.base import as_bytes as as_bytes  # re-exported
from chunkstore.transport.calls import DaemonCalls, open_channel
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


class ChunkStoreClient:
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
    ) -> int | None:
        """``put``, returning the checksum the daemon committed the entry under (what a
        lease on it carries), or None if the key is stored (or being stored) already.

        Raises: as ``put``.
        """
        layout = layout_of(keys, values, virtual_start, entry_kind)
        return self._put(key, layout, [keys] + ([values] if values is not None else []))

    def put_packed(self, key: bytes, layout: EntryLayout, blocks: torch.Tensor) -> bool:
        """Store an entry held as a serving engine's cache blocks (``layout.packing`` names
        their layout; ``blocks``: exactly ``layout.nbytes`` bytes, in the stored dtype).

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
        return self._put(key, layout, [blocks]) is not None

    def _put(self, key: bytes, layout: EntryLayout, tensors: list[torch.Tensor]) -> int | None:
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
                    session_id=session, reservation_id=reply.reservation_id, checksum=checksum
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

    def read_into(self, entry: LeasedEntry, out: torch.Tensor, session: str | None = None) -> None:
        """Copy a leased entry's bytes into ``out`` (uint8, nbytes long; on the CPU, or on the
        pool's device with a device pool) and check them.

        ``session``: the session holding the lease when another client took it (the vLLM
        scheduler leases, its workers read); that client reports the shared-memory bytes
        when it releases.

        Raises:
            ChecksumMismatch: the bytes are not those committed (do not use ``out``);
                ``LeaseLapsed`` where the lease ended before they were read.
            InvalidRequest, NotFound, StoreError: as ``read_each``.
        """
        self.read_many([entry], [out], session)

    def read_many(
        self,
        entries: Sequence[LeasedEntry],
        outs: Sequence[torch.Tensor],
        session: str | None = None,
    ) -> None:
        """``read_into`` of several leased entries at once: through the pool their stripes
        are shared out over ``copy_threads``, so 64 small entries copy side by side as one
        large one does. Every entry is checked; the first that fails raises
        ``ChecksumMismatch`` (the others were copied and checked).

        Raises:
            ChecksumMismatch: the first entry whose bytes are not those committed
                (``LeaseLapsed``: its lease had ended).
            InvalidRequest, NotFound, StoreError: as ``read_each``.
        """
        for failure in self.read_each(entries, outs, session):
            if failure is not None:
                raise failure

    def read_each(
        self,
        entries: Sequence[LeasedEntry],
        outs: Sequence[torch.Tensor | Pieces],
        session: str | None = None,
        threads: int | None = None,
        helper: Executor | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[StoreError | None]:
        """``read_many``, with a verdict per entry instead of raising the first: None where
        the entry was read and checked, the ``ChecksumMismatch`` where it was not (use none
        of its bytes), ``LeaseLapsed`` where its lease had ended by then (the blocks may
        hold another entry now). An out may be ``Pieces`` (uint8 arrays whose lengths add up to the
        entry's, in the order of its bytes: a cache's blocks), filled straight from a
        shared-memory pool (through a buffer otherwise). ``threads``: this read's copy
        threads (``copy_threads`` when None); ``helper``: where the second one runs
        (``shm.gather_many``). ``progress(n)``: every entry's first n bytes are in its out,
        not yet checked (stripe by stripe from a mapped pool, all at the end otherwise); the
        verdicts come after the last call.

        Raises:
            InvalidRequest: an out that is not a contiguous uint8 tensor (or pieces) of its
                entry's length, or not one out an entry.
            NotFound: over the stream, a lease that ended (``SessionLost``: its session).
            ChecksumMismatch: over the stream, fewer bytes than the entry's.
            StoreError: the daemon cannot be reached (``Unavailable``).
        """
        reads = Reads(
            entries, outs, session or self.session, threads or self.copy_threads, helper, progress
        )
        transport = self._session.transport
        digests = transport.read(reads)
        if transport.reports_reads and session is None:  # the daemon's shm byte counter
            for entry in entries:
                read = self._shm_reads.get(entry.lease_id, 0)
                self._shm_reads[entry.lease_id] = read + entry.nbytes
        if progress is not None and entries:
            progress(max(e.nbytes for e in entries))
        return [
            self._verdict(e, digest, reads.session)
            for e, digest in zip(entries, digests, strict=True)
        ]

    def read_spans(
        self,
        entry: LeasedEntry,
        spans: Sequence[tuple[int, int]],
        digests: Sequence[int],
        out: torch.Tensor,
        session: str | None = None,
    ) -> StoreError | None:
        """Part of a leased entry: its byte ``spans`` ([lo, hi) each, in the entry) copied
        into ``out`` one after another, each checked against its digest in ``digests``
        (xxh3-64: the entry's block digests, ``kv.sparse.EntryBlocks``) instead of the
        entry's checksum, which needs every byte. None where every span was read and
        checked; else the ``ChecksumMismatch`` (use none of ``out``: the pool's bytes, or the
        digests, are not the entry's) or the ``LeaseLapsed``. From the mapped pool only.
        ``session``: as ``read_into``'s.

        Raises:
            InvalidRequest: ``out`` is not a contiguous uint8 tensor of the spans' length, a
                span lies outside the entry, or the transport is not the mapped pool.
        """
        if len(spans) != len(digests):
            raise InvalidRequest(f"{len(spans)} spans to check against {len(digests)} digests")
        if any(not 0 <= lo <= hi <= entry.nbytes for lo, hi in spans):
            raise InvalidRequest(f"a span outside entry {entry.key.hex()} ({entry.nbytes} bytes)")
        total = sum(hi - lo for lo, hi in spans)
        if out.dtype != torch.uint8 or out.numel() != total or not out.is_contiguous():
            raise InvalidRequest(f"read {total} bytes into a contiguous uint8 tensor of as many")
        transport = self._session.transport
        actual = transport.read_spans(entry, spans, out.numpy())
        if transport.reports_reads and session is None:
            self._shm_reads[entry.lease_id] = self._shm_reads.get(entry.lease_id, 0) + total
        bad = [i for i, (a, b) in enumerate(zip(actual, digests, strict=True)) if a != b]
        if not bad:
            return None
        if self._report_corrupt(entry, session or self.session):
            return LeaseLapsed(
                f"the lease on entry {entry.key.hex()} ended before its bytes were read: not used"
            )
        lo, hi = spans[bad[0]]
        return ChecksumMismatch(
            f"entry {entry.key.hex()}: {len(bad)} of {len(spans)} spans (the first bytes "
            f"[{lo}, {hi})) are not what its block digests say: not used"
        )

    def read_runs(
        self,
        entry: LeasedEntry,
        starts: torch.Tensor,
        length: int,
        out: torch.Tensor,
        session: str | None = None,
    ) -> torch.Tensor:
        """Part of a leased entry: its runs of ``length`` bytes at ``starts`` (int64)
        gathered into ``out`` (uint8, one after another; on the device pool's device, else
        the CPU), straight from a pool, or gathered by the daemon over the stream. Returns
        their two keyed sums under the lease's key (``device_ipc.keyed_run_sums``, on
        ``out``'s device):
        nothing is checked here; the sums of parts that together hold every byte of the
        entry once (read by several processes: context-parallel ranks) are checked by
        ``check_sums``. Do not use ``out`` before. ``session``: as ``read_into``'s.

        Raises:
            InvalidRequest: the lease was not taken ``summed`` (nothing to check the parts
                against), a run lies outside the entry, or ``out`` is not a contiguous uint8
                tensor of the runs' length on the device named.
            NotFound, StoreError: over the stream, as ``read_each``'s.
            ChecksumMismatch: over the stream, not as many bytes as the runs'.
        """
        transport = self._session.transport
        if entry.summed is None:
            entry.sum_tables()  # raises: nothing to check the parts against
        inside = not starts.numel() or (
            int(starts.min()) >= 0 and int(starts.max()) + length <= entry.nbytes
        )
        if length < 1 or not inside:
            raise InvalidRequest(f"a run outside entry {entry.key.hex()} ({entry.nbytes} bytes)")
        if out.dtype != torch.uint8 or out.numel() != starts.numel() * length:
            raise InvalidRequest("read into a uint8 tensor of the runs' length")
        where = self.device_pool.device if self.device_pool is not None else torch.device("cpu")
        if out.device != where or not out.is_contiguous():
            raise InvalidRequest(f"read into a contiguous tensor on {where}, where the pool is")
        sums = transport.read_runs(entry, starts.to(where), length, out, session or self.session)
        if transport.reports_reads and session is None:
            self._shm_reads[entry.lease_id] = self._shm_reads.get(entry.lease_id, 0) + out.numel()
        return sums

    def check_sums(
        self, entry: LeasedEntry, sums: Sequence[int], session: str | None = None
    ) -> StoreError | None:
        """Whether the keyed sums of every byte of a leased entry, added up from its parts
        (``read_runs``; in any range, reduced here), are those its summed lease vouches for:
        None if so, else as ``read_each``'s verdicts (the daemon is told)."""
        if entry.summed is None:
            entry.sum_tables()  # raises: nothing to check the parts against
        assert entry.summed is not None
        return self._verdict(entry, packed(sums), session, packed(entry.summed.sums))

    def _verdict(
        self,
        entry: LeasedEntry,
        digest: Digest | int,
        session: str | None = None,
        expected: int | None = None,
    ) -> StoreError | None:
        """None if the bytes read are those committed (their digest is ``expected``, the
        entry's checksum by default); else the daemon is told, and why."""
        actual = digest if isinstance(digest, int) else digest.intdigest()
        session = session or self.session
        expected = entry.checksum if expected is None else expected
        if actual == expected:
            return None
        if self._report_corrupt(entry, session):
            return LeaseLapsed(
                f"the lease on entry {entry.key.hex()} ended before its bytes were read (its "
                "holder paused or stalled past the lease TTL): not used"
            )
        return ChecksumMismatch(
            f"entry {entry.key.hex()} hashes to {actual:#x}, committed as {expected:#x}: not used"
        )

    def _report_corrupt(self, entry: LeasedEntry, session: str) -> bool:
        """Have the daemon check the entry itself: if its pool bytes are bad it evicts it,
        so the next put replaces it (best effort: the read fails either way). Whether the
        lease read under had lapsed by then: the blocks may have gone to another entry."""
        key = entry.key
        request = pb.VerifyRequest(keys=[key], session_id=session, lease_ids=[entry.lease_id])
        try:
            reply = self._call(self.stub.Verify, request)
        except StoreError as err:
            log.warning("could not report entry %s as corrupt: %s", key.hex(), err)
            return False
        if reply.corrupt:
            log.error("entry %s was corrupt in the pool; the daemon evicted it", key.hex())
        return bool(reply.lapsed)

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
