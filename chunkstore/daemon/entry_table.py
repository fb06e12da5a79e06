"""The index's entry table and what changes it under the index's lock.

``EntryTable`` holds the state ``Index`` (``index.py``) works on: the committed entries, the
pool, the lock, the parts kept under it (sessions, budgets, spill queue, counts), and the
few steps every path of the index takes with the lock held: allocate blocks (evicting for
room), add a committed entry, evict one, drop a lease or a reservation, free an evicted
entry's blocks once nothing reads or writes them. Nothing here takes the lock itself: the
callers hold it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from chunkstore.daemon.budgets import Budgets
from chunkstore.daemon.counts import Counts
from chunkstore.daemon.disk import DiskTier
from chunkstore.daemon.eviction import make_policy
from chunkstore.daemon.pool import Pool
from chunkstore.daemon.records import Entry, Lease, Reservation, Spill
from chunkstore.daemon.sessions import Sessions
from chunkstore.daemon.spill import SpillQueue, SpillWhen
from chunkstore.errors import InvalidRequest, PoolFull, WrongState

DISK_READERS = 4  # disk hits of one Acquire read at once


class EntryTable:
    """The index's state, and the steps its paths take under its lock (``Index``)."""

    def __init__(
        self,
        pool: Pool,
        *,
        lease_ttl: float = 30.0,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        verify_commits: bool = False,
        max_sessions: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str, int], None] | None = None,
        disk: DiskTier | None = None,
        spill_queue_bytes: int = 1 << 30,
        spill_when: SpillWhen = SpillWhen.COMMIT,
        eviction: str = "lru",
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise InvalidRequest("watermarks need 0 < low <= high <= 1")
        self.pool = pool
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.verify_commits = verify_commits
        self.on_evict = on_evict
        self.lock = threading.RLock()
        self.draining = False
        self._entries: dict[bytes, Entry] = {}
        self._pinned = 0
        self._holds: dict[bytes, Entry] = {}  # committed with a hold, not yet leased
        self.policy = make_policy(eviction)
        self.holders = Sessions(lease_ttl, max_sessions, clock, free=pool.free)
        self.budgets = Budgets(self.policy, pool.block_size)
        self.counts = Counts()
        # The disk tier: committed entries queued (bounded, in bytes) for the spill thread.
        self.disk = disk
        self.spill = SpillQueue(self.lock, spill_queue_bytes)
        self.spill_when = spill_when
        self._promoting: dict[bytes, threading.Event] = {}  # disk hits being read in
        self._disk_readers = ThreadPoolExecutor(DISK_READERS, thread_name_prefix="disk-read")

    # Internals (called with the lock held) ------------------------------------------------

    def _lease(self, session_id: str, entry: Entry) -> tuple[Lease, Entry]:
        lease = self.holders.add_lease(session_id, entry)
        entry.leases += 1
        if entry.held_until:  # read: what it was held for
            self._end_hold(entry, "read")
        self.budgets.place(entry)  # out of the eviction order; ranked again when free
        return lease, entry

    def _hold(self, entry: Entry, seconds: float) -> None:
        """Keep a just committed entry from eviction until its first lease, or ``seconds``
        (at most the lease TTL). Not held where held entries would pass half the pool: a
        hold is a hint, never a way to fill the pool."""
        held = sum(len(e.blocks) for e in self._holds.values())
        if (held + len(entry.blocks)) * 2 > self.pool.num_blocks:
            self.counts.holds["refused"] += 1
            return
        entry.held_until = self.holders.clock() + min(seconds, self.holders.lease_ttl)
        self._holds[entry.key] = entry

    def _end_hold(self, entry: Entry, outcome: str) -> None:
        """The entry's hold ends (``outcome``: read, lapsed, evicted); callers place it."""
        entry.held_until = 0.0
        del self._holds[entry.key]
        self.counts.holds[outcome] += 1

    def _lapse_holds(self) -> int:
        """End the holds past their time: their entries join the eviction order."""
        now = self.holders.clock()
        lapsed = [e for e in self._holds.values() if e.held_until <= now]
        for entry in lapsed:
            self._end_hold(entry, "lapsed")
            self.budgets.place(entry)
        return len(lapsed)

    def _queue_spill(self, entry: Entry, bounded: bool = True) -> None:
        """Queue a committed entry for the disk tier (lock held), unless the tier holds it."""
        if self.disk is None or entry.spill or entry.key in self.disk:
            return
        self.spill.add(entry, bounded)

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise WrongState("the daemon is draining: no new reads or writes")

    def _allocate(self, count: int, tenant: str = "") -> list[int]:
        """``count`` blocks, charged to ``tenant``. Past its quota, its own lowest ranked
        entries go first; then, if the pool has too few free, the lowest ranked evictable
        entry of any tenant that stays within what its reserved share keeps
        (``Budgets.victim``). Nothing is evicted when that could not make room."""
        budgets = self.budgets
        while budgets.over_quota(tenant, count):
            head = budgets.orders[tenant].head()
            assert head is not None  # enough of its own was evictable (over_quota checks)
            self._evict(head, "quota")
        blocks = self.pool.allocate(count)
        if blocks is None:
            evictable = budgets.evictable_total(tenant)
            free = self.pool.free_blocks
            if free + evictable < count:  # evicting would not make room
                bs = self.pool.block_size
                raise PoolFull(
                    f"need {count} blocks, {free} free and {evictable} evictable; the rest are "
                    "leased, pinned, reserved or other tenants' reserved shares",
                    needed=count * bs,
                    free=free * bs,
                    evictable=evictable * bs,
                )
            while blocks is None:
                victim = budgets.victim(tenant)
                if victim is None:  # an entry straddling a reserved share's edge
                    raise PoolFull(f"need {count} blocks: other tenants' reserved shares")
                self._evict(victim, "capacity")
                blocks = self.pool.allocate(count)
        budgets.held[tenant] += count
        return blocks

    def _free_charged(self, tenant: str, blocks: list[int]) -> None:
        """Blocks ``_allocate`` charged to ``tenant`` back to the pool, unused."""
        self.budgets.held[tenant] -= len(blocks)
        self.pool.free(blocks)

    def _evict_to_watermark(self) -> None:
        total = self.pool.num_blocks
        if total - self.pool.free_blocks <= self.high_watermark * total:
            return
        while total - self.pool.free_blocks > self.low_watermark * total:
            victim = self.budgets.victim(None)
            if victim is None:
                return
            self._evict(victim, "watermark")

    def _add(self, entry: Entry) -> None:
        """A committed entry into the index, the eviction order and (if the disk tier lacks
        it, and ``spill_when`` says so now) the spill queue."""
        self._entries[entry.key] = entry
        self.counts.held(entry, 1)
        self.budgets.place(entry)
        if self.spill_when is SpillWhen.COMMIT or self.policy.read_again(entry.key):
            self._queue_spill(entry)

    def _evict(self, entry: Entry, reason: str) -> None:
        del self._entries[entry.key]
        self.counts.held(entry, -1)
        self.counts.evicted(entry, reason)
        self.budgets.held[entry.tenant] -= len(entry.blocks)  # even while leases read it
        entry.evicted = True
        if entry.held_until:  # an admin's eviction: a hold never keeps one
            self._end_hold(entry, "evicted")
        self.budgets.place(entry)
        if entry.pinned:
            self._pinned -= 1
        self.spill.drop(entry)  # gone before the spill thread got to it
        if self.disk is not None and reason in ("admin", "clear", "corrupt"):
            self.disk.remove(entry.key)  # forgotten, not moved down a tier
        self._free_if_unheld(entry)
        if reason in ("capacity", "watermark", "quota"):  # for room: the worth policy ages
            self.policy.evicted(entry)
        if self.on_evict:
            self.on_evict(reason, entry.nbytes)

    def _drop_reservation(self, reservation: Reservation, outcome: str = "aborted") -> None:
        self.holders.forget_reservation(reservation, outcome)
        self.budgets.held[reservation.tenant] -= len(reservation.blocks)
        self.holders.free_reserved(reservation, outcome)

    def _drop_lease(self, lease: Lease) -> None:
        self.holders.forget_lease(lease)
        lease.entry.leases -= 1
        self.budgets.place(lease.entry)
        self._free_if_unheld(lease.entry)

    def _free_if_unheld(self, entry: Entry) -> None:
        """An evicted entry's blocks go once no lease reads them and no spill writes them."""
        if entry.evicted and not entry.leases and entry.spill is not Spill.WRITING:
            self.pool.free(entry.blocks)
