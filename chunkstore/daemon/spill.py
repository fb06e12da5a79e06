"""The way to the disk tier (``disk.py``): committed entries queued for the daemon's spill
thread, oldest first and bounded in bytes, the ones being written, and what the tier did
(counts, seconds, the last failure).

When an entry is queued is the daemon's ``--spill`` rule (``SpillWhen``): at each commit, or
once it is read again (its key asked for a second time: at that Acquire if it is in memory,
at the commit that stores it again otherwise), so what one request alone ever uses is never
written.

An entry's ``spill`` state says where it stands: queued (still evictable; an eviction takes
it out of the queue), writing (its blocks stay, whatever evicts it, until the write ends).
A full queue drops what comes (it stays in memory, counted): a Reserve never waits for the
disk. Called with the index's lock held; ``moved`` is a condition on that lock, notified
whenever the queue or the writes change (the spill thread and a stopping daemon wait on it).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from chunkstore.daemon.disk import DiskTier
from chunkstore.daemon.records import Entry, Spill

log = logging.getLogger(__name__)


class SpillWhen(StrEnum):
    """When a committed entry goes to the disk tier (``serve --spill``)."""

    COMMIT = "commit"  # every commit (write-through)
    READ_AGAIN = "read-again"  # once its key is asked for a second time


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


class SpillQueue:
    def __init__(self, lock: threading.RLock, bound: int) -> None:
        self.bound = bound  # bytes queued at most (an empty queue takes any entry)
        self.queued: OrderedDict[bytes, Entry] = OrderedDict()
        self.bytes = 0
        self.writing = 0
        self.moved = threading.Condition(lock)
        self.counts: Counter[str] = Counter()
        self.seconds: dict[str, float] = {"write": 0.0, "read": 0.0}
        self.error = ""

    def pending(self) -> int:
        """Entries queued or being written."""
        return len(self.queued) + self.writing

    def add(self, entry: Entry, bounded: bool = True) -> None:
        full = self.queued and self.bytes + entry.nbytes > self.bound
        if bounded and full:
            self.counts["dropped_queue_full"] += 1
            return
        entry.spill = Spill.QUEUED
        self.queued[entry.key] = entry
        self.bytes += entry.nbytes
        self.moved.notify_all()

    def drop(self, entry: Entry) -> None:
        """``entry`` is evicted: out of the queue if the spill thread had not got to it."""
        if entry.spill is Spill.QUEUED:
            del self.queued[entry.key]
            self.bytes -= entry.nbytes
            entry.spill = Spill.NONE
            self.counts["dropped_evicted"] += 1

    def take(self) -> Entry | None:
        """The oldest queued entry, out of the queue (None: it is empty)."""
        if not self.queued:
            return None
        _, entry = self.queued.popitem(last=False)
        self.bytes -= entry.nbytes
        entry.spill = Spill.NONE
        return entry

    def start(self, entry: Entry) -> None:
        entry.spill = Spill.WRITING
        self.writing += 1

    def written(
        self, entry: Entry, seconds: float, failure: Exception | None, evicted: int
    ) -> None:
        """The spill thread is done with ``entry`` (``evicted``: disk entries it displaced)."""
        self.counts["evictions"] += evicted
        entry.spill = Spill.NONE
        self.writing -= 1
        self.moved.notify_all()
        if failure is not None:
            self.failed("write", failure)
            return
        self.seconds["write"] += seconds
        self.counts["spills"] += 1
        self.counts["spill_bytes"] += entry.nbytes

    def promoted(self, nbytes: int, seconds: float) -> None:
        self.seconds["read"] += seconds
        self.counts["promotions"] += 1
        self.counts["promoted_bytes"] += nbytes

    def failed(self, op: str, err: Exception) -> None:
        self.counts[f"errors_{op}"] += 1
        self.error = f"{op}: {err}"
        log.warning("disk tier: %s failed: %s", op, err)

    def stats(self, disk: DiskTier) -> DiskStats:
        return DiskStats(
            directory=str(disk.directory),
            entries=len(disk),
            bytes_used=disk.used,
            bytes_capacity=disk.capacity,
            spill_queue_bytes=self.bytes,
            spills_writing=self.writing,
            removed_at_start=len(disk.removed_at_start),
            last_error=self.error,
            counts={**self.counts, "foreign": len(disk.foreign)},
            seconds=dict(self.seconds),
        )
