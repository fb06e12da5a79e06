"""The index's moves between memory and the disk tier (``disk.py``).

A memory miss the tier holds is read back into new blocks and committed (``_acquire_from_disk``,
outside the lock); the daemon's spill thread takes queued committed entries and writes them
to the tier (``spill_one``: ``next_spill``, the write, ``spilled``), holding their blocks
while it does (an entry being written is not evictable, as a leased one); a clean stop
writes what the tier lacks (``persist``). Disk I/O never runs under the lock.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from chunkstore.daemon.disk import DiskError
from chunkstore.daemon.entry_table import EntryTable
from chunkstore.daemon.records import Entry, Lease
from chunkstore.daemon.spill import DiskStats
from chunkstore.errors import ChecksumMismatch, NotFound, PoolFull
from chunkstore.protocol.shm import Pieces

log = logging.getLogger("chunkstore.daemon.index")


class DiskMoves(EntryTable):
    """The index's moves to and from the disk tier, over its entry table."""

    # Disk hits read into the pool ---------------------------------------------------------

    def _acquire_missed(
        self,
        session_id: str,
        keys: Sequence[bytes],
        out: list[tuple[Lease, Entry] | None],
        tenant: str,
    ) -> None:
        """Fill ``out``'s misses the disk tier holds (``_acquire_from_disk``): several read
        at once, so that the device's queue stays full."""
        disk = self.disk
        missed = [i for i, got in enumerate(out) if got is None]
        on_disk = [i for i in missed if keys[i] in disk] if disk is not None else []
        if len(on_disk) == 1:
            out[on_disk[0]] = self._acquire_from_disk(session_id, keys[on_disk[0]], tenant)
        elif on_disk:
            reads = [
                self._disk_readers.submit(self._acquire_from_disk, session_id, keys[i], tenant)
                for i in on_disk
            ]
            for i, read in zip(on_disk, reads, strict=True):
                out[i] = read.result()

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
                    if found is None or found.tenant != tenant or key in self.holders.reserved_keys:
                        return None
                    try:
                        blocks = self._allocate(self.pool.blocks_for(found.nbytes), tenant)
                    except PoolFull as err:
                        self.spill.failed("promote", err)
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
                self.spill.failed("read", failure)
                return None
            self.spill.promoted(found.nbytes, time.perf_counter() - began)
            entry = Entry(key, found.layout, found.nbytes, blocks, found.checksum, tenant=tenant)
            self._add(entry)
            leased = self._lease(session_id, entry)
            self._evict_to_watermark()
            return leased

    # The spill thread and its stop --------------------------------------------------------

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
            if not self.spill.queued and not self.spill.moved.wait(timeout):
                return None
            while (entry := self.spill.take()) is not None:
                if entry.key in self.disk:
                    continue
                self.spill.start(entry)
                self.budgets.place(entry)
                return entry, self.pool.views(entry.blocks, entry.nbytes)
            return None

    def spilled(
        self, entry: Entry, seconds: float, failure: DiskError | None, evicted: int = 0
    ) -> None:
        """The spill thread is done with ``entry`` (``evicted``: disk entries it displaced):
        its blocks go back to the index's rules."""
        with self.lock:
            self.spill.written(entry, seconds, failure, evicted)
            self.budgets.place(entry)
            self._free_if_unheld(entry)

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
            while self.spill.pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.spill.moved.wait(left)
            return self.spill.pending()

    def disk_stats(self) -> DiskStats | None:
        disk = self.disk
        if disk is None:
            return None
        with self.lock:
            return self.spill.stats(disk)
