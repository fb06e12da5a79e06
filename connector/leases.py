"""The scheduler's leases (scheduler process): what each request holds in the daemon, taken
by one batch lookup (an Acquire keeps hit entries from eviction until the workers have
loaded them), trimmed to what the workers will load, and released when its loads end or it
ends. A lease lives in the daemon session it was taken in: one of a session that ended went
with it and is not released again."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from chunkstore.client import LeasedEntry
from chunkstore.errors import ChunkStoreError
from chunkstore.kv.entry import EntryKind

from .client_holder import DaemonLink
from .keys import SegmentPlan
from .metrics import ConnectorStats


@dataclass
class Held:
    """Leases one request holds, in the daemon session they were taken in."""

    session: str
    leases: dict[int, LeasedEntry] = field(default_factory=dict)  # segment index -> lease
    extra: list[LeasedEntry] = field(default_factory=list)  # summaries, digests (sparse)


class Leases:
    """Each request's ``Held``, by request ID."""

    def __init__(self, link: DaemonLink, stats: ConnectorStats, summed: bool) -> None:
        self.link = link
        self.stats = stats
        # Each decode context-parallel rank reads only its part of an entry, checked with the
        # group's parts against the entry's summed checksum (``Loads._read_held``)
        self.summed = summed
        self._held: dict[str, Held] = {}

    def acquire(self, segments: list[SegmentPlan], kind: str) -> Held:
        """Lease every stored one of ``segments`` (one batch call); no session: no daemon."""
        client = self.link.get()
        if client is None:
            self.stats.add("daemon_unreachable")
            return Held("")
        try:
            entries = client.acquire(
                [s.key for s in segments], [len(s.segment) for s in segments], kind, self.summed
            )
        except ChunkStoreError as err:
            self.link.trouble("lookup", err)
            self.stats.add("daemon_unreachable")
            return Held("")
        looked_up = sum(len(s.segment) for s in segments)
        self.stats.add("lookups")
        self.stats.add("lookup_tokens", looked_up)
        if kind == EntryKind.PREFIX:
            self.stats.add("prefix_lookup_tokens", looked_up)
        leases = {i: entry for i, entry in enumerate(entries) if entry is not None}
        return Held(client.session, leases)

    def acquire_more(
        self, held: Held, keys: list[bytes], kind: str, what: str
    ) -> list[LeasedEntry | None] | None:
        """Lease ``keys`` beside ``held``'s, in its session, until the request ends (None: the
        daemon is gone, or the session is not ``held``'s any more)."""
        client = self.link.get()
        if client is None or client.session != held.session:
            return None
        try:
            found = client.acquire(keys, entry_kind=kind)
        except ChunkStoreError as err:
            self.link.trouble(f"lookup of {what}", err)
            return None
        held.extra += [lease for lease in found if lease is not None]
        return found

    def hold(self, req_id: str, held: Held) -> None:
        self._held[req_id] = held

    def get(self, req_id: str) -> Held | None:
        return self._held.get(req_id)

    def keep(self, req_id: str, wanted: Callable[[int], bool]) -> None:
        """Release the request's leases on segments ``wanted`` rejects."""
        held = self._held.get(req_id)
        if held is None:
            return
        dropped = {i: lease for i, lease in held.leases.items() if not wanted(i)}
        for index in dropped:
            del held.leases[index]
        self._release_leases(held.session, list(dropped.values()))

    def count_read(self, req_id: str, shm_bytes_read: int) -> None:
        """Report the bytes a request's loads read over shared memory, its leases kept."""
        held = self._held.get(req_id)
        if held is not None:
            self._release_leases(held.session, [], shm_bytes_read)

    def release(self, req_id: str, shm_bytes_read: int = 0) -> None:
        """Release all the request's leases, with the bytes its loads read."""
        held = self._held.pop(req_id, None)
        if held is not None:
            leases = [*held.leases.values(), *held.extra]
            self._release_leases(held.session, leases, shm_bytes_read)
        elif shm_bytes_read and (client := self.link.get()) is not None:
            # vLLM frees a request (request_finished: leases gone) before it hands over the
            # workers' output of the same step, so a load whose request ended in that step (a
            # one-token answer) reports its bytes here, with no lease left.
            self._release_leases(client.session, [], shm_bytes_read)

    def release_all(self) -> None:
        for req_id in list(self._held):
            self.release(req_id)

    def _release_leases(
        self, session: str, leases: list[LeasedEntry], shm_bytes_read: int = 0
    ) -> None:
        client = self.link.get()
        if not (leases or shm_bytes_read) or client is None or client.session != session:
            return  # leases of a session that ended went with it
        try:
            client.release([lease.lease_id for lease in leases], shm_bytes_read)
        except ChunkStoreError as err:
            self.link.trouble("release", err)
