"""What the index holds: entries, the reservations they are written under, the leases they
are read under, the sessions that own both, and the tenants' budgets (``index.py`` moves
them through their states; nothing here changes one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chunkstore.errors import InvalidRequest
from chunkstore.kv.entry import EntryLayout
from chunkstore.kv.keys import KEY_BYTES
from chunkstore.protocol.wire import MAX_BATCH


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
    # Held from eviction until its first lease or this clock time (Commit's hold_ms; 0: not)
    held_until: float = 0.0
    seal: tuple[int, int] | None = None  # a device pool's, at commit (``Pool.seal``)
    # Its lease message less the lease's id and key (service.py's Acquire), made at its first
    # lease and copied for each: its layout, bytes, blocks and checksum never change.
    lease_message: Any = field(default=None, repr=False, compare=False)


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


def check_keys(keys: Sequence[bytes]) -> None:
    """A call's keys: at most MAX_BATCH, each KEY_BYTES long (InvalidRequest otherwise)."""
    if len(keys) > MAX_BATCH:
        raise InvalidRequest(f"{len(keys)} keys in one call; at most {MAX_BATCH}")
    for key in keys:
        if len(key) != KEY_BYTES:
            raise InvalidRequest(f"a key is {KEY_BYTES} bytes, got {len(key)}")
