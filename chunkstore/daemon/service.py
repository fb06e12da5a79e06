"""The gRPC service of ``chunkstore serve``: requests become index and pool calls, typed
errors become status codes. Who the caller is comes resolved (``auth``); the process around
it is ``server``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from chunkstore import __version__
from chunkstore.daemon.config import ServeConfig
from chunkstore.daemon.index import Index
from chunkstore.daemon.metrics import Metrics
from chunkstore.daemon.pool import Pool
from chunkstore.daemon.records import Entry, check_keys
from chunkstore.daemon.tenants import (
    PEER_CALLER,
    SHARED,
    SHARED_CALLER,
    SHARED_LABEL,
    Caller,
    Tenants,
    tenant_key,
)
from chunkstore.daemon.transfer import Endpoint
from chunkstore.errors import (
    Busy,
    Forbidden,
    InvalidRequest,
    LeaseLapsed,
    NotFound,
    SessionLost,
    StoreError,
    Unauthenticated,
)
from chunkstore.kv.entry import EntryKind, check_entry_kind
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.convert import add_summed, layout_from_proto, lease_to_proto
from chunkstore.protocol.shm import block_runs
from chunkstore.protocol.wire import MAX_BATCH, MAX_MESSAGE, MAX_RUNS, status_of

if TYPE_CHECKING:
    from chunkstore.daemon.auth import TokenCheck

log = logging.getLogger("chunkstore.serve")


READ_PIECE = 1 << 20
MIN_READ_PIECE = 16 << 10  # a floor: 1-byte pieces made a 64 KiB entry 65,536 messages


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """Time the call, and answer a typed error with its status code."""
    name = method.__name__

    @functools.wraps(method)
    def unary(self: ChunkStoreService, request: Any, context: grpc.ServicerContext) -> Any:
        began = time.perf_counter()
        try:
            return method(self, request, context)
        except StoreError as err:
            self.metrics.errors.labels(err.code).inc()
            context.abort(*status_of(err))
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - began)

    return unary


def _rpc_stream(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    name = method.__name__

    @functools.wraps(method)
    def streaming(
        self: ChunkStoreService, request: Any, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        began = time.perf_counter()
        try:
            yield from method(self, request, context)
        except StoreError as err:
            self.metrics.errors.labels(err.code).inc()
            context.abort(*status_of(err))
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - began)

    return streaming


def _keys(keys: Sequence[bytes]) -> list[bytes]:
    """A call's keys, checked before anything is done with them (a tenant's are hashed into
    its namespace: 1M keys cost a second of daemon CPU before the index refused them, and a
    malformed key found after the good ones were leased left those leases behind)."""
    check_keys(keys)
    return list(keys)


def _token_counts(request: pb.LookupRequest | pb.AcquireRequest) -> tuple[list[int], str]:
    """The optional per-key token counts of a lookup, checked against its keys, and the
    kind of entry it looks up (checked: before any lease is taken)."""
    tokens = list(request.num_tokens)
    if tokens and len(tokens) != len(request.keys):
        raise InvalidRequest(f"{len(tokens)} token counts for {len(request.keys)} keys")
    kind = request.entry_kind or EntryKind.CHUNK
    check_entry_kind(kind)
    return tokens, kind


class ChunkStoreService(pb_grpc.ChunkStoreServicer):
    def __init__(
        self,
        config: ServeConfig,
        index: Index,
        pool: Pool,
        metrics: Metrics,
        on_drain: Callable[[bool], None] = lambda draining: None,
    ) -> None:
        self.config = config
        self.index = index
        self.pool = pool
        self.metrics = metrics
        self.on_drain = on_drain
        # The cluster directory's: keys missed, and the tenant whose namespace they are in.
        self.on_miss: Callable[[list[bytes], str], None] | None = None
        self.tenants: Tenants | None = None  # --tenants: who each token is
        self.token_check: TokenCheck | None = None  # resolves a token to its caller
        self.transfer: Endpoint | None = None  # where peers read the pool with an engine
        self.fast_socket = ""  # the fast path's socket (protocol/fast.py)
        self._transfers = threading.BoundedSemaphore(config.max_transfers)

    @contextlib.contextmanager
    def _transfer_slot(self) -> Iterator[None]:
        """One of ``max_transfers`` Read / Write streams, or Busy: each holds a server thread
        for as long as it streams, and threads must be left for everything else."""
        if not self._transfers.acquire(blocking=False):
            raise Busy(
                f"{self.config.max_transfers} Read / Write streams are in progress, the most "
                "--max-transfers allows; retry, or map the pool (same host)"
            )
        try:
            yield
        finally:
            self._transfers.release()

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        """Who the call's bearer token says its caller is, resolved once per call by the
        token check (``_Resolved``); the fast path's calls are resolved here, after its own
        check. Everyone shares one namespace without --tenants."""
        resolved = getattr(context, "caller", None)
        if isinstance(resolved, Caller):
            return resolved
        if self.tenants is None or self.token_check is None:
            return SHARED_CALLER
        bearer = dict(context.invocation_metadata() or ()).get("authorization")
        caller = self.token_check.caller(bearer)
        if caller is None:  # e.g. its tenant was removed by a reload since the check
            raise Unauthenticated("missing or wrong bearer token")
        return caller

    def _session_caller(self, context: grpc.ServicerContext, session_id: str) -> Caller:
        """The caller, if the session is its own: another's is answered as no session at
        all (the index's own words), so a session id learns nothing."""
        caller = self._caller(context)
        if self.index.session_owner(session_id) != caller.owner:  # None: no such session
            raise SessionLost(f"no session {session_id!r}: call Hello first (or it expired)")
        return caller

    @_rpc
    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloReply:
        caller = self._caller(context)
        session = self.index.open_session(request.client_name or context.peer(), caller.owner)
        return pb.HelloReply(
            session_id=session,
            version=__version__,
            shm_path=self.pool.shm_path,
            block_size=self.pool.block_size,
            num_blocks=self.pool.num_blocks,
            device=self.pool.device,
            hostname=self.config.node,
            lease_ttl_ms=int(self.config.lease_ttl_s * 1000),
            transfer=self.transfer.to_proto() if self.transfer else None,
            fast_socket=self.fast_socket,
            device_pool=handle.to_proto() if (handle := self.pool.ipc_handle) else None,
        )

    def Heartbeat(
        self, request_iterator: Iterator[pb.Ping], context: grpc.ServicerContext
    ) -> Iterator[pb.Pong]:
        """The session lives as long as this stream: when it ends (the client closed or
        died), its leases and reservations go at once."""
        session: list[str] = []

        def end() -> None:
            for s in session:
                self.index.end_session(s)

        context.add_callback(end)
        try:
            for ping in request_iterator:
                if not session:
                    self._session_caller(context, ping.session_id)
                    self.index.attach_stream(ping.session_id, ping.holds_pool)
                    session.append(ping.session_id)
                self.index.renew(ping.session_id)
                yield pb.Pong(server_time_ms=int(time.time() * 1000))
        except StoreError as err:
            context.abort(*status_of(err))
        finally:
            end()

    def _missed(self, keys: list[bytes], found: Sequence[object | None], tenant: str) -> None:
        if self.on_miss is not None:
            missing = [k for k, got in zip(keys, found, strict=True) if got is None]
            if missing:
                self.on_miss(missing, tenant)

    def _find(
        self,
        caller: Caller,
        keys: list[bytes],
        find: Callable[[list[bytes], str], list[Any]],
        want: bool = True,
    ) -> list[Any]:
        """``find(keys, tenant)`` in the caller's namespace, then, for what it missed, in the
        shared one where the caller reads it; the misses wanted from peers in both
        (``want``)."""
        missed = self._missed if want else lambda *_: None
        own = caller.own_keys(keys)
        found = find(own, caller.namespace)
        missed(own, found, caller.namespace)
        if caller.reads_shared:
            misses = [i for i, got in enumerate(found) if got is None]
            shared = [keys[i] for i in misses]
            if shared:
                for i, got in zip(misses, find(shared, SHARED), strict=True):
                    found[i] = got
                missed(shared, [found[i] for i in misses], SHARED)
        return found

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
        caller = self._caller(context)
        keys = _keys(request.keys)
        tokens, kind = _token_counts(request)
        found = self._find(
            caller, keys, lambda ks, tenant: self.index.lookup(ks, tenant), not request.probe
        )
        if not request.probe:
            self.index.count_hits([e is not None for e in found], tokens, kind, caller.namespace)
        return pb.LookupReply(
            present=[e is not None for e in found],
            num_tokens=[e.layout.num_tokens if e else 0 for e in found],
        )

    @_rpc
    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveReply:
        caller = self._session_caller(context, request.session_id)
        layout = layout_from_proto(request.layout)
        [key] = caller.own_keys(_keys([request.key]))
        reservation = self.index.reserve(
            request.session_id, key, layout, request.nbytes, caller.namespace
        )
        return pb.ReserveReply(
            reservation_id=reservation.id,
            blocks=reservation.blocks,
            block_size=self.pool.block_size,
        )

    @_rpc
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
        self._session_caller(context, request.session_id)
        reservation = self.index.reservation(request.session_id, request.reservation_id)
        streamed = reservation.written > 0
        entry = self.index.commit(
            request.session_id,
            request.reservation_id,
            request.checksum,
            streamed=streamed,
            hold=request.hold_ms / 1000,
        )
        if not streamed:
            self.metrics.bytes.labels("shm", "write").inc(entry.nbytes)
        return pb.CommitReply()

    @_rpc
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        self._session_caller(context, request.session_id)
        self.index.abort(request.session_id, request.reservation_id)
        return pb.AbortReply()

    @_rpc
    def Acquire(self, request: pb.AcquireRequest, context: grpc.ServicerContext) -> pb.AcquireReply:
        caller = self._session_caller(context, request.session_id)
        tokens, kind = _token_counts(request)
        keys = _keys(request.keys)
        session = request.session_id
        if request.tenant:  # a peer's pull names the tenant whose entry it wants
            if caller != PEER_CALLER:  # asked first: a client learns nothing of names
                raise Forbidden("only a pulling peer names a tenant: a client's token says it")
            if self.tenants is None or not self.tenants.knows(request.tenant):
                raise Forbidden(f"tenant {request.tenant!r} is unknown here")
        if caller == PEER_CALLER:  # the keys as this daemon holds them, of the named tenant
            acquired = self.index.acquire(session, keys, request.tenant)
            namespace = request.tenant
        else:
            acquired = self._find(
                caller, keys, lambda ks, tenant: self.index.acquire(session, ks, tenant)
            )
            namespace = caller.namespace
        if tokens:  # an Acquire with token counts is a lookup too (the connector's)
            self.index.count_hits([got is not None for got in acquired], tokens, kind, namespace)
        reply = pb.AcquireReply(block_size=self.pool.block_size)
        for key, got in zip(keys, acquired, strict=True):
            message = reply.leases.add()
            if got is None:
                continue
            lease, entry = got
            summed = self.index.summed(lease) if request.summed else None
            if request.summed and summed is None:  # not the committed bytes: evicted
                continue
            if entry.lease_message is None:  # a copy of it costs a quarter of making it
                entry.lease_message = lease_to_proto(
                    entry.layout, entry.nbytes, entry.blocks, entry.checksum
                )
            message.CopyFrom(entry.lease_message)
            message.lease_id = lease.id
            message.key = key  # as the caller named it
            if summed is not None:
                add_summed(message, summed)
        return reply

    @_rpc
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        self._session_caller(context, request.session_id)
        self.index.release(request.session_id, list(request.lease_ids))
        if request.shm_bytes_read:
            self.metrics.bytes.labels("shm", "read").inc(request.shm_bytes_read)
        return pb.ReleaseReply()

    @_rpc
    def Write(
        self, request_iterator: Iterator[pb.WritePiece], context: grpc.ServicerContext
    ) -> pb.WriteReply:
        with self._transfer_slot():
            return self._write(request_iterator, context)

    def _write(
        self, request_iterator: Iterator[pb.WritePiece], context: grpc.ServicerContext
    ) -> pb.WriteReply:
        session, reservation_id, total = "", 0, 0
        for piece in request_iterator:
            if not session:
                session, reservation_id = piece.session_id, piece.reservation_id
                self._session_caller(context, session)
            data = np.frombuffer(piece.data, dtype=np.uint8)
            with self.index.lock:  # the reservation cannot expire mid-copy
                reservation = self.index.reservation(session, reservation_id)
                if reservation.written + data.shape[0] > reservation.nbytes:
                    raise InvalidRequest(
                        f"reservation {reservation_id} holds {reservation.nbytes} bytes; "
                        f"{reservation.written + data.shape[0]} were sent"
                    )
                self.pool.scatter(reservation.blocks, data, offset=reservation.written)
                reservation.written += data.shape[0]
            total += data.shape[0]
            self.metrics.bytes.labels("grpc", "write").inc(data.shape[0])
        return pb.WriteReply(nbytes=total)

    @_rpc_stream
    def Read(
        self, request: pb.ReadRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReadPiece]:
        self._session_caller(context, request.session_id)
        with self._transfer_slot():
            yield from self._read(request)

    def _read(self, request: pb.ReadRequest) -> Iterator[pb.ReadPiece]:
        entry: Entry = self.index.lease(request.session_id, request.lease_id)
        piece = request.piece_bytes or READ_PIECE
        if not MIN_READ_PIECE <= piece <= MAX_MESSAGE // 2:
            raise InvalidRequest(
                f"piece_bytes {piece}: between {MIN_READ_PIECE} and {MAX_MESSAGE // 2} (0: default)"
            )
        if request.run_starts or request.run_bytes:
            data = self._runs(entry, request)
            self.metrics.bytes.labels("grpc", "read").inc(len(data))
            for lo in range(0, len(data), piece):
                yield pb.ReadPiece(data=data[lo : lo + piece].tobytes())
            return
        bs = self.pool.block_size
        remaining = entry.nbytes
        for first, count, _ in block_runs(entry.blocks):
            start = first * bs
            end = start + min(count * bs, remaining)
            for lo in range(start, end, piece):
                hi = min(lo + piece, end)
                # Each piece copied under the lease, checked again: the reader may have
                # paused (flow control parks this generator) past its TTL, and the blocks
                # gone to another entry since the last piece.
                with self.index.lock:
                    self._still_leased(request, entry.nbytes - remaining + lo - start)
                    copied = self.pool.read(lo, hi)
                self.metrics.bytes.labels("grpc", "read").inc(hi - lo)
                yield pb.ReadPiece(data=copied)
            remaining -= end - start

    def _still_leased(self, request: pb.ReadRequest, sent: int) -> None:
        """LeaseLapsed where the read's lease ended after it began (``sent``: the bytes
        read by then)."""
        try:
            self.index.lease(request.session_id, request.lease_id)
        except NotFound:
            raise LeaseLapsed(
                f"lease {request.lease_id} ended after {sent} bytes of its Read (its holder "
                "paused past the lease TTL with no heartbeat, or released it): acquire the "
                "entry again"
            ) from None

    def _runs(self, entry: Entry, request: pb.ReadRequest) -> np.ndarray:
        """The runs a ``Read`` names, gathered: at most ``MAX_RUNS`` of them (counted before
        they become arrays), together at most the entry's bytes, each inside it (a part
        read many times over is refused)."""
        if len(request.run_starts) > MAX_RUNS:
            raise InvalidRequest(
                f"{len(request.run_starts)} runs in one Read; at most {MAX_RUNS} (split them "
                "over several Reads of the lease)"
            )
        starts, length = np.asarray(request.run_starts, dtype=np.uint64), request.run_bytes
        if length < 1 or len(starts) * length > entry.nbytes:
            raise InvalidRequest(
                f"{len(starts)} runs of {length} bytes: at least one byte a run, and no more "
                f"than the entry's {entry.nbytes} bytes in all"
            )
        if len(starts) and int(starts.max()) > entry.nbytes - length:
            raise InvalidRequest(f"a run outside the entry ({entry.nbytes} bytes)")
        data = self.pool.gather_runs(entry.blocks, starts.astype(np.int64), length)
        # Still held after the gather, so held throughout (an ended lease's blocks are freed
        # only as it ends); not gathered under the lock: up to the entry's bytes, where a
        # stream's piece is at most half a message.
        self._still_leased(request, 0)
        return data

    @_rpc
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        caller = self._caller(context)
        s = self.index.stats()
        tenants = {
            tenant or SHARED_LABEL: pb.TenantStats(**counts) for tenant, counts in s.tenants.items()
        }
        if self.tenants is not None and not caller.admin:
            # Its own namespace's figures only: the rest tells what others do. A tenant's, or
            # the shared namespace's for a --token client.
            name = caller.tenant.name if caller.tenant is not None else SHARED_LABEL
            return pb.StatsReply(tenants={name: tenants.get(name, pb.TenantStats())})
        return pb.StatsReply(
            entries=s.entries,
            pinned_entries=s.pinned_entries,
            bytes_used=s.bytes_used,
            bytes_capacity=s.bytes_capacity,
            blocks_free=s.blocks_free,
            blocks_total=s.blocks_total,
            active_leases=s.active_leases,
            active_reservations=s.active_reservations,
            sessions=s.sessions,
            pool_importers=s.pool_importers,
            lookups=s.lookups,
            hits=s.hits,
            lookup_tokens=s.lookup_tokens,
            hit_tokens=s.hit_tokens,
            evictions=s.evictions,
            draining=s.draining,
            blocks_quarantined=s.blocks_quarantined,
            kinds={kind: pb.KindStats(**counts) for kind, counts in s.kinds.items()},
            disk=pb.DiskStats(**dataclasses.asdict(s.disk)) if s.disk else None,
            tenants=tenants,
        )

    @_rpc
    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyReply:
        keys = _keys(request.keys)
        own = self._caller(context).own_keys(keys)
        lapsed = list(request.lease_ids)
        if len(lapsed) > MAX_BATCH:
            raise InvalidRequest(f"{len(lapsed)} leases in one call; at most {MAX_BATCH}")
        if lapsed:
            with contextlib.suppress(SessionLost):  # a lost session held nothing any more
                self._session_caller(context, request.session_id)
                lapsed = self.index.lapsed(request.session_id, lapsed)
        corrupt = set(self.index.verify(own))
        for key in corrupt:
            log.error("entry %s failed its checksum in the pool: evicted", key.hex())
        return pb.VerifyReply(
            corrupt=[k for k, o in zip(keys, own, strict=True) if o in corrupt], lapsed=lapsed
        )

    def _admin_keys(self, tenant: str, keys: Sequence[bytes]) -> list[bytes]:
        """An admin call's keys as the index holds them in ``tenant``'s namespace."""
        if tenant and (self.tenants is None or not self.tenants.knows(tenant)):
            raise NotFound(f"no tenant {tenant!r} in the tenants file")
        secret = self.tenants.secret if self.tenants is not None else b""
        return [tenant_key(tenant, k, secret) for k in keys]

    @_rpc
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictReply:
        evicted, busy = self.index.evict(self._admin_keys(request.tenant, request.keys))
        return pb.EvictReply(evicted=evicted, busy=busy)

    @_rpc
    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearReply:
        evicted, busy = self.index.clear()
        return pb.ClearReply(evicted=evicted, busy=busy)

    @_rpc
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinReply:
        keys = self._admin_keys(request.tenant, request.keys)
        return pb.PinReply(changed=self.index.set_pinned(keys, True))

    @_rpc
    def Unpin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinReply:
        keys = self._admin_keys(request.tenant, request.keys)
        return pb.PinReply(changed=self.index.set_pinned(keys, False))

    @_rpc
    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainReply:
        timeout = request.timeout_ms / 1000 if request.timeout_ms else self.config.drain_timeout_s
        self.on_drain(True)  # readiness fails first, so no new traffic is sent here
        return pb.DrainReply(leases_left=drain(self.index, timeout))

    @_rpc
    def Undrain(self, request: pb.UndrainRequest, context: grpc.ServicerContext) -> pb.UndrainReply:
        was = self.index.stop_draining()
        self.on_drain(False)
        if was:
            log.warning("undrained: serving reads and writes again")
        return pb.UndrainReply(was_draining=was)


def drain(index: Index, timeout: float) -> int:
    """Refuse new reads and writes, then wait (bounded) for held leases to be released."""
    index.start_draining()
    deadline = time.monotonic() + timeout
    while index.stats().active_leases and time.monotonic() < deadline:
        time.sleep(0.05)
    return index.stats().active_leases
