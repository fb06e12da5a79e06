"""Who holds what: the open sessions, the leases they read entries under and the reservations
they write entries under, each with an id and an expiry that the session's heartbeat pushes
back (``lease_ttl``).

Entries and their blocks are the index's (``index.py``): this module records and forgets
holdings, and the index changes the entries they name. The one set of blocks it frees itself
is a quarantine: the blocks of a reservation that expired while its session's process lived
(a heartbeat stream open) stay out of the pool until that writer is known to be done copying
into them: it asks about the reservation again, or its session ends. Called with the
index's lock held.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections import OrderedDict
from collections.abc import Callable

from chunkstore.daemon.records import Budget, Entry, Lease, Reservation, Session
from chunkstore.errors import AlreadyExists, Busy, NotFound, SessionLost, WrongState
from chunkstore.kv.entry import EntryLayout

FINISHED_KEPT = 10_000  # recent reservations' outcomes kept for their sessions to ask about


_IDS_DRAWN = 256  # lease and reservation ids drawn from the OS at once


class Sessions:
    def __init__(
        self,
        lease_ttl: float,
        max_sessions: int,
        clock: Callable[[], float],
        free: Callable[[list[int]], None],
    ) -> None:
        self.lease_ttl = lease_ttl
        self.max_sessions = max_sessions
        self.clock = clock
        self._free = free  # the pool's: where quarantined blocks go
        self.open: dict[str, Session] = {}
        self.leases: dict[int, Lease] = {}
        self.reservations: dict[int, Reservation] = {}
        self.reserved_keys: dict[bytes, int] = {}  # key -> the reservation writing it
        # Recent reservations' outcomes, told only to the session that made each.
        self._finished: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._ids_used: set[int] = set()  # ids of live leases and reservations
        self._spare_ids: list[int] = []  # random ids drawn ahead (_new_id)
        self.quarantined_blocks = 0

    # Sessions -----------------------------------------------------------------------------

    def start(self, name: str, owner: str, budget: Budget) -> str:
        """A new session for ``owner`` (whose ``budget`` may cap its sessions)."""
        if len(self.open) >= self.max_sessions:
            raise Busy(
                f"{len(self.open)} sessions are open, the most --max-sessions allows; "
                "close idle clients or raise --max-sessions"
            )
        cap = budget.sessions
        if cap and sum(s.owner == owner for s in self.open.values()) >= cap:
            raise Busy(
                f"tenant {owner} has {cap} sessions open, the most its tenants file entry "
                "allows; close idle clients"
            )
        session_id = secrets.token_hex(8)
        self.open[session_id] = Session(session_id, name, self.clock(), owner=owner)
        return session_id

    def get(self, session_id: str) -> Session:
        session = self.open.get(session_id)
        if session is None:
            raise SessionLost(f"no session {session_id!r}: call Hello first (or it expired)")
        return session

    def attach_stream(self, session_id: str) -> None:
        """A heartbeat stream opened (one per session: each holds a server thread)."""
        session = self.get(session_id)
        if session.streams:
            raise AlreadyExists(f"session {session_id} has its heartbeat stream already")
        session.streams += 1

    def renew(self, session_id: str) -> None:
        """A sign of life: pushes back the expiry of everything the session holds."""
        session = self.get(session_id)
        now = self.clock()
        session.last_seen = now
        for lease_id in session.leases:
            self.leases[lease_id].expires_at = now + self.lease_ttl
        for reservation_id in session.reservations:
            self.reservations[reservation_id].expires_at = now + self.lease_ttl

    def expired(self) -> tuple[list[Reservation], list[Lease]]:
        """The reservations and leases whose holder stopped renewing them."""
        now = self.clock()
        return (
            [r for r in self.reservations.values() if r.expires_at <= now],
            [x for x in self.leases.values() if x.expires_at <= now],
        )

    def idle(self) -> list[str]:
        """Sessions that hold nothing, have no heartbeat stream open and were silent for a
        TTL."""
        now = self.clock()
        return [
            s.id
            for s in self.open.values()
            if now - s.last_seen > self.lease_ttl and not (s.leases or s.reservations or s.streams)
        ]

    def unquarantine(self, session: Session) -> None:
        """The session's process is gone: nobody writes its quarantined blocks any more."""
        for blocks in session.quarantined.values():
            self._release_quarantined(blocks)
        session.quarantined.clear()

    # Leases and reservations --------------------------------------------------------------

    def add_lease(self, session_id: str, entry: Entry) -> Lease:
        session = self.get(session_id)
        lease = Lease(self._new_id(), entry, session_id, self.clock() + self.lease_ttl)
        self.leases[lease.id] = lease
        session.leases.add(lease.id)
        return lease

    def lease(self, session_id: str, lease_id: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.session != session_id:
            raise NotFound(f"no lease {lease_id} in session {session_id}")
        return lease

    def forget_lease(self, lease: Lease) -> None:
        del self.leases[lease.id]
        self._ids_used.discard(lease.id)
        session = self.open.get(lease.session)
        if session:
            session.leases.discard(lease.id)

    def add_reservation(
        self,
        session_id: str,
        key: bytes,
        layout: EntryLayout,
        blocks: list[int],
        tenant: str,
    ) -> Reservation:
        session = self.get(session_id)
        reservation = Reservation(
            self._new_id(),
            key,
            session_id,
            layout,
            layout.nbytes,
            blocks,
            self.clock() + self.lease_ttl,
            tenant=tenant,
        )
        self.reservations[reservation.id] = reservation
        self.reserved_keys[key] = reservation.id
        session.reservations.add(reservation.id)
        return reservation

    def reservation(self, session_id: str, reservation_id: int) -> Reservation:
        """The session's live reservation; WrongState if it ended (its quarantined blocks,
        if any, go back: its writer is back and asks, so it is done copying)."""
        reservation = self.reservations.get(reservation_id)
        outcome, owner = self._finished.get(reservation_id, ("", ""))
        if reservation is None and outcome and owner == session_id:
            session = self.open.get(session_id)
            if session is not None and reservation_id in session.quarantined:
                self._release_quarantined(session.quarantined.pop(reservation_id))
            raise WrongState(f"reservation {reservation_id} was {outcome} already")
        if reservation is None or reservation.session != session_id:
            raise NotFound(f"no reservation {reservation_id} in session {session_id}")
        return reservation

    def forget_reservation(self, reservation: Reservation, outcome: str) -> None:
        """The reservation ended (``outcome``: committed, aborted, expired); its blocks are
        the caller's to keep (a commit) or to hand to ``free_reserved``."""
        self._finished[reservation.id] = (outcome, reservation.session)
        if len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)
        del self.reservations[reservation.id]
        self._ids_used.discard(reservation.id)
        del self.reserved_keys[reservation.key]
        session = self.open.get(reservation.session)
        if session:
            session.reservations.discard(reservation.id)

    def free_reserved(self, reservation: Reservation, outcome: str) -> None:
        """An ended reservation's blocks back to the pool, or into quarantine where it
        expired while its writer's process lives."""
        session = self.open.get(reservation.session)
        if outcome == "expired" and session is not None and session.streams:
            session.quarantined[reservation.id] = reservation.blocks
            self.quarantined_blocks += len(reservation.blocks)
        else:
            self._free(reservation.blocks)

    def _release_quarantined(self, blocks: list[int]) -> None:
        self.quarantined_blocks -= len(blocks)
        self._free(blocks)

    def _new_id(self) -> int:
        """A lease or reservation id nobody holds: random, so one tenant's ids tell nothing
        of how many others take (a counter did). Dropped from the set when its holder ends.
        Drawn from the OS ``_IDS_DRAWN`` at a time: one system call a lease cost an Acquire of
        64 keys 70 us of its 0.78 ms."""
        while True:
            if not self._spare_ids:
                drawn = os.urandom(8 * _IDS_DRAWN)
                self._spare_ids = [(v >> 2) + 1 for v in struct.unpack(f"<{_IDS_DRAWN}Q", drawn)]
            candidate = self._spare_ids.pop()  # 62 random bits, never 0
            if candidate not in self._ids_used and candidate not in self._finished:
                self._ids_used.add(candidate)
                return candidate
