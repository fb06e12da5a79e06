"""``chunkstore serve``: the gRPC daemon. It owns nothing but the translation between the wire
and the index and pool: requests become index calls, typed errors become status codes."""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import json
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from chunkstore import __version__
from chunkstore.daemon.config import ServeConfig
from chunkstore.daemon.disk import DiskTier
from chunkstore.daemon.fastpath import FastPath
from chunkstore.daemon.index import Budget, Entry, Index, check_keys
from chunkstore.daemon.metrics import Metrics
from chunkstore.daemon.peers import EnginePeers, PeerSource, PeerTLS, StreamPeers
from chunkstore.daemon.pool import Pool, reclaim_stale_pools
from chunkstore.daemon.pool_factory import create_pool
from chunkstore.daemon.tenants import (
    ADMIN_CALLER,
    PEER_CALLER,
    SHARED,
    SHARED_CALLER,
    SHARED_LABEL,
    Caller,
    Tenant,
    Tenants,
    load_tenants,
    namespace_secret,
    tenant_key,
)
from chunkstore.daemon.transfer import Endpoint, MooncakeEngine
from chunkstore.daemon.workers import Workers
from chunkstore.errors import (
    Busy,
    Forbidden,
    InvalidRequest,
    NotFound,
    StoreError,
    Unauthenticated,
    Unavailable,
)
from chunkstore.kv.entry import check_entry_kind
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.fast import fast_socket_path
from chunkstore.protocol.shm import block_runs
from chunkstore.protocol.wire import MAX_MESSAGE, layout_from_proto, layout_to_proto

if TYPE_CHECKING:
    from chunkstore.daemon.directory import Directory

log = logging.getLogger("chunkstore.serve")

SERVICE = "chunkstore.v1.ChunkStore"
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
            context.abort(grpc.StatusCode[err.code], str(err))
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
            context.abort(grpc.StatusCode[err.code], str(err))
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
    kind = request.entry_kind or "chunk"
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
        self.token_check: _TokenCheck | None = None  # resolves a token to its caller
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
            raise NotFound(f"no session {session_id!r}: call Hello first (or it expired)")
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
            context.abort(grpc.StatusCode[err.code], str(err))
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
            request.session_id, request.reservation_id, request.checksum, streamed=streamed
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
        leases = []
        for key, got in zip(keys, acquired, strict=True):
            if got is None:
                leases.append(pb.Lease())
                continue
            lease, entry = got
            leases.append(
                pb.Lease(
                    lease_id=lease.id,
                    key=key,  # as the caller named it
                    layout=layout_to_proto(entry.layout),
                    nbytes=entry.nbytes,
                    blocks=entry.blocks,
                    checksum=entry.checksum,
                )
            )
        return pb.AcquireReply(leases=leases, block_size=self.pool.block_size)

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
        bs = self.pool.block_size
        remaining = entry.nbytes
        for first, count, _ in block_runs(entry.blocks):
            start = first * bs
            end = start + min(count * bs, remaining)
            for lo in range(start, end, piece):
                hi = min(lo + piece, end)
                self.metrics.bytes.labels("grpc", "read").inc(hi - lo)
                yield pb.ReadPiece(data=self.pool.read(lo, hi))
            remaining -= end - start

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
        corrupt = set(self.index.verify(own))
        for key in corrupt:
            log.error("entry %s failed its checksum in the pool: evicted", key.hex())
        return pb.VerifyReply(corrupt=[k for k, o in zip(keys, own, strict=True) if o in corrupt])

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


def check_socket_directory(directory: Path, group_access: bool) -> None:
    """Refuse a socket directory another user could swap the socket in: it must be the
    daemon user's and writable by nobody else (by its group only with group access)."""
    st = directory.stat()
    writable_by = stat.S_IWOTH | (0 if group_access else stat.S_IWGRP)
    if st.st_uid != os.getuid() or st.st_mode & writable_by:
        raise InvalidRequest(
            f"socket directory {directory} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}: it must be this user's (uid {os.getuid()}) and "
            "writable by nobody else; remove it or choose another --socket"
        )


