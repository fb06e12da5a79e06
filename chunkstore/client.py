"""``ChunkStoreClient``: the Python client of the daemon.

It opens a session (kept alive by a heartbeat stream, held by the daemon before the constructor
returns: if this process dies, the daemon drops its leases and reservations at once; if it is
paused, the session waits for it), then moves bytes the cheapest way it can: straight
through the shared-memory pool when it can map it (same host), else over the gRPC streams.
Every read is checked against the checksum stored at commit; a mismatch raises
ChecksumMismatch and the bytes are never returned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from chunkstore.errors import (
    AlreadyExists,
    ChecksumMismatch,
    InvalidRequest,
    NotFound,
    StoreError,
    Unavailable,
)
from chunkstore.kv.entry import EntryLayout, layout_of, tensors_of, torch_dtype
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.device_ipc import (
    TensorDigest,
    close_pool,
    gather_tensor,
    open_pool,
    pin_host_region,
    scatter_tensors,
    synchronize_pool,
    tensor_bytes,
)
from chunkstore.protocol.device_runtime import IpcHandle
from chunkstore.protocol.endpoints import default_address as default_address  # re-exported
from chunkstore.protocol.fast import FastChannel
from chunkstore.protocol.shm import (
    EntryDigest,
    gather_many,
    map_shared_pool,
    scatter_parts,
)
from chunkstore.protocol.shm import (
    Pieces as Pieces,  # re-exported: where read_each puts an entry in pieces
)
from chunkstore.protocol.shm import populate as populate_pool
from chunkstore.protocol.wire import (
    MAX_BATCH,
    MAX_MESSAGE,
    layout_from_proto,
    layout_to_proto,
    typed_error,
)

log = logging.getLogger("chunkstore.client")

WRITE_PIECE = 1 << 20


def _batches(keys: Sequence[bytes]) -> Iterator[list[bytes]]:
    keys = list(keys)
    for start in range(0, len(keys), MAX_BATCH):
        yield keys[start : start + MAX_BATCH]


def _update(digest: EntryDigest | TensorDigest, data: np.ndarray) -> None:
    """Feed host bytes to either kind of digest."""
    if isinstance(digest, TensorDigest):
        digest.update(torch.from_numpy(data))
    else:
        digest.update(data.data)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as uint8, without a copy when it is contiguous on the CPU."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()


@dataclass
class LeasedEntry:
    lease_id: int
    key: bytes
    layout: EntryLayout
    nbytes: int
    blocks: list[int]
    checksum: int


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
        (a pinned pool is mapped already)."""
        if transport not in ("auto", "shm", "stream"):
            raise InvalidRequest(f"unknown transport {transport!r}: auto, shm or stream")
        self.address = address
        self.timeout = timeout
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ]
        if root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates, client_key, client_cert_chain
            )
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = pb_grpc.ChunkStoreStub(self.channel)
        self._token = token
        self._use_fast = fast
        self.copy_threads = copy_threads
        self._fast: FastChannel | None = None
        self._fast_names = {
            self.stub.Lookup: "Lookup",
            self.stub.Acquire: "Acquire",
            self.stub.Release: "Release",
            self.stub.Reserve: "Reserve",
            self.stub.Commit: "Commit",
        }
        self.name = name or f"pid-{os.getpid()}"
        self.requested_transport = transport
        self.sessions_reopened = 0  # sessions lost (daemon restart, pause past the TTL)
        self._session_lock = threading.Lock()
        self.pin_for = pin_for
        self.pinned = False  # the mapped pool is registered with the device runtime
        self._unpin: Callable[[], None] | None = None
        self.device_pool: torch.Tensor | None = None  # a device pool's import
        self._pool_handle: IpcHandle | None = None
        self.populate = populate
        self._closed = threading.Event()
        self._open_session()
        self._shm_reads: dict[int, int] = {}  # lease id -> bytes copied out of the pool
        self._pings: queue.Queue[pb.Ping | None] = queue.Queue()
        self._attached = threading.Event()  # the first heartbeat stream answered (or failed)
        self._heartbeat = threading.Thread(
            target=self._beat, name="chunkstore-heartbeat", daemon=True
        )
        self._heartbeat.start()
        # Until the daemon has the stream, an idle session can expire: a process paused (or
        # slow) right after this returned would find its session gone when it resumes.
        self._attached.wait(self.timeout)

    def _open_session(self) -> None:
        """Hello: a new session, and the pool mapped again (a restarted daemon has a new one)."""
        hello = self._call(
            self.stub.Hello,
            pb.HelloRequest(client_name=self.name, hostname=socket.gethostname()),
        )
        region: np.ndarray | None = None
        transport = self.requested_transport
        self._open_device_pool(hello)
        mappable = self.device_pool is None and hello.shm_path != ""
        if transport != "stream" and mappable and hello.hostname == socket.gethostname():
            try:
                region = map_shared_pool(hello.shm_path, hello.block_size * hello.num_blocks)
            except OSError as exc:
                if transport == "shm":
                    raise Unavailable(f"cannot map the pool at {hello.shm_path}: {exc}") from exc
                log.info("pool not mappable (%s); using the gRPC stream", exc)
        elif transport == "shm" and self.device_pool is None:
            raise Unavailable("the daemon's pool is not shared memory on this host")
        self.block_size = hello.block_size
        self.server_info = hello
        self._connect_fast(hello)
        self._pin(region)
        self.region = region
        if region is not None and self.populate and not self.pinned:
            threading.Thread(
                target=self._populate, args=(region,), name="chunkstore-populate", daemon=True
            ).start()
        self.transport = "stream"
        if region is not None:
            self.transport = "shm"
        elif self.device_pool is not None:
            self.transport = "ipc"
        self.session = hello.session_id

    def _open_device_pool(self, hello: pb.HelloReply) -> None:
        """Open the daemon's device pool (once per process; a restarted daemon's new pool
        replaces the old import), or close the import if the daemon has none now."""
        handle = IpcHandle.from_proto(hello.device_pool) if hello.HasField("device_pool") else None
        if handle == self._pool_handle:
            return
        if self._pool_handle is not None:
            close_pool(self._pool_handle)
            self.device_pool, self._pool_handle = None, None
        local = hello.hostname == socket.gethostname()
        if handle is None or not local or self.requested_transport == "stream":
            if handle is not None and self.requested_transport == "shm":
                raise Unavailable("the daemon's device pool is on another host")
            return
        try:
            self.device_pool = open_pool(handle)
        except (StoreError, RuntimeError, OSError) as exc:
            if self.requested_transport == "shm":
                raise Unavailable(f"cannot open the daemon's device pool: {exc}") from exc
            log.warning("device pool not opened (%s); using the gRPC stream", exc)
            return
        self._pool_handle = handle

    def _pin(self, region: np.ndarray | None) -> None:
        """Register a newly mapped pool with the device runtime (``pin_for``), after
        unregistering the one before (a restarted daemon's; None: just that)."""
        if self._unpin is not None:  # the old pool's mapping (a restarted daemon's)
            self._unpin()
            self._unpin, self.pinned = None, False
        if region is None or not self.pin_for:
            return
        self._unpin, why = pin_host_region(region, self.pin_for)
        self.pinned = self._unpin is not None
        if why:
            log.warning("chunkstore pool not pinned for %s: %s", self.pin_for, why)

    def _populate(self, region: np.ndarray) -> None:
        with contextlib.suppress(OSError):  # below vLLM's threads where they share a core
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        began = time.perf_counter()
        done = populate_pool(region, lambda: self._closed.is_set() or self.region is not region)
        log.debug(
            "pool map %s in %.2f s (%d MiB)",
            "populated" if done else "left to first touch",
            time.perf_counter() - began,
            region.nbytes >> 20,
        )

    def _digest(self) -> EntryDigest | TensorDigest:
        """The checksum the daemon's pool keeps: xxh3 stripes, or TensorDigest (device)."""
        return TensorDigest() if self.server_info.HasField("device_pool") else EntryDigest()

    def _reopen(self, lost: str) -> None:
        """The daemon no longer knows session ``lost``: open a new one (once, whichever
        thread notices first). What the old one held is gone with it."""
        with self._session_lock:
            if self.session != lost or self._closed.is_set():
                return
            self._open_session()
            self.sessions_reopened += 1
        log.warning(
            "chunkstore session %s at %s was lost (daemon restarted, or this process was "
            "paused past the lease TTL); reopened as %s",
            lost,
            self.address,
            self.session,
        )

    # Plumbing -----------------------------------------------------------------------------

    def _connect_fast(self, hello: pb.HelloReply) -> None:
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        path = hello.fast_socket
        if not (self._use_fast and path and hello.hostname == socket.gethostname()):
            return
        try:
            self._fast = FastChannel(path, self._token, self.timeout)
        except (OSError, StoreError) as exc:
            log.info("fast path at %s not used (%s); the control calls over gRPC", path, exc)

    @property
    def fast(self) -> bool:
        """Whether Lookup, Acquire, Release, Reserve and Commit go over the fast path now."""
        return self._fast is not None

    def _call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        fast = self._fast
        if fast is not None and method in self._fast_names:
            try:
                return fast.call(self._fast_names[method], request)
            except Unavailable as exc:  # the connection itself failed: gRPC from now on
                self._fast = None
                log.warning("%s; the control calls over gRPC from now on", exc)
                raise
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise typed_error(err) from None

    def _session_call(
        self, method: Any, request: Callable[[str], Any], retry: bool, timeout: float = 0.0
    ) -> Any:
        """A call made under this client's session. If the daemon lost the session, a new
        one is opened; ``retry``: the call is made again under it (calls that start
        something; one that refers to what the lost session held fails)."""
        session = self.session
        try:
            return self._call(method, request(session), timeout or None)
        except NotFound as err:
            if "no session" not in str(err):
                raise
            self._reopen(session)
            if not retry:
                raise
        return self._call(method, request(self.session), timeout or None)

    def _beat(self) -> None:
        """Keep the session alive; when the stream ends (the daemon restarted or dropped the
        session, which ending the stream does anyway) open a new session, until closed."""
        while not self._closed.is_set():
            session = self.session
            interval = max(0.05, self.server_info.lease_ttl_ms / 3000)
            try:
                for _ in self.stub.Heartbeat(
                    self._pings_of(session, interval), metadata=self.metadata
                ):
                    self._attached.set()  # the daemon attached the stream before answering
                    if self._closed.is_set():
                        return
            except grpc.RpcError as err:
                if not self._closed.is_set():
                    log.warning("heartbeat to %s ended: %s", self.address, err)
            self._attached.set()  # never keep the constructor waiting past a failed stream
            while not self._closed.wait(interval):
                try:
                    self._reopen(session)
                    break
                except StoreError:
                    continue  # the daemon is not back yet

    def _pings_of(self, session: str, interval: float) -> Iterator[pb.Ping]:
        yield pb.Ping(session_id=session, holds_pool=self.device_pool is not None)
        while True:
            try:
                item = self._pings.get(timeout=interval)
            except queue.Empty:
                item = pb.Ping(session_id=session)
            if item is None:
                return
            yield item

    def close(self) -> None:
        """End the session (the daemon releases whatever it still holds) and the channel."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._pin(None)
        if self._pool_handle is not None:  # closed before the daemon sees the session end
            close_pool(self._pool_handle)
            self.device_pool, self._pool_handle = None, None
        self._pings.put(None)
        self._heartbeat.join(timeout=2)
        if self._fast is not None:
            self._fast.close()
        self.channel.close()

    def __enter__(self) -> ChunkStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Index --------------------------------------------------------------------------------

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
            ChunkStoreError: the daemon refused or could not be reached (typed subclasses).
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
        return self._call(self.stub.Stats, pb.StatsRequest())

    # Admin calls take any number of keys: they go in calls of MAX_BATCH keys each.

    # ``tenant``: whose keys they are ("": the shared namespace's; tenants.py).

    def evict(self, keys: Sequence[bytes], tenant: str = "") -> pb.EvictReply:
        total = pb.EvictReply()
        for batch in _batches(keys):
            reply = self._call(self.stub.Evict, pb.EvictRequest(keys=batch, tenant=tenant))
            total.evicted += reply.evicted
            total.busy += reply.busy
        return total

    def clear(self) -> pb.ClearReply:
        return self._call(self.stub.Clear, pb.ClearRequest())

    def pin(self, keys: Sequence[bytes], tenant: str = "") -> int:
        """Pin entries; each call of MAX_BATCH keys is all or nothing (NotFound)."""
        return self._set_pinned(self.stub.Pin, keys, tenant)

    def unpin(self, keys: Sequence[bytes], tenant: str = "") -> int:
        return self._set_pinned(self.stub.Unpin, keys, tenant)

    def _set_pinned(self, method: Any, keys: Sequence[bytes], tenant: str) -> int:
        """Entries whose pin changed, over calls of MAX_BATCH keys."""
        return sum(
            int(self._call(method, pb.PinRequest(keys=batch, tenant=tenant)).changed)
            for batch in _batches(keys)
        )

    def undrain(self) -> bool:
        """Serve reads and writes again after a drain; whether it was draining."""
        return bool(self._call(self.stub.Undrain, pb.UndrainRequest()).was_draining)

    def drain(self, timeout: float = 0.0) -> int:
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
        MLA latent). False if the key is stored (or being stored) already."""
        layout = layout_of(keys, values, virtual_start, entry_kind)
        return self._put(key, layout, [keys] + ([values] if values is not None else []))

    def put_packed(self, key: bytes, layout: EntryLayout, blocks: torch.Tensor) -> bool:
        """Store an entry held as a serving engine's cache blocks (``layout.packing`` names
        their layout; ``blocks``: exactly ``layout.nbytes`` bytes, in the stored dtype)."""
        if not layout.packing:
            raise InvalidRequest("put_packed needs a layout with a packing")
        layout.validate()
        nbytes = blocks.numel() * blocks.element_size()
        if blocks.dtype != torch_dtype(layout.dtype) or nbytes != layout.nbytes:
            raise InvalidRequest(f"{nbytes} bytes of {blocks.dtype} do not hold layout {layout}")
        return self._put(key, layout, [blocks])

    def _put(self, key: bytes, layout: EntryLayout, tensors: list[torch.Tensor]) -> bool:
        parts = [as_bytes(t) for t in tensors] if self.device_pool is None else []
        digest = self._digest()
        if self.transport == "stream":  # hashed here; through the pool: as it is copied
            for part in parts:
                _update(digest, part)
        try:
            reply = self._session_call(
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
            return False
        session = self.session  # the reservation's
        try:
            if self.device_pool is not None:
                assert isinstance(digest, TensorDigest)
                sources = [tensor_bytes(t) for t in tensors]
                scatter_tensors(self.device_pool, reply.blocks, self.block_size, sources, digest)
                if self._pool_handle is not None:  # landed before the commit makes it readable
                    synchronize_pool(self._pool_handle)
            elif self.region is not None:
                assert isinstance(digest, EntryDigest)
                scatter_parts(
                    self.region, reply.blocks, self.block_size, parts, digest, self.copy_threads
                )
            else:
                self._stream_write(session, reply.reservation_id, parts)
            self._session_call(
                self.stub.Commit,
                lambda _: pb.CommitRequest(
                    session_id=session,
                    reservation_id=reply.reservation_id,
                    checksum=digest.intdigest(),
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
        return True

    def _stream_write(self, session: str, reservation_id: int, parts: list[np.ndarray]) -> None:
        def pieces() -> Iterator[pb.WritePiece]:
            first = True
            for part in parts:
                for lo in range(0, part.shape[0], WRITE_PIECE):
                    data = part[lo : lo + WRITE_PIECE].tobytes()
                    if first:
                        yield pb.WritePiece(
                            session_id=session, reservation_id=reservation_id, data=data
                        )
                        first = False
                    else:
                        yield pb.WritePiece(data=data)

        self._call(self.stub.Write, pieces(), timeout=max(self.timeout, 120.0))

    # Reads --------------------------------------------------------------------------------

    def acquire(
        self, keys: Sequence[bytes], num_tokens: Sequence[int] = (), entry_kind: str = "chunk"
    ) -> list[LeasedEntry | None]:
        """Leases on the keys' entries (None where absent). Release them when done.
        ``num_tokens`` (one per key) makes the daemon count this as a lookup too, of
        ``entry_kind`` entries."""
        reply = self._session_call(
            self.stub.Acquire,
            lambda session: pb.AcquireRequest(
                session_id=session,
                keys=list(keys),
                num_tokens=list(num_tokens),
                entry_kind=entry_kind,
            ),
            retry=True,
        )
        return [
            LeasedEntry(
                x.lease_id, x.key, layout_from_proto(x.layout), x.nbytes, list(x.blocks), x.checksum
            )
            if x.lease_id
            else None
            for x in reply.leases
        ]

    def release(self, lease_ids: Sequence[int], shm_bytes_read: int = 0) -> None:
        """End leases. ``shm_bytes_read``: bytes other clients copied out of the pool under
        them (see ``read_into``), for the daemon's transport metrics; reported even with no
        lease left to end (a request that finished before its readers reported)."""
        if not lease_ids and not shm_bytes_read:
            return
        shm_bytes = shm_bytes_read + sum(self._shm_reads.pop(i, 0) for i in lease_ids)
        self._session_call(
            self.stub.Release,
            lambda session: pb.ReleaseRequest(
                session_id=session, lease_ids=list(lease_ids), shm_bytes_read=shm_bytes
            ),
            retry=False,
        )

    def read_into(self, entry: LeasedEntry, out: torch.Tensor, session: str | None = None) -> None:
        """Copy a leased entry's bytes into ``out`` (uint8, nbytes long; on the CPU, or on the
        pool's device with a device pool) and check them.

        ``session``: the session holding the lease when another client took it (the vLLM
        scheduler leases, its workers read); that client reports the shared-memory bytes
        when it releases."""
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
        ``ChecksumMismatch`` (the others were copied and checked)."""
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
    ) -> list[ChecksumMismatch | None]:
        """``read_many``, with a verdict per entry instead of raising the first: None where
        the entry was read and checked, the ``ChecksumMismatch`` where it was not (use none
        of its bytes). An out may be ``Pieces`` (uint8 arrays whose lengths add up to the
        entry's, in the order of its bytes: a cache's blocks), filled straight from a
        shared-memory pool (through a buffer otherwise). ``threads``: this read's copy
        threads (``copy_threads`` when None); ``helper``: where the second one runs
        (``shm.gather_many``). ``progress(n)``: every entry's first n bytes are in its out,
        not yet checked (stripe by stripe from a mapped pool, all at the end otherwise); the
        verdicts come after the last call."""
        if len(entries) != len(outs):
            raise InvalidRequest(f"{len(entries)} entries to read into {len(outs)} buffers")
        for entry, out in zip(entries, outs, strict=True):
            if isinstance(out, Pieces):
                fits = out.nbytes == entry.nbytes
            else:
                fits = out.dtype == torch.uint8 and out.numel() == entry.nbytes
                fits = fits and out.is_contiguous()
            if not fits:
                raise InvalidRequest(
                    f"entry {entry.key.hex()} is {entry.nbytes} bytes: read it into a contiguous "
                    f"uint8 tensor (or pieces) of as many"
                )
        if self.region is None and any(isinstance(out, Pieces) for out in outs):
            whole = [
                torch.empty(e.nbytes, dtype=torch.uint8) if isinstance(out, Pieces) else out
                for e, out in zip(entries, outs, strict=True)
            ]
            checked = self.read_each(entries, whole, session, threads, helper)
            for out, buffer in zip(outs, whole, strict=True):
                if isinstance(out, Pieces):
                    out.fill(buffer.numpy())
            if progress is not None:
                progress(max(e.nbytes for e in entries))
            return checked
        digests = [self._digest() for _ in entries]
        if self.device_pool is not None:
            for entry, out, digest in zip(entries, outs, digests, strict=True):
                assert isinstance(digest, TensorDigest) and not isinstance(out, Pieces)
                gather_tensor(self.device_pool, entry.blocks, self.block_size, out, digest)
        elif self.region is not None:
            reads = [
                (e.blocks, out if isinstance(out, Pieces) else out.numpy())
                for e, out in zip(entries, outs, strict=True)
            ]
            stripes = [d for d in digests if isinstance(d, EntryDigest)]
            gather_many(
                self.region,
                self.block_size,
                reads,
                stripes,
                threads or self.copy_threads,
                helper,
                progress,
            )
        if self.transport == "shm" and session is None:  # the daemon's shm byte counter
            for entry in entries:
                read = self._shm_reads.get(entry.lease_id, 0)
                self._shm_reads[entry.lease_id] = read + entry.nbytes
        if self.transport == "stream":
            for entry, out, digest in zip(entries, outs, digests, strict=True):
                assert not isinstance(out, Pieces)
                self._stream_read(entry, out.numpy(), digest, session)
        if progress is not None and entries:
            progress(max(e.nbytes for e in entries))
        verdicts: list[ChecksumMismatch | None] = []
        for entry, digest in zip(entries, digests, strict=True):
            actual = digest.intdigest()
            if actual == entry.checksum:
                verdicts.append(None)
                continue
            self._report_corrupt(entry.key)
            verdicts.append(
                ChecksumMismatch(
                    f"entry {entry.key.hex()} hashes to {actual:#x}, committed as "
                    f"{entry.checksum:#x}: not used"
                )
            )
        return verdicts

    def _stream_read(
        self,
        entry: LeasedEntry,
        target: np.ndarray,
        digest: EntryDigest | TensorDigest,
        session: str | None,
    ) -> None:
        offset = 0
        request = pb.ReadRequest(session_id=session or self.session, lease_id=entry.lease_id)
        try:
            for piece in self.stub.Read(
                request, timeout=max(self.timeout, 120.0), metadata=self.metadata
            ):
                data = np.frombuffer(piece.data, dtype=np.uint8)
                target[offset : offset + data.shape[0]] = data
                offset += data.shape[0]
        except grpc.RpcError as err:
            raise typed_error(err) from None
        if offset != entry.nbytes:
            raise ChecksumMismatch(f"read {offset} of {entry.nbytes} bytes")
        _update(digest, target)

    def _report_corrupt(self, key: bytes) -> None:
        """Have the daemon check the entry itself: if its pool bytes are bad it evicts it,
        so the next put replaces it (best effort: the read fails either way)."""
        try:
            corrupt = self._call(self.stub.Verify, pb.VerifyRequest(keys=[key])).corrupt
        except StoreError as err:
            log.warning("could not report entry %s as corrupt: %s", key.hex(), err)
            return
        if corrupt:
            log.error("entry %s was corrupt in the pool; the daemon evicted it", key.hex())

    def get(self, key: bytes) -> StoredKV | None:
        """One entry's KV, checked against its checksum, or None if absent."""
        [entry] = self.acquire([key])
        if entry is None:
            return None
        try:
            buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
            self.read_into(entry, buffer)
        finally:
            self.release([entry.lease_id])
        keys, values = tensors_of(buffer, entry.layout)
        return StoredKV(keys, values, entry.layout)
