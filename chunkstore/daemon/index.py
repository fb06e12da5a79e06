"""The content-hash index: key -> entry, and every state change an entry goes through.

One path (DESIGN.md): reserve -> commit (or abort) -> lease -> release -> evict. An entry is
unreadable until committed; a leased or pinned entry is never evicted; leases and
reservations belong to a session and go when it ends or stops renewing them (TTL). Eviction
takes the lowest ranked entry (``eviction.py``: least recently used, or least worth): on
demand when a reservation needs room, and down to the low watermark once usage passes the
high one. The index owns entries; the pool owns bytes and free blocks; one
lock serializes both.

Every entry, reservation and block is some tenant's ("" the shared namespace; tenants.py
maps keys into namespaces before they get here). A tenant past its quota evicts its own
least recently used entries; the pool's eviction takes the oldest entry among the tenants'
that leaves each other tenant its reserved share (``_victim``).

With a disk tier (``disk.py``) every commit also queues the entry for the daemon's spill
thread (``spill_one``), which holds its blocks while it writes them (an entry being written
is not evictable, as a leased one); a memory miss the tier holds is read back into new
blocks and committed (``_acquire_from_disk``). Disk I/O never runs under the lock.

Every operation costs the same whatever the index holds: the eviction order holds only
evictable entries (pinned and leased ones leave it, and return when they become evictable
again), and what ``stats`` reports is counted as it changes, never by walking the entries, so
a Prometheus scrape does not hold lookups up at 100k entries.
"""

from __future__ import annotations

import errno
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from chunkstore.daemon.disk import DiskEntry, DiskError, DiskTier
from chunkstore.daemon.eviction import Order, make_policy
from chunkstore.daemon.pool import Pool
from chunkstore.errors import (
    AlreadyExists,
    Busy,
    ChecksumMismatch,
    InvalidRequest,
    NotFound,
    PoolFull,
    WrongState,
)
from chunkstore.kv.entry import ENTRY_KINDS, EntryLayout, check_entry_kind
from chunkstore.kv.keys import KEY_BYTES
from chunkstore.protocol.shm import Pieces
from chunkstore.protocol.wire import MAX_BATCH

log = logging.getLogger(__name__)

DISK_READERS = 4  # disk hits of one Acquire read at once


class Spill(StrEnum):
    """Where an entry stands with the disk tier's spill thread (NONE is falsy)."""

    NONE = ""
    QUEUED = "queued"  # waiting in the spill queue
    WRITING = "writing"  # being written: its blocks stay, whatever evicts it


@dataclass
class Entry:
    key: bytes
    layout: EntryLayout
    nbytes: int
    blocks: list[int]
    checksum: int
    pinned: bool = False
    leases: int = 0
    evicted: bool = False  # out of the index; its blocks go when its last lease does
    spill: Spill = Spill.NONE
    tenant: str = ""  # whose namespace it is in ("" shared; tenants.py)
    rank: float = 0.0  # its place in the eviction order, set when it became evictable


@dataclass
class Reservation:
    id: int
    key: bytes
    session: str
    layout: EntryLayout
    nbytes: int
    blocks: list[int]
    expires_at: float
    written: int = 0  # bytes streamed in so far (stream writes only)
    tenant: str = ""


@dataclass
class Lease:
    id: int
    entry: Entry
    session: str
    expires_at: float


@dataclass
class Session:
    id: str
    name: str
    last_seen: float
    owner: str = ""  # whose calls may use it (tenants.Caller.owner)
    leases: set[int] = field(default_factory=set)
    reservations: set[int] = field(default_factory=set)
    streams: int = 0  # open heartbeat streams: while one is, the client process lives
    # Blocks of this session's reservations that expired while its process lived: a paused
    # writer may still copy into them, so nobody else gets them until it is done.
    quarantined: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class IndexStats:
    entries: int
    pinned_entries: int
    bytes_used: int
    bytes_capacity: int
    blocks_free: int
    blocks_total: int
    active_leases: int
    active_reservations: int
    sessions: int
    pool_importers: int  # sessions whose process opened a device pool by IPC
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    evictions: dict[str, int]
    draining: bool
    blocks_quarantined: int
    # By entry kind (chunk, prefix): lookups, hits, lookup_tokens, hit_tokens, entries, bytes.
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    disk: DiskStats | None = None  # None: no disk tier
    # By tenant ("" the shared namespace): entries, bytes, held_bytes, quota_bytes,
    # reserved_bytes, lookups, hits, lookup_tokens, hit_tokens, evictions.
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Budget:
    """What one tenant's entries and reservations may hold of the pool (``quota``, 0: no
    limit), how much of that is never evicted for another tenant (``reserved``), and how many
    sessions it may have open (``sessions``, 0: no limit but --max-sessions)."""

    quota: int = 0
    reserved: int = 0
    sessions: int = 0
    disk_quota: int = 0  # the disk tier's bytes its entries may hold (0: no limit)


NO_BUDGET = Budget()  # a tenant the file does not name (or the shared namespace): no limits


@dataclass
class DiskStats:
    directory: str
    entries: int
    bytes_used: int  # file bytes, headers included
    bytes_capacity: int
    spill_queue_bytes: int  # committed entries waiting to be written
    spills_writing: int
    removed_at_start: int  # torn and stray files a previous daemon left
    last_error: str  # the last failure, "" if none since start
    # spills, spill_bytes, promotions, promoted_bytes, dropped_<why>, errors_<op>: counts
    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # spent writing, reading