def remove_stale_socket(path: Path) -> None:
    """Remove the socket a dead daemon left; refuse a live one (another daemon answers on it)
    and anything that is not a socket."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not stat.S_ISSOCK(path.lstat().st_mode):
        raise InvalidRequest(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: a daemon that died left it
        log.info("removed the stale socket %s", path)
        return
    except OSError as exc:  # it will not say: never delete what may be a live daemon's
        raise InvalidRequest(
            f"cannot tell whether a daemon serves on {path} ({exc}); refusing to replace it"
        ) from None
    finally:
        probe.close()
    raise InvalidRequest(
        f"another daemon is serving on {path}: stop it first, or choose another --socket"
    )


class LiveHealth(health.HealthServicer):
    """The standard health service, its status computed when asked: SERVING only while
    ``unready()`` finds nothing wrong (started, not draining, no background thread dead)."""

    def __init__(self, unready: Callable[[], str]) -> None:
        super().__init__()
        self.unready = unready
        self._said = ""

    def refresh(self) -> None:
        reason = self.unready()
        if reason and reason != self._said:
            log.warning("health: NOT_SERVING: %s", reason)
        self._said = reason
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if reason
            else health_pb2.HealthCheckResponse.SERVING
        )
        for service in ("", SERVICE):
            self.set(service, status)

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.refresh()
        return super().Check(request, context)


# (request streaming, response streaming) -> grpc's factory for such a handler, and the
# attribute of a handler that serves that kind of call.
_KINDS: dict[tuple[bool, bool], tuple[Callable[..., Any], str]] = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


class _DecodeInHandler(grpc.ServerInterceptor):
    """Decode requests inside the handler, so that bytes that are not the method's message
    answer INVALID_ARGUMENT. grpcio's own decoding answers INTERNAL, logs a traceback, and
    keeps ~19 KB of the daemon's memory for good on each such request (grpcio 1.85; health
    checks included, which need no token)."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, decode = details.method, handler.request_deserializer

        def decoded(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                return decode(raw)
            except Exception:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a {method} message"
                )

        def each(raw: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
            return (decoded(r, context) for r in raw)

        make, name = _KINDS[handler.request_streaming, handler.response_streaming]
        serve, convert = getattr(handler, name), each if handler.request_streaming else decoded
        return make(
            lambda r, c: serve(convert(r, c), c), response_serializer=handler.response_serializer
        )


def _peer_tls(config: ServeConfig) -> PeerTLS | None:
    if not config.peer_ca:
        return None
    return PeerTLS(
        Path(config.peer_ca).read_bytes(),
        Path(config.tls_cert).read_bytes(),
        Path(config.tls_key).read_bytes(),
    )


PEER = frozenset(
    f"/{SERVICE}/{m}"
    for m in ("Hello", "Heartbeat", "Lookup", "Acquire", "Read", "Release", "Stats")
)
ADMIN = frozenset(f"/{SERVICE}/{m}" for m in ("Evict", "Clear", "Pin", "Unpin", "Drain", "Undrain"))


class _TokenCheck(grpc.ServerInterceptor):
    """Every call but health checks must carry ``authorization: Bearer <token>`` (or the
    admin token); admin calls need the admin token, and are refused when there is none; the
    peer token admits the read calls a pulling peer makes (``PEER``), nothing else."""

    def __init__(
        self, token: str, admin_token: str, peer_token: str = "", tenants: Tenants | None = None
    ) -> None:
        self.client = {f"Bearer {t}" for t in (token, admin_token) if t}
        self.admin = f"Bearer {admin_token}" if admin_token else None
        self.peer = f"Bearer {peer_token}" if peer_token else None
        self.tenants = tenants  # a tenant's token is a client's (in its own namespace)

    def caller(self, bearer: str | None) -> Caller | None:
        """Whose ``bearer`` is (tenants.Caller), or None for no token of this daemon's."""
        if self.admin and bearer == self.admin:
            return ADMIN_CALLER
        if bearer in self.client:
            return SHARED_CALLER
        if self.tenants is None:
            return PEER_CALLER if self.peer and bearer == self.peer else None
        if self.peer and bearer == self.peer:
            return PEER_CALLER
        tenant = self.tenants.of(bearer)  # one lookup in the tenants in force: one answer
        return Caller(tenant.name, tenant, self.tenants.secret) if tenant is not None else None

    def check(self, bearer: str | None, method: str) -> Caller | tuple[grpc.StatusCode, str]:
        """The caller of a call of ``method`` with ``bearer``, or the status and reason it is
        refused with."""
        if method in ADMIN and (not self.admin or bearer != self.admin):
            why = (
                f"{method} is an admin call: it needs the admin token"
                if self.admin
                else f"{method} is an admin call, refused: the daemon has no --admin-token"
            )
            return grpc.StatusCode.PERMISSION_DENIED, why
        caller = self.caller(bearer)
        if caller is None or (caller == PEER_CALLER and method not in PEER):
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"
        if self.tenants is None and caller != ADMIN_CALLER:
            return SHARED_CALLER  # one namespace: a peer's reads are a client's
        return caller

    def refusal(self, bearer: str | None, method: str) -> tuple[grpc.StatusCode, str] | None:
        """The status and reason a call is refused with, or None (the fast path asks)."""
        checked = self.check(bearer, method)
        return None if isinstance(checked, Caller) else checked

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = details.method
        if method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        bearer = dict(details.invocation_metadata or ()).get("authorization")
        checked = self.check(bearer, method)
        if isinstance(checked, Caller):
            return _with_caller(continuation(details), checked)
        return _refusal(continuation(details), *checked)


class _Resolved:
    """A call's context with its caller, as the token check resolved it (once: a reload
    between the check and the call cannot make it someone else)."""

    def __init__(self, context: grpc.ServicerContext, caller: Caller) -> None:
        self._context = context
        self.caller = caller

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _with_caller(handler: Any, caller: Caller) -> Any:
    """``handler`` served with its context carrying ``caller``."""
    if handler is None:
        return None
    make, name = _KINDS[handler.request_streaming, handler.response_streaming]
    serve = getattr(handler, name)
    return make(
        lambda r, c: serve(r, _Resolved(c, caller)),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refusal(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler of ``handler``'s kind that answers ``code`` without reading the request."""
    if handler is None:
        return None

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    make, _ = _KINDS[handler.request_streaming, handler.response_streaming]
    return make(refuse)


def _budgets(tenants: dict[str, Tenant]) -> dict[str, Budget]:
    return {t.name: Budget(t.quota, t.reserved, t.sessions, t.disk_quota) for t in tenants.values()}


class Daemon:
    """The running daemon: pool, index, gRPC server, metrics endpoint, reaper."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        pool_bytes = config.resolved_pool_bytes()
        num_blocks = max(1, pool_bytes // config.block_size)
        # Checked before anything is created: a bad file leaves nothing behind.
        service_tokens = [config.token, config.admin_token, config.peer_token]
        self.tenants = (
            Tenants(load_tenants(config.tenants, num_blocks * config.block_size), service_tokens)
            if config.tenants
            else None
        )
        if config.device == "cpu":
            for path, size in reclaim_stale_pools(config.shm_dir):
                log.warning("removed %s (%d bytes): its daemon died, leaving it", path, size)
        self.pool = create_pool(
            config.device, config.block_size, num_blocks, config.shm_dir, config.group_access
        )
        self.disk = self._open_disk() if config.disk_dir else None
        if self.tenants is not None:
            self.tenants.secret = namespace_secret(config.peer_token, config.disk_dir)
        self.index = Index(
            self.pool,
            config.lease_ttl_s,
            config.high_watermark,
            config.low_watermark,
            config.verify_commits,
            config.max_sessions,
            disk=self.disk,
            spill_queue_bytes=config.resolved_spill_queue_bytes(self.pool.capacity),
            eviction=config.eviction,
        )
        self.metrics = Metrics(self.index, config.node)
        if self.tenants is not None:
            self.index.set_budgets(_budgets(self.tenants.by_name))
        guarded = config.token or config.admin_token or self.tenants
        self.token_check = (
            _TokenCheck(config.token, config.admin_token, config.peer_token, self.tenants)
            if guarded
            else None
        )
        interceptors: list[grpc.ServerInterceptor] = [self.token_check] if self.token_check else []
        interceptors.append(_DecodeInHandler())
        self.server = grpc.server(
            # A thread per heartbeat stream and per transfer stream, both bounded, and 32 more
            # that only short calls (and health checks) take.
            futures.ThreadPoolExecutor(
                max_workers=config.max_sessions + config.max_transfers + 32,
                thread_name_prefix="chunkstore-rpc",
            ),
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.workers = Workers(self.metrics.background_errors)
        self.health = LiveHealth(self._unready)
        service = ChunkStoreService(
            config, self.index, self.pool, self.metrics, on_drain=lambda d: self._set_health(not d)
        )
        service.tenants = self.tenants
        service.token_check = self.token_check
        self.service = service
        self.directory: Directory | None = None
        self.engine: MooncakeEngine | None = None
        self.fast: FastPath | None = None
        pb_grpc.add_ChunkStoreServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.addresses: dict[str, str] = {}
        self._serving = False

    def reload_tenants(self) -> bool:
        """Read the tenants file again (SIGHUP): new tokens, quotas and shares from the next
        call on; sessions, leases and entries stay as they are. A file that does not load
        leaves the tenants in force as they were. Returns whether it loaded."""
        if self.tenants is None:
            log.warning("reload: the daemon was started without --tenants; nothing to reload")
            return False
        try:
            tenants = load_tenants(self.config.tenants, self.pool.capacity)
            self.tenants.replace(tenants)
        except InvalidRequest as err:
            self.metrics.tenant_reloads.labels("failed").inc()
            log.error("reload: %s; the tenants in force stay as they were", err)
            return False
        self.index.set_budgets(_budgets(tenants))
        self.metrics.tenant_reloads.labels("ok").inc()
        log.warning("reload: %d tenants from %s", len(tenants), self.config.tenants)
        return True

    def _open_disk(self) -> DiskTier:
        """The disk tier, with what a previous daemon left in it found again."""
        began = time.monotonic()
        config = self.config
        disk = DiskTier(
            config.disk_dir,
            config.resolved_disk_size(),
            config.high_watermark,
            config.low_watermark,
        )
        log.info(
            "disk tier %s: %d entries, %d of %d bytes, found in %.2f s",
            disk.directory,
            len(disk),
            disk.used,
            disk.capacity,
            time.monotonic() - began,
        )
        if disk.removed_at_start:
            log.warning(
                "disk tier: removed %d torn or stray files a previous daemon left (e.g. %s)",
                len(disk.removed_at_start),
                disk.removed_at_start[0],
            )
        return disk

    def start(self) -> dict[str, str]:
        config = self.config
        if config.socket:
            self._bind_socket(config.socket)
        if config.tcp:
            host = config.tcp.rsplit(":", 1)[0]
            if config.tls_cert:
                credentials = grpc.ssl_server_credentials(
                    [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
                    root_certificates=(
                        Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
                    ),
                    require_client_auth=bool(config.tls_client_ca),
                )
                port = self.server.add_secure_port(config.tcp, credentials)
            else:
                port = self.server.add_insecure_port(config.tcp)
            self.addresses["tcp"] = f"{host}:{port}"
        if config.metrics:
            host = config.metrics.rsplit(":", 1)[0]
            port = self.metrics.serve(config.metrics, config.metrics_token)
            self.addresses["metrics"] = f"{host}:{port}"
        self.server.start()
        if config.redis:
            # Imported only when asked for: a daemon without --redis runs without redis-py
            # (the GPU machine's device check has none).
            from chunkstore.daemon.directory import Directory

            self.directory = Directory(
                config.redis,
                config.advertise or self.addresses["tcp"],
                self._peers(),
                config.directory_ttl_s,
                self.index,
                self.metrics,
            )
            self.service.on_miss = self.directory.want
            self.directory.start(self.workers)
        reap_every = max(0.05, min(1.0, self.config.lease_ttl_s / 4))
        self.workers.start("reap", self.index.expire, interval=reap_every)
        if self.disk is not None:
            self.workers.start("spill", self.index.spill_one)
        self._set_health(True)
        self.addresses["shm_path"] = self.pool.shm_path
        return self.addresses

    def _peers(self) -> PeerSource:
        """How this daemon pulls from peers: the gRPC stream, or the transfer engine with the
        stream behind it. An engine that cannot start is said loudly, and the daemon serves
        on without it (its pulls counted as "engine_unavailable" fallbacks)."""
        config, tls = self.config, _peer_tls(self.config)
        if config.transfer_engine == "none":
            return StreamPeers(config.peer_token or None, tls=tls)
        try:
            self.engine = MooncakeEngine(
                config.transfer_listen_host(),
                config.transfer_protocol,
                config.transfer_devices,
                self.pool.region(),
            )
        except Unavailable as err:
            log.error("%s: peers pull over the gRPC stream instead", err)
        else:
            self.service.transfer = self.engine.endpoint
            self.addresses["transfer"] = self.engine.endpoint.session
            log.warning(
                "transfer engine %s/%s on %s: whoever reaches it can read the pool",
                self.engine.endpoint.engine,
                self.engine.endpoint.protocol,
                self.engine.endpoint.session,
            )
        fell_back = self.metrics.peer_pull_fallbacks.labels
        return EnginePeers(
            self.engine,
            lambda reason: fell_back(reason).inc(),
            config.peer_token or None,
            tls=tls,
        )

    def _set_health(self, serving: bool) -> None:
        self._serving = serving
        self.health.refresh()

    def _unready(self) -> str:
        """Why the daemon cannot serve now ("" when it can)."""
        if not self._serving:
            return "starting, draining or stopped"
        dead = self.workers.dead()
        if dead:
            return f"background thread(s) {', '.join(dead)} died"
        return ""

    def _bind_socket(self, path: str) -> None:
        socket_path = Path(path)
        socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_socket_directory(socket_path.parent, self.config.group_access)
        remove_stale_socket(socket_path)
        previous = os.umask(0o007 if self.config.group_access else 0o077)
        try:
            self.server.add_insecure_port(f"unix:{socket_path}")
        finally:
            os.umask(previous)
        self.addresses["socket"] = str(socket_path)
        check = self.token_check
        self.fast = FastPath(
            fast_socket_path(str(socket_path)),
            self.service,
            (lambda bearer, name: check.refusal(bearer, f"/{SERVICE}/{name}")) if check else None,
            self.config.max_sessions,
            self.config.group_access,
        )
        self.service.fast_socket = self.fast.path
        self.addresses["fast"] = self.fast.path

    def stop(self, drain_timeout: float | None = None) -> int:
        """Drain (bounded), stop serving, free the pool. Returns the leases left behind."""
        self._set_health(False)
        timeout = self.config.drain_timeout_s if drain_timeout is None else drain_timeout
        persist = self.disk is not None and self.config.persist_on_stop
        if persist:
            self.index.persist(0)  # queued now, written while leases drain
        left = drain(self.index, timeout)
        if persist:
            unwritten = self.index.persist(timeout)
            log.log(
                logging.WARNING if unwritten else logging.INFO,
                "disk tier: %d entries on disk, %d memory entries left unwritten at stop",
                len(self.disk) if self.disk else 0,
                unwritten,
            )
        self.workers.join()
        if self.fast is not None:
            self.fast.stop()
        if self.directory is not None:
            self.directory.stop()
        if self.engine is not None:
            self.engine.close()
        if not self.server.stop(grace=1.0).wait(timeout=10.0):
            log.warning("the gRPC server did not stop within 10 s of its 1 s grace; going on")
        self.metrics.close()
        # A device pool waits (as long as the drain) for the processes that imported it.
        self.pool.close(
            grace=self.config.drain_timeout_s if drain_timeout is None else drain_timeout
        )
        if "socket" in self.addresses:
            Path(self.addresses["socket"]).unlink(missing_ok=True)
        return left


def _stuck_stopping() -> None:
    log.error("stopping is taking too long; every thread's stack follows")
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(all_threads=True)


def serve(config: ServeConfig) -> int:
    """Run until SIGTERM / SIGINT, then drain and exit 0. SIGUSR1 writes every thread's
    stack to stderr (the log) and goes on."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info("config: %s", config.describe())
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("got %s: draining", signal.Signals(signum).name)
        stop.set()

    # Before anything is created: a SIGTERM during start-up still drains and cleans up.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reload = threading.Event()  # SIGHUP: read the tenants file again
    signal.signal(signal.SIGHUP, lambda signum, frame: reload.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    daemon = Daemon(config)
    try:
        addresses = daemon.start()
    except BaseException:
        daemon.stop(drain_timeout=0)  # removes the pool file and the socket
        raise
    ready = {
        "event": "ready",
        "pid": os.getpid(),
        "pool_bytes": daemon.pool.capacity,
        "node": config.node,
        "block_size": config.block_size,
        **addresses,
    }
    print(json.dumps(ready), flush=True)
    log.info("serving %s", ", ".join(f"{k}={v}" for k, v in addresses.items()))
    while not stop.wait(0.1):
        if reload.is_set():  # here, not in the handler: it reads a file and takes locks
            reload.clear()
            daemon.reload_tenants()
    # A stop that hangs says where, in the log, while it still can (a supervisor's SIGKILL
    # comes next): every thread's stack once it has taken the drain timeout and 10 s more.
    watchdog = threading.Timer(config.drain_timeout_s + 10.0, _stuck_stopping)
    watchdog.daemon = True
    watchdog.start()
    left = daemon.stop()
    watchdog.cancel()
    if left:
        log.warning("stopped with %d leases still held after the drain timeout", left)
    log.info("stopped")
    return 0
