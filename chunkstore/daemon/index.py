"""The content-hash index: key -> entry, and every state change an entry goes through.

One path (docs/semantics.md#daemon): reserve -> commit (or abort) -> lease -> release -> evict.
An entry is unreadable until committed; a leased or pinned entry is never evicted; leases and
reservations belong to a session and go when it ends or stops renewing them (TTL). Eviction
takes the lowest ranked entry (``eviction.py``: least recently used, or least worth): on demand
when a reservation needs room, and down to the low watermark once usage passes the high one. The
index owns entries; the pool owns bytes and free blocks; one lock serializes both, and the parts
the index keeps under it:

- ``sessions.py``: who holds what (sessions, their leases and reservations, quarantine);
- ``budgets.py``: the tenants' shares (blocks held, eviction orders, what may go for whom);
- ``spill.py``: the queue to the disk tier and what the tier did;
- ``counts.py``: what ``stats`` reports, counted as it changes.

The class is in three files, by job: ``entry_table.py`` (the state above and the steps every
path takes under the lock: allocate, add, evict, drop), ``disk_moves.py`` (to and from the
disk tier) and this one (the public paths: sessions, reads, writes, admin, stats).

With a disk tier (``disk.py``) a committed entry is queued for the daemon's spill thread
(``spill_one``) at its commit or once it is read again (``spill_when``); the thread holds
its blocks while it writes them (an entry being written is not evictable, as a leased one);
a memory miss the tier holds is read back into new blocks and committed
(``_acquire_from_disk``). Disk I/O never runs under the lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from chunkstore.daemon.counts import IndexStats
from chunkstore.daemon.disk import DiskEntry
from chunkstore.daemon.disk_moves import DiskMoves
from chunkstore.daemon.records import Budget, Entry, Lease, Reservation, Session, check_keys
from chunkstore.daemon.spill import SpillWhen
from chunkstore.errors import (
    AlreadyExists,
    ChecksumMismatch,
    InvalidRequest,
    NotFound,
    WrongState,
)
from chunkstore.kv.entry import EntryKind, EntryLayout
from chunkstore.protocol.keyed_digest import SumKey, Summed


class Index(DiskMoves):
    """The index's public paths; its state and lock-held steps are ``EntryTable``'s, its
    moves to and from the disk tier ``DiskMoves``'."""

    # Sessions -----------------------------------------------------------------------------

    def open_session(self, name: str, owner: str = "") -> str:
        """A new session; only calls whose caller is ``owner`` may use it (the server
        checks, ``session_owner``)."""
        with self.lock:
            return self.holders.start(name, owner, self.budgets.of(owner))

    def session_owner(self, session_id: str) -> str | None:
        """Who may use the session (None: there is none)."""
        with self.lock:
            session = self.holders.open.get(session_id)
            return None if session is None else session.owner

    def attach_stream(self, session_id: str, holds_pool: bool = False) -> None:
        """A heartbeat stream opened: the session's process is alive until it closes (then
        ``end_session``), however long it stays silent. One per session: each holds a server
        thread, and ``max_sessions`` bounds them only so. ``holds_pool``: the process opened
        a device pool by IPC; it counts as an importer for as long as the stream lives."""
        with self.lock:
            self.holders.attach_stream(session_id)
            if holds_pool:
                self.pool.importers.add(session_id)

    def renew(self, session_id: str) -> None:
        """A sign of life: pushes back the expiry of everything the session holds."""
        with self.lock:
            self.holders.renew(session_id)

    def end_session(self, session_id: str) -> None:
        """The client is gone: its reservations are aborted and its leases released."""
        with self.lock:
            session = self.holders.open.pop(session_id, None)
            self.pool.importers.discard(session_id)
            if session is None:
                return
            for reservation_id in list(session.reservations):
                self._drop_reservation(self.holders.reservations[reservation_id])
            for lease_id in list(session.leases):
                self._drop_lease(self.holders.leases[lease_id])
            self.holders.unquarantine(session)

    def expire(self) -> int:
        """Reclaim leases and reservations whose holder stopped renewing them, end the holds
        past their time, and end sessions that hold nothing, have no heartbeat stream open
        and were silent for a TTL. The blocks of an expired reservation whose session still
        has a stream open are quarantined, not freed: its writer is paused, not dead, and may
        copy into them when it resumes. Returns how many things went."""
        with self.lock:
            reservations, leases = self.holders.expired()
            for reservation in reservations:
                self._drop_reservation(reservation, outcome="expired")
            for lease in leases:
                self._drop_lease(lease)
            for session_id in self.holders.idle():
                self.end_session(session_id)
            return len(reservations) + len(leases) + self._lapse_holds()

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
        entry_kind: str = EntryKind.CHUNK,
        tenant: str = "",
    ) -> None:
        """Count a client's lookup of ``entry_kind`` entries: keys looked up and found, and,
        when the client sent each key's token count, tokens looked up and found (hit rate
        by tokens); in all, by kind and by the caller's tenant."""
        with self.lock:
            self.counts.looked_up(found, num_tokens, entry_kind, tenant)

    def acquire(
        self, session_id: str, keys: Sequence[bytes], tenant: str = ""
    ) -> list[tuple[Lease, Entry] | None]:
        """A lease on each key's entry of ``tenant``, None where it has none. A key only the
        disk tier holds is read back into the pool first (``_acquire_from_disk``), as
        ``tenant``'s."""
        check_keys(keys)
        with self.lock:
            self._refuse_if_draining()
            self.holders.get(session_id)
            out = [
                self._lease(session_id, entry)
                if (entry := self._entries.get(key)) and entry.tenant == tenant
                else None
                for key in keys
            ]
            for key in keys:  # hits and misses: what the worth policy ranks by
                self.policy.read(key)
            if self.spill_when is SpillWhen.READ_AGAIN:
                for got in out:
                    if got is not None and self.policy.read_again(got[1].key):
                        self._queue_spill(got[1])
        self._acquire_missed(session_id, keys, out, tenant)
        return out

    def release(self, session_id: str, lease_ids: Sequence[int]) -> None:
        with self.lock:
            for lease_id in lease_ids:
                self._drop_lease(self.holders.lease(session_id, lease_id))

    def lapsed(self, session_id: str, lease_ids: Sequence[int]) -> list[int]:
        """Of these leases, those the session no longer holds (expired, or released)."""
        with self.lock:
            held = self.holders.leases
            return [i for i in lease_ids if i not in held or held[i].session != session_id]

    def lease(self, session_id: str, lease_id: int) -> Entry:
        """The entry a held lease reads (NotFound: none, or past its TTL: dropped here)."""
        with self.lock:
            if self.holders.lease(session_id, lease_id).expires_at <= self.holders.clock():
                self.expire()  # due: the reaper runs only every so often
            return self.holders.lease(session_id, lease_id).entry

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
            quota = self.budgets.of(tenant).quota
            if quota and self.pool.blocks_for(nbytes) * self.pool.block_size > quota:
                raise InvalidRequest(
                    f"an entry of {nbytes} bytes can never fit tenant {tenant}'s quota of {quota}"
                )
            self._refuse_if_draining()
            self.holders.get(session_id)
            if key in self._entries or (self.disk is not None and key in self.disk):
                raise AlreadyExists(f"{key.hex()} is committed already")
            if key in self.holders.reserved_keys or key in self._promoting:
                raise AlreadyExists(f"{key.hex()} is being written by another reservation")
            blocks = self._allocate(self.pool.blocks_for(nbytes), tenant)
            return self.holders.add_reservation(session_id, key, layout, blocks, tenant)

    def reservation(self, session_id: str, reservation_id: int) -> Reservation:
        with self.lock:
            return self.holders.reservation(session_id, reservation_id)

    def commit(
        self,
        session_id: str,
        reservation_id: int,
        claimed_checksum: int,
        streamed: bool = False,
        verify: bool | None = None,
        hold: float = 0.0,
    ) -> Entry:
        """Make a reservation readable. With ``verify`` (default: ``verify_commits``) the
        pool's bytes are hashed and must match the writer's checksum; a mismatch aborts the
        reservation. ``hold`` > 0: the entry is not evicted until its first lease or for
        ``hold`` seconds (``_hold``)."""
        held = self.reservation(session_id, reservation_id)  # sealed outside the lock
        seal = self.pool.seal(held.blocks, held.nbytes)
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
            self.holders.forget_reservation(reservation, "committed")
            entry = Entry(
                reservation.key,
                reservation.layout,
                reservation.nbytes,
                reservation.blocks,
                claimed_checksum,
                tenant=reservation.tenant,
                seal=seal,
            )
            if hold > 0:
                self._hold(entry, hold)
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
            for order in self.budgets.orders.values():
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
                    self.budgets.place(entry)
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

    def summed(self, lease: Lease) -> Summed | None:
        """A fresh key and the leased entry's keyed sums under it (``Pool.keyed_sums``), of
        its pool bytes now, checked in the same pass (outside the lock: a lease keeps its
        blocks). None where they fail: the entry is evicted as corrupt and the lease ends."""
        entry, key = lease.entry, SumKey.fresh()
        sums = self.pool.keyed_sums(entry.blocks, entry.nbytes, entry.checksum, entry.seal, key)
        if sums is not None:
            return Summed(key, sums)
        with self.lock:
            if self.holders.leases.get(lease.id) is lease:
                self._drop_lease(lease)
            if self._entries.get(entry.key) is entry:
                self._evict(entry, "corrupt")
        return None

    def set_budgets(self, budgets: dict[str, Budget]) -> None:
        """The tenants' budgets from now on (a reload): nothing is evicted now; a tenant past
        a lowered quota evicts its own entries at its next write."""
        with self.lock:
            self.budgets.budgets = dict(budgets)
            if self.disk is not None:  # read at each spill: a lowered one evicts then
                self.disk.quotas = {t: b.disk_quota for t, b in budgets.items() if b.disk_quota}
            self.counts.tenants_now(list(budgets), self.budgets.held)

    def start_draining(self) -> None:
        with self.lock:
            self.draining = True

    def stop_draining(self) -> bool:
        """Serve reads and writes again. Returns whether it was draining."""
        with self.lock:
            was, self.draining = self.draining, False
            return was

    def stats(self) -> IndexStats:
        disk = self.disk_stats()
        with self.lock:
            pool, holders, counts = self.pool, self.holders, self.counts
            return IndexStats(
                entries=len(self._entries),
                pinned_entries=self._pinned,
                bytes_used=(pool.num_blocks - pool.free_blocks) * pool.block_size,
                bytes_capacity=pool.capacity,
                blocks_free=pool.free_blocks,
                blocks_total=pool.num_blocks,
                active_leases=len(holders.leases),
                active_reservations=len(holders.reservations),
                sessions=len(holders.open),
                pool_importers=len(pool.importers),
                lookups=counts.total["lookups"],
                hits=counts.total["hits"],
                lookup_tokens=counts.total["lookup_tokens"],
                hit_tokens=counts.total["hit_tokens"],
                evictions=dict(counts.evictions),
                held_entries=len(self._holds),
                holds=dict(counts.holds),
                draining=self.draining,
                blocks_quarantined=holders.quarantined_blocks,
                kinds=counts.by_kind(),
                disk=disk,
                tenants=counts.by_tenant(self.budgets),
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
            return list(self.holders.open.values())

    def reservations(self) -> list[Reservation]:
        with self.lock:
            return list(self.holders.reservations.values())