def check_keys(keys: Sequence[bytes]) -> None:
    """A call's keys: at most MAX_BATCH, each KEY_BYTES long (InvalidRequest otherwise)."""
    if len(keys) > MAX_BATCH:
        raise InvalidRequest(f"{len(keys)} keys in one call; at most {MAX_BATCH}")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise InvalidRequest(f"a key is {KEY_BYTES} bytes, got {len(key)}")


class Index:
    def __init__(
        self,
        pool: Pool,
        lease_ttl: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        verify_commits: bool = False,
        max_sessions: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, int], None] | None = None,
        disk: DiskTier | None = None,
        spill_queue_bytes: int = 1 << 30,
        eviction: str = "lru",
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise InvalidRequest("watermarks need 0 < low <= high <= 1")
        self.pool = pool
        self.lease_ttl = lease_ttl
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.verify_commits = verify_commits
        self.max_sessions = max_sessions
        self.clock = clock
        self.on_evict = on_evict
        self.lock = threading.RLock()
        self.draining = False
        self._entries: dict[bytes, Entry] = {}
        # The evictable entries (neither pinned nor leased), by tenant, lowest rank first
        # (eviction.py: least recently used, or least worth); ranks compare across tenants.
        self.policy = make_policy(eviction)
        self._orders: dict[str, Order[Entry]] = {}
        self._evictable: Counter[str] = Counter()  # blocks of the entries in _orders, by tenant
        # Tenants: blocks held (entries and reservations), budgets, counts (tenants.py).
        self._held: Counter[str] = Counter()
        self.budgets: dict[str, Budget] = {}
        self._tenant_counts: dict[str, Counter[str]] = {"": Counter()}
        self._pinned = 0
        self._quarantined_blocks = 0
        self._reservations: dict[int, Reservation] = {}
        self._reserved_keys: dict[bytes, int] = {}
        # Recent reservations' outcomes, told only to the session that made each.
        self._finished: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._leases: dict[int, Lease] = {}
        self._sessions: dict[str, Session] = {}
        self._ids_used: set[int] = set()  # ids of live leases and reservations
        self._counts: Counter[str] = Counter()
        self._kind_counts: dict[str, Counter[str]] = {kind: Counter() for kind in ENTRY_KINDS}
        self.evictions: Counter[str] = Counter()
        # The disk tier: committed entries queued (bounded, in bytes) for the spill thread.
        self.disk = disk
        self.spill_queue_bytes = spill_queue_bytes
        self._spills: OrderedDict[bytes, Entry] = OrderedDict()
        self._spill_bytes = 0
        self._spills_writing = 0
        self._spill_moved = threading.Condition(self.lock)
        self._promoting: dict[bytes, threading.Event] = {}  # disk hits being read in
        self._disk_readers = ThreadPoolExecutor(DISK_READERS, thread_name_prefix="disk-read")
        self.disk_counts: Counter[str] = Counter()
        self.disk_seconds: dict[str, float] = {"write": 0.0, "read": 0.0}
        self.disk_error = ""

    # Sessions -----------------------------------------------------------------------------

    def open_session(self, name: str, owner: str = "") -> str:
        """A new session; only calls whose caller is ``owner`` may use it (the server
        checks, ``session_owner``)."""
        with self.lock:
            if len(self._sessions) >= self.max_sessions:
                raise Busy(
                    f"{len(self._sessions)} sessions are open, the most --max-sessions allows; "
                    "close idle clients or raise --max-sessions"
                )
            cap = self.budgets.get(owner, NO_BUDGET).sessions
            if cap and sum(s.owner == owner for s in self._sessions.values()) >= cap:
                raise Busy(
                    f"tenant {owner} has {cap} sessions open, the most its tenants file entry "
                    "allows; close idle clients"
                )
            session_id = secrets.token_hex(8)
            self._sessions[session_id] = Session(session_id, name, self.clock(), owner=owner)
            return session_id

    def session_owner(self, session_id: str) -> str | None:
        """Who may use the session (None: there is none)."""
        with self.lock:
            session = self._sessions.get(session_id)
            return None if session is None else session.owner

    def attach_stream(self, session_id: str, holds_pool: bool = False) -> None:
        """A heartbeat stream opened: the session's process is alive until it closes (then
        ``end_session``), however long it stays silent. One per session: each holds a server
        thread, and ``max_sessions`` bounds them only so. ``holds_pool``: the process opened
        a device pool by IPC; it counts as an importer for as long as the stream lives."""
        with self.lock:
            session = self._session(session_id)
            if session.streams:
                raise AlreadyExists(f"session {session_id} has its heartbeat stream already")
            session.streams += 1
            if holds_pool:
                self.pool.importers.add(session_id)

    def renew(self, session_id: str) -> None:
        """A sign of life: pushes back the expiry of everything the session holds."""
        with self.lock:
            session = self._session(session_id)
            now = self.clock()
            session.last_seen = now
            for lease_id in session.leases:
                self._leases[lease_id].expires_at = now + self.lease_ttl
            for reservation_id in session.reservations:
                self._reservations[reservation_id].expires_at = now + self.lease_ttl

    def end_session(self, session_id: str) -> None:
        """The client is gone: its reservations are aborted and its leases released."""
        with self.lock:
            session = self._sessions.pop(session_id, None)
            self.pool.importers.discard(session_id)
            if session is None:
                return
            for reservation_id in list(session.reservations):
                self._drop_reservation(self._reservations[reservation_id])
            for lease_id in list(session.leases):
                self._drop_lease(self._leases[lease_id])
            for blocks in session.quarantined.values():  # its process is gone: nobody writes
                self._unquarantine(blocks)

    def expire(self) -> int:
        """Reclaim leases and reservations whose holder stopped renewing them, and sessions
        that hold nothing, have no heartbeat stream open and were silent for a TTL. The blocks
        of an expired reservation whose session still has a stream open are quarantined, not
        freed: its writer is paused, not dead, and may copy into them when it resumes. Returns
        how many things went."""
        with self.lock:
            now = self.clock()
            gone = 0
            for reservation in [r for r in self._reservations.values() if r.expires_at <= now]:
                self._drop_reservation(reservation, outcome="expired")
                gone += 1
            for lease in [x for x in self._leases.values() if x.expires_at <= now]:
                self._drop_lease(lease)
                gone += 1
            for session in list(self._sessions.values()):
                idle = now - session.last_seen > self.lease_ttl
                if idle and not (session.leases or session.reservations or session.streams):
                    self.end_session(session.id)
            return gone

    # Reads --------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], tenant: str = "") -> list[Entry | DiskEntry | None]:
        """What each key finds in ``tenant``'s namespace: its entry in memory, else in the
        disk tier, else None. An entry of another namespace under the same key is None: a
        key names an entry only where it was stored (as ``acquire``)."""
        check_keys(keys)
        with self.lock:
            found: list[Entry | DiskEntry | None] = [self._entries.get(k) for k in keys]
        if self.disk is not None:
            found = [
                self.disk.lookup(k) if e is None else e for k, e in zip(keys, found, strict=True)
            ]
        return [e if e is not None and e.tenant == tenant else None for e in found]

    def count_hits(
        self,
        found: Sequence[bool],
        num_tokens: Sequence[int] = (),
        entry_kind: str = "chunk",
        tenant: str = "",
    ) -> None:
        """Count a client's lookup of ``entry_kind`` entries: keys looked up and found, and,
        when the client sent each key's token count, tokens looked up and found (hit rate
        by tokens); in all, by kind and by the caller's tenant."""
        check_entry_kind(entry_kind)
        with self.lock:
            by_tenant = self._tenant_counts.setdefault(tenant, Counter())
            for counts in (self._counts, self._kind_counts[entry_kind], by_tenant):
                counts["lookups"] += len(found)
                counts["hits"] += sum(found)
                if num_tokens:
                    counts["lookup_tokens"] += sum(num_tokens)
                    counts["hit_tokens"] += sum(
                        n for n, hit in zip(num_tokens, found, strict=True) if hit
                    )

    def acquire(
        self, session_id: str, keys: Sequence[bytes], tenant: str = ""
    ) -> list[tuple[Lease, Entry] | None]:
        """A lease on each key's entry of ``tenant``, None where it has none. A key only the
        disk tier holds is read back into the pool first (``_acquire_from_disk``), as
        ``tenant``'s."""
        check_keys(keys)
        with self.lock:
            self._refuse_if_draining()
            self._session(session_id)
            out = [
                self._lease(session_id, entry)
                if (entry := self._entries.get(key)) and entry.tenant == tenant
                else None
                for key in keys
            ]
            for key in keys:  # hits and misses: what the worth policy ranks by
                self.policy.read(key)
        disk = self.disk
        missed = [i for i, got in enumerate(out) if got is None]
        on_disk = [i for i in missed if keys[i] in disk] if disk is not None else []
        if len(on_disk) == 1:
            out[on_disk[0]] = self._acquire_from_disk(session_id, keys[on_disk[0]], tenant)
        elif on_disk:  # several files read at once: the device's queue kept full
            reads = [
                self._disk_readers.submit(self._acquire_from_disk, session_id, keys[i], tenant)
                for i in on_disk
            ]
            for i, read in zip(on_disk, reads, strict=True):
                out[i] = read.result()
        return out

    def _acquire_from_disk(
        self, session_id: str, key: bytes, tenant: str
    ) -> tuple[Lease, Entry] | None:
        """Promote a disk entry: take blocks for it, read it into them outside the lock
        (lookups and other acquires go on meanwhile; a second acquire of the same key waits
        for this one), then commit it (its checksum checked by the read) and lease it. None
        where that fails: the file went bad or away (it is removed), or the pool has no room
        (everything leased or pinned); counted, never served."""
        assert self.disk is not None
        while True:
            with self.lock:
                self._refuse_if_draining()
                entry = self._entries.get(key)
                if entry is not None:
                    return self._lease(session_id, entry) if entry.tenant == tenant else None
                pending = self._promoting.get(key)
                if pending is None:
                    found = self.disk.lookup(key)
                    if found is None or found.tenant != tenant or key in self._reserved_keys:
                        return None
                    try:
                        blocks = self._allocate(self.pool.blocks_for(found.nbytes), tenant)
                    except PoolFull as err:
                        self._disk_failed("promote", err)
                        return None
                    done = self._promoting[key] = threading.Event()
                    break
            pending.wait()
        began = time.perf_counter()
        failure: Exception | None = None
        try:
            self.disk.read_into(key, Pieces(self.pool.views(blocks, found.nbytes)))
        except (NotFound, ChecksumMismatch, DiskError) as err:
            failure = err
        with self.lock:
            del self._promoting[key]
            done.set()
            if failure is not None:
                self._free_charged(tenant, blocks)
                self._disk_failed("read", failure)
                return None
            self.disk_seconds["read"] += time.perf_counter() - began
            self.disk_counts["promotions"] += 1
            self.disk_counts["promoted_bytes"] += found.nbytes
            entry = Entry(key, found.layout, found.nbytes, blocks, found.checksum, tenant=tenant)
            self._add(entry)
            leased = self._lease(session_id, entry)
            self._evict_to_watermark()
            return leased

    def _lease(self, session_id: str, entry: Entry) -> tuple[Lease, Entry]:
        session = self._session(session_id)
        lease = Lease(self._new_id(), entry, session_id, self.clock() + self.lease_ttl)
        self._leases[lease.id] = lease
        session.leases.add(lease.id)
        entry.leases += 1
        self._place(entry)  # out of the eviction order; ranked again when free
        return lease, entry

    def release(self, session_id: str, lease_ids: Sequence[int]) -> None:
        with self.lock:
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is None or lease.session != session_id:
                    raise NotFound(f"no lease {lease_id} in session {session_id}")
                self._drop_lease(lease)

    def lease(self, session_id: str, lease_id: int) -> Entry:
        """The entry a held lease reads (for streaming its bytes)."""
        with self.lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.session != session_id:
                raise NotFound(f"no lease {lease_id} in session {session_id}")
            return lease.entry

    # Writes -------------------------------------------------------------------------------

    def reserve(
        self, session_id: str, key: bytes, layout: EntryLayout, nbytes: int, tenant: str = ""
    ) -> Reservation:
        """Blocks for a new entry of ``tenant``'s, evicting for room: first its own least
        recently used entries while it would pass its quota, then the pool's oldest, save
        what other tenants' reserved shares keep."""
        check_keys([key])
        layout.validate()
        if nbytes != layout.nbytes:
            raise InvalidRequest(f"{nbytes} bytes do not match the layout's {layout.nbytes}")
        if nbytes > self.pool.capacity:
            raise InvalidRequest(
                f"an entry of {nbytes} bytes can never fit a pool of {self.pool.capacity}"
            )
        with self.lock:
            quota = self.budgets.get(tenant, NO_BUDGET).quota
            if quota and self.pool.blocks_for(nbytes) * self.pool.block_size > quota:
                raise InvalidRequest(
                    f"an entry of {nbytes} bytes can never fit tenant {tenant}'s quota of {quota}"
                )
            self._refuse_if_draining()
            session = self._session(session_id)
            if key in self._entries or (self.disk is not None and key in self.disk):
                raise AlreadyExists(f"{key.hex()} is committed already")
            if key in self._reserved_keys or key in self._promoting:
                raise AlreadyExists(f"{key.hex()} is being written by another reservation")
            blocks = self._allocate(self.pool.blocks_for(nbytes), tenant)
            reservation = Reservation(
                self._new_id(),
                key,
                session_id,
                layout,
                nbytes,
                blocks,
                self.clock() + self.lease_ttl,
                tenant=tenant,
            )
            self._reservations[reservation.id] = reservation
            self._reserved_keys[key] = reservation.id
            session.reservations.add(reservation.id)
            return reservation

    def reservation(self, session_id: str, reservation_id: int) -> Reservation:
        with self.lock:
            reservation = self._reservations.get(reservation_id)
            outcome, owner = self._finished.get(reservation_id, ("", ""))
            if reservation is None and outcome and owner == session_id:
                session = self._sessions.get(session_id)
                if session is not None and reservation_id in session.quarantined:
                    # Its writer is back and asks about it: done copying, the blocks can go.
                    self._unquarantine(session.quarantined.pop(reservation_id))
                raise WrongState(f"reservation {reservation_id} was {outcome} already")
            if reservation is None or reservation.session != session_id:
                raise NotFound(f"no reservation {reservation_id} in session {session_id}")
            return reservation

    def commit(
        self,
        session_id: str,
        reservation_id: int,
        claimed_checksum: int,
        streamed: bool = False,
        verify: bool | None = None,
    ) -> Entry:
        """Make a reservation readable. With ``verify`` (default: ``verify_commits``) the
        pool's bytes are hashed and must match the writer's checksum; a mismatch aborts the
        reservation."""
        with self.lock:
            reservation = self.reservation(session_id, reservation_id)
            if streamed and reservation.written != reservation.nbytes:
                raise WrongState(
                    f"reservation {reservation_id} got {reservation.written} of "
                    f"{reservation.nbytes} bytes"
                )
            if self.verify_commits if verify is None else verify:
                actual = self.pool.checksum(reservation.blocks, reservation.nbytes)
                if actual != claimed_checksum:
                    self._drop_reservation(reservation)
                    raise ChecksumMismatch(
                        f"reservation {reservation_id}: pool bytes hash to {actual:#x}, the "
                        f"writer said {claimed_checksum:#x}; aborted"
                    )
            self._forget_reservation(reservation, "committed")
            entry = Entry(
                reservation.key,
                reservation.layout,
                reservation.nbytes,
                reservation.blocks,
                claimed_checksum,
                tenant=reservation.tenant,
            )
            self._add(entry)
            self._evict_to_watermark()
            return entry

    def store(
        self, key: bytes, layout: EntryLayout, data: np.ndarray, claimed: int, tenant: str = ""
    ) -> bool:
        """Store a whole entry whose bytes are in hand: see ``store_with``."""
        if data.shape[0] != layout.nbytes:
            raise InvalidRequest(f"{data.shape[0]} bytes for a layout of {layout.nbytes}")

        def fill(blocks: list[int]) -> None:
            self.pool.scatter(blocks, data)

        return self.store_with(key, layout, fill, claimed, tenant)

    def store_with(
        self,
        key: bytes,
        layout: EntryLayout,
        fill: Callable[[list[int]], None],
        claimed: int,
        tenant: str = "",
    ) -> bool:
        """Store a peer's entry, as ``tenant``'s: reserve, ``fill`` the reserved blocks, hash
        them against the checksum the peer committed (always, whatever ``verify_commits``
        says), commit; in a session of its own. False if the key is stored or being stored
        here already. If ``fill`` raises or the bytes do not hash to ``claimed``, nothing is
        stored and the blocks go back to the pool."""
        session = self.open_session("store")
        try:
            # While it is open, an expired reservation's blocks are quarantined, not reused:
            # ``fill`` may still be writing into them.
            self.attach_stream(session)
            try:
                reservation = self.reserve(session, key, layout, layout.nbytes, tenant)
            except AlreadyExists:
                return False
            fill(reservation.blocks)
            # Hashed here, outside the lock (lookups go on meanwhile): nobody else writes a
            # reservation's blocks, so these are the bytes the commit makes readable.
            actual = self.pool.checksum(reservation.blocks, reservation.nbytes)
            if actual != claimed:
                raise ChecksumMismatch(
                    f"entry {key.hex()} hashes to {actual:#x}, committed by its peer as "
                    f"{claimed:#x}: not stored"
                )
            self.commit(session, reservation.id, claimed, verify=False)
            return True
        finally:
            self.end_session(session)

    def abort(self, session_id: str, reservation_id: int) -> None:
        with self.lock:
            self._drop_reservation(self.reservation(session_id, reservation_id))

    # Admin --------------------------------------------------------------------------------

    def evict(self, keys: Sequence[bytes], reason: str = "admin") -> tuple[int, int]:
        """Evict these entries, from both tiers; leased, pinned or spilling ones stay.
        Returns (evicted, busy)."""
        check_keys(keys)
        with self.lock:
            evicted = busy = 0
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and (entry.leases or entry.pinned or entry.spill):
                    busy += 1
                elif entry is not None:
                    self._evict(entry, reason)
                    evicted += 1
                elif self.disk is not None and self.disk.remove(key):
                    evicted += 1
            return evicted, busy

    def clear(self) -> tuple[int, int]:
        """Evict every evictable entry, and empty the disk tier of what memory does not
        hold, however many (no batch limit: nothing crosses the wire). Returns (evicted,
        busy)."""
        with self.lock:
            evicted = 0
            for order in self._orders.values():
                for key in list(order):  # every one goes: no need to pop them in rank order
                    self._evict(self._entries[key], "clear")
                    evicted += 1
            if self.disk is not None:
                evicted += sum(self.disk.remove(k) for k in self.disk.keys() - self._entries.keys())
            return evicted, len(self._entries)

    def set_pinned(self, keys: Sequence[bytes], pinned: bool) -> int:
        check_keys(keys)
        with self.lock:
            missing = [k.hex() for k in keys if k not in self._entries]
            if missing:  # all or nothing
                raise NotFound(f"no entry {', '.join(missing)}: nothing was changed")
            entries = list({k: self._entries[k] for k in keys}.values())
            changed = sum(e.pinned != pinned for e in entries)
            for entry in entries:
                if entry.pinned != pinned:
                    entry.pinned = pinned
                    self._pinned += 1 if pinned else -1
                    self._place(entry)
            return changed

    def verify(self, keys: Sequence[bytes]) -> list[bytes]:
        """Hash these committed entries' pool bytes against their commit checksums; evict the
        ones that fail (reason "corrupt"; a leased one's blocks go with its last lease), so
        the next put replaces them. Returns the keys found corrupt. Each distinct key is
        hashed once and outside the lock (a call naming one large entry 4,096 times held
        every other caller for seconds); a failing entry is evicted only if it is still the
        entry that was hashed."""
        check_keys(keys)
        corrupt = []
        for key in dict.fromkeys(keys):
            with self.lock:
                entry = self._entries.get(key)
            if entry is None or self.pool.checksum(entry.blocks, entry.nbytes) == entry.checksum:
                continue
            with self.lock:
                if self._entries.get(key) is entry:
                    self._evict(entry, "corrupt")
                    corrupt.append(key)
        return corrupt

    def set_budgets(self, budgets: dict[str, Budget]) -> None:
        """The tenants' budgets from now on (a reload): nothing is evicted now; a tenant past
        a lowered quota evicts its own entries at its next write."""
        with self.lock:
            self.budgets = dict(budgets)
            if self.disk is not None:  # read at each spill: a lowered one evicts then
                self.disk.quotas = {t: b.disk_quota for t, b in budgets.items() if b.disk_quota}
            for tenant in budgets:
                self._tenant_counts.setdefault(tenant, Counter())
            gone = [t for t, c in self._tenant_counts.items() if t and t not in budgets]
            for tenant in gone:  # a removed tenant's figures go with its last entry
                if not self._tenant_counts[tenant]["entries"] and not self._held[tenant]:
                    del self._tenant_counts[tenant]

    def start_draining(self) -> None:
        with self.lock:
            self.draining = True

    def stop_draining(self) -> bool:
        """Serve reads and writes again. Returns whether it was draining."""
        with self.lock:
            was, self.draining = self.draining, False
            return was

    # The disk tier (the daemon's spill thread and its stop) -------------------------------

    def spill_one(self, timeout: float = 0.2) -> bool:
        """One step of the spill thread: write the oldest queued entry to the disk tier,
        outside the lock. False if nothing was queued within ``timeout`` seconds."""
        assert self.disk is not None
        got = self.next_spill(timeout)
        if got is None:
            return False
        entry, parts = got
        began = time.perf_counter()
        failure, evicted = None, []
        try:
            evicted = self.disk.write(entry.key, entry.layout, parts, entry.checksum, entry.tenant)
        except DiskError as err:
            failure = err
        except Exception as err:  # a bug, not the disk: still hand the blocks back
            failure = DiskError("unexpected failure", OSError(errno.EIO, repr(err)))
            log.exception("disk tier: writing %s failed", entry.key.hex())
        self.spilled(entry, time.perf_counter() - began, failure, len(evicted))
        return True

    def next_spill(self, timeout: float) -> tuple[Entry, list[np.ndarray]] | None:
        """The oldest queued entry and its pool bytes, held for the spill thread (kept out
        of eviction, blocks kept) until it calls ``spilled``; None if none came within
        ``timeout`` seconds."""
        assert self.disk is not None
        with self.lock:
            if not self._spills and not self._spill_moved.wait(timeout):
                return None
            while self._spills:
                _, entry = self._spills.popitem(last=False)
                self._spill_bytes -= entry.nbytes
                entry.spill = Spill.NONE
                if entry.key in self.disk:
                    continue
                entry.spill = Spill.WRITING
                self._spills_writing += 1
                self._place(entry)
                return entry, self.pool.views(entry.blocks, entry.nbytes)
            return None

    def spilled(
        self, entry: Entry, seconds: float, failure: DiskError | None, evicted: int = 0
    ) -> None:
        """The spill thread is done with ``entry`` (``evicted``: disk entries it displaced):
        its blocks go back to the index's rules."""
        with self.lock:
            self.disk_counts["evictions"] += evicted
            entry.spill = Spill.NONE
            self._spills_writing -= 1
            self._place(entry)
            self._free_if_unheld(entry)
            self._spill_moved.notify_all()
            if failure is not None:
                self._disk_failed("write", failure)
                return
            self.disk_seconds["write"] += seconds
            self.disk_counts["spills"] += 1
            self.disk_counts["spill_bytes"] += entry.nbytes

    def persist(self, timeout: float) -> int:
        """Queue every memory entry the disk tier lacks, whatever the queue's bound, and wait
        up to ``timeout`` seconds for the spill thread to write them (a clean stop: called
        once when draining begins with no wait, then again to wait). Returns how many were
        left unwritten."""
        if self.disk is None:
            return 0
        deadline = time.monotonic() + timeout
        with self.lock:
            for entry in self._entries.values():
                self._queue_spill(entry, bounded=False)
            while self._spills or self._spills_writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._spill_moved.wait(left)
            return len(self._spills) + self._spills_writing

    def _queue_spill(self, entry: Entry, bounded: bool = True) -> None:
        """Queue a committed entry for the disk tier (lock held). A full queue drops it (it
        stays in memory, counted): a Reserve never waits for the disk."""
        if self.disk is None or entry.spill or entry.key in self.disk:
            return
        full = self._spills and self._spill_bytes + entry.nbytes > self.spill_queue_bytes
        if bounded and full:  # an empty queue takes any entry: a big one spills too
            self.disk_counts["dropped_queue_full"] += 1
            return
        entry.spill = Spill.QUEUED
        self._spills[entry.key] = entry
        self._spill_bytes += entry.nbytes
        self._spill_moved.notify_all()

    def _disk_failed(self, op: str, err: Exception) -> None:
        self.disk_counts[f"errors_{op}"] += 1
        self.disk_error = f"{op}: {err}"
        log.warning("disk tier: %s failed: %s", op, err)

    def disk_stats(self) -> DiskStats | None:
        disk = self.disk
        if disk is None:
            return None
        with self.lock:
            return DiskStats(
                directory=str(disk.directory),
                entries=len(disk),
                bytes_used=disk.used,
                bytes_capacity=disk.capacity,
                spill_queue_bytes=self._spill_bytes,
                spills_writing=self._spills_writing,
                removed_at_start=len(disk.removed_at_start),
                last_error=self.disk_error,
                counts={**self.disk_counts, "foreign": len(disk.foreign)},
                seconds=dict(self.disk_seconds),
            )

    def stats(self) -> IndexStats:
        disk = self.disk_stats()
        with self.lock:
            used_blocks = self.pool.num_blocks - self.pool.free_blocks
            names = ("lookups", "hits", "lookup_tokens", "hit_tokens", "entries", "bytes")
            kinds = {
                kind: {name: counts[name] for name in names}
                for kind, counts in self._kind_counts.items()
            }
            tenants = {
                tenant: {
                    **{name: counts[name] for name in (*names, "evictions")},
                    "held_bytes": self._held[tenant] * self.pool.block_size,
                    "quota_bytes": self.budgets.get(tenant, NO_BUDGET).quota,
                    "reserved_bytes": self.budgets.get(tenant, NO_BUDGET).reserved,
                }
                for tenant, counts in self._tenant_counts.items()
            }
            return IndexStats(
                entries=len(self._entries),
                pinned_entries=self._pinned,
                bytes_used=used_blocks * self.pool.block_size,
                bytes_capacity=self.pool.capacity,
                blocks_free=self.pool.free_blocks,
                blocks_total=self.pool.num_blocks,
                active_leases=len(self._leases),
                active_reservations=len(self._reservations),
                sessions=len(self._sessions),
                pool_importers=len(self.pool.importers),
                lookups=self._counts["lookups"],
                hits=self._counts["hits"],
                lookup_tokens=self._counts["lookup_tokens"],
                hit_tokens=self._counts["hit_tokens"],
                evictions=dict(self.evictions),
                draining=self.draining,
                blocks_quarantined=self._quarantined_blocks,
                kinds=kinds,
                disk=disk,
                tenants=tenants,
            )

    def entries(self) -> list[Entry]:
        with self.lock:
            return list(self._entries.values())

    def held_keys(self) -> set[bytes]:
        """Every key a lookup finds, in either tier (what the cluster directory claims)."""
        with self.lock:
            keys = set(self._entries)
        return keys | self.disk.keys() if self.disk is not None else keys

    def sessions(self) -> list[Session]:
        with self.lock:
            return list(self._sessions.values())

    def reservations(self) -> list[Reservation]:
        with self.lock:
            return list(self._reservations.values())

    # Internals (called with the lock held) ------------------------------------------------

    def _new_id(self) -> int:
        """A lease or reservation id nobody holds: random, so one tenant's ids tell nothing
        of how many others take (a counter did). Dropped from the set when its holder ends."""
        while True:
            candidate = secrets.randbits(62) + 1
            if candidate not in self._ids_used and candidate not in self._finished:
                self._ids_used.add(candidate)
                return candidate

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}: call Hello first (or it expired)")
        return session

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise WrongState("the daemon is draining: no new reads or writes")

    def _allocate(self, count: int, tenant: str = "") -> list[int]:
        """``count`` blocks, charged to ``tenant``. Past its quota, its own least recently
        used entries go first; then, if the pool has too few free, the oldest evictable
        entry of any tenant that stays within what its reserved share keeps (``_victim``).
        Nothing is evicted when that could not make room."""
        bs = self.pool.block_size
        quota = self.budgets.get(tenant, NO_BUDGET).quota
        if quota and (self._held[tenant] + count) * bs > quota:
            if (self._held[tenant] - self._evictable[tenant] + count) * bs > quota:
                raise PoolFull(
                    f"tenant {tenant} is at its quota of {quota} bytes: it holds "
                    f"{self._held[tenant] * bs}, {self._evictable[tenant] * bs} of them "
                    f"evictable, and needs {count * bs} more; the rest are leased, pinned or "
                    "reserved"
                )
            while (self._held[tenant] + count) * bs > quota:
                head = self._orders[tenant].head()
                assert head is not None  # enough of its own was evictable
                self._evict(head, "quota")
        blocks = self.pool.allocate(count)
        if blocks is None:
            evictable = sum(self._evictable_for(t, tenant) for t in self._orders)
            if self.pool.free_blocks + evictable < count:  # evicting would not make room
                raise PoolFull(
                    f"need {count} blocks, {self.pool.free_blocks} free and {evictable} "
                    "evictable; the rest are leased, pinned, reserved or other tenants' "
                    "reserved shares"
                )
            while blocks is None:
                victim = self._victim(tenant)
                if victim is None:  # an entry straddling a reserved share's edge
                    raise PoolFull(f"need {count} blocks: other tenants' reserved shares")
                self._evict(victim, "capacity")
                blocks = self.pool.allocate(count)
        self._held[tenant] += count
        return blocks

    def _free_charged(self, tenant: str, blocks: list[int]) -> None:
        """Blocks ``_allocate`` charged to ``tenant`` back to the pool, unused."""
        self._held[tenant] -= len(blocks)
        self.pool.free(blocks)

    def _place(self, entry: Entry) -> None:
        """Keep the eviction order to the evictable entries: after any change to an entry's
        pins or leases, in it (ranked as of now) exactly when it is committed, unpinned and
        unleased."""
        writing = entry.spill is Spill.WRITING
        evictable = not (entry.leases or entry.pinned or entry.evicted or writing)
        order = self._orders.get(entry.tenant)
        if evictable and (order is None or entry.key not in order):
            if order is None:
                order = self._orders[entry.tenant] = self.policy.order()
            entry.rank = self.policy.rank(entry)
            order.add(entry)
            self._evictable[entry.tenant] += len(entry.blocks)
        elif not evictable and order is not None and order.remove(entry):
            self._evictable[entry.tenant] -= len(entry.blocks)

    def _keeps(self, tenant: str, blocks: int) -> bool:
        """Whether ``tenant`` holding ``blocks`` fewer would dip into its reserved share."""
        reserved = self.budgets.get(tenant, NO_BUDGET).reserved
        return (self._held[tenant] - blocks) * self.pool.block_size < reserved

    def _evictable_for(self, tenant: str, evicting_for: str | None) -> int:
        """Blocks of ``tenant``'s that may be evicted for ``evicting_for``'s room (None: the
        watermark's): all its evictable ones for itself, above its reserved share for
        anyone else."""
        evictable = self._evictable[tenant]
        reserved = self.budgets.get(tenant, NO_BUDGET).reserved
        if tenant == evicting_for or not reserved:
            return evictable
        kept = (reserved + self.pool.block_size - 1) // self.pool.block_size
        return max(0, min(evictable, self._held[tenant] - kept))

    def _victim(self, evicting_for: str | None) -> Entry | None:
        """The lowest ranked evictable entry whose eviction leaves every other tenant's
        reserved share whole: the heads of the tenants' orders compared (O(tenants))."""
        best: Entry | None = None
        for tenant, order in self._orders.items():
            head = order.head()
            if head is None or (tenant != evicting_for and self._keeps(tenant, len(head.blocks))):
                continue
            if best is None or head.rank < best.rank:
                best = head
        return best

    def _evict_to_watermark(self) -> None:
        total = self.pool.num_blocks
        if total - self.pool.free_blocks <= self.high_watermark * total:
            return
        while total - self.pool.free_blocks > self.low_watermark * total:
            victim = self._victim(None)
            if victim is None:
                return
            self._evict(victim, "watermark")

    def _add(self, entry: Entry) -> None:
        """A committed entry into the index, the eviction order and (if the disk tier lacks
        it) the spill queue."""
        self._entries[entry.key] = entry
        self._held_by_kind(entry, 1)
        self._place(entry)
        self._queue_spill(entry)

    def _held_by_kind(self, entry: Entry, sign: int) -> None:
        """Entries and bytes by kind and by tenant, kept as entries come and go (stats never
        walk them)."""
        by_tenant = self._tenant_counts.setdefault(entry.tenant, Counter())
        for counts in (self._kind_counts[entry.layout.entry_kind], by_tenant):
            counts["entries"] += sign
            counts["bytes"] += sign * entry.nbytes

    def _evict(self, entry: Entry, reason: str) -> None:
        del self._entries[entry.key]
        self._held_by_kind(entry, -1)
        self._held[entry.tenant] -= len(entry.blocks)  # its tenant's, even while leases read it
        self._tenant_counts[entry.tenant]["evictions"] += 1
        entry.evicted = True
        self._place(entry)
        if entry.pinned:
            self._pinned -= 1
        if entry.spill is Spill.QUEUED:  # gone before the spill thread got to it
            del self._spills[entry.key]
            self._spill_bytes -= entry.nbytes
            entry.spill = Spill.NONE
            self.disk_counts["dropped_evicted"] += 1
        if self.disk is not None and reason in ("admin", "clear", "corrupt"):
            self.disk.remove(entry.key)  # forgotten, not moved down a tier
        self._free_if_unheld(entry)
        if reason in ("capacity", "watermark", "quota"):  # for room: the worth policy ages
            self.policy.evicted(entry)
        self.evictions[reason] += 1
        if self.on_evict:
            self.on_evict(reason, entry.nbytes)

    def _forget_reservation(self, reservation: Reservation, outcome: str) -> None:
        self._finished[reservation.id] = (outcome, reservation.session)
        if len(self._finished) > 10_000:
            self._finished.popitem(last=False)
        del self._reservations[reservation.id]
        self._ids_used.discard(reservation.id)
        del self._reserved_keys[reservation.key]
        session = self._sessions.get(reservation.session)
        if session:
            session.reservations.discard(reservation.id)

    def _drop_reservation(self, reservation: Reservation, outcome: str = "aborted") -> None:
        self._forget_reservation(reservation, outcome)
        self._held[reservation.tenant] -= len(reservation.blocks)
        session = self._sessions.get(reservation.session)
        if outcome == "expired" and session is not None and session.streams:
            session.quarantined[reservation.id] = reservation.blocks
            self._quarantined_blocks += len(reservation.blocks)
        else:
            self.pool.free(reservation.blocks)

    def _unquarantine(self, blocks: list[int]) -> None:
        self._quarantined_blocks -= len(blocks)
        self.pool.free(blocks)

    def _drop_lease(self, lease: Lease) -> None:
        del self._leases[lease.id]
        self._ids_used.discard(lease.id)
        lease.entry.leases -= 1
        self._place(lease.entry)
        self._free_if_unheld(lease.entry)
        session = self._sessions.get(lease.session)
        if session:
            session.leases.discard(lease.id)

    def _free_if_unheld(self, entry: Entry) -> None:
        """An evicted entry's blocks go once no lease reads them and no spill writes them."""
        if entry.evicted and not entry.leases and entry.spill is not Spill.WRITING:
            self.pool.free(entry.blocks)
