"""Typed errors. Each carries what the caller needs to act on it."""

from __future__ import annotations


class ChunkStoreError(Exception):
    """Base of every error chunkstore raises on purpose."""


class UnsupportedRotaryError(ChunkStoreError):
    """A rotary variant whose rotation by a position delta is not exact.

    Remapping such keys would serve wrong KV, so callers must fall back to computing.
    """

    def __init__(self, rope_type: str, reason: str) -> None:
        self.rope_type = rope_type
        self.reason = reason
        super().__init__(f"cannot remap keys under rotary variant {rope_type!r}: {reason}")


class SegmentationError(ChunkStoreError):
    """A prompt or separator that cannot be split into segments."""


class LayoutError(ChunkStoreError):
    """Tensors whose shape, dtype or device do not match what the operation needs."""


class StoreError(ChunkStoreError):
    """An error of the daemon's API. ``code`` names the gRPC status it travels as."""

    code = "INTERNAL"


class InvalidRequest(StoreError):
    code = "INVALID_ARGUMENT"


class NotFound(StoreError):
    """An unknown key, reservation, lease or session."""

    code = "NOT_FOUND"


class SessionLost(NotFound):
    """The daemon knows no such session: it restarted, the session ended (its process gone,
    or paused past the lease TTL without its heartbeat stream), or it is another caller's
    (answered alike, so a session id learns nothing). What it held went with it; a client
    opens a new one. It travels by name as well as by code (``protocol/wire.py``), so a
    client tells it from an unknown key or lease by its type."""


class AlreadyExists(StoreError):
    """The key is committed already, or another writer holds a reservation for it."""

    code = "ALREADY_EXISTS"


class Exhausted(StoreError):
    """A limit is reached: the pool's room (``PoolFull``), or the sessions or transfer
    streams the daemon serves at once (``Busy``). Over the wire both arrive as this class."""

    code = "RESOURCE_EXHAUSTED"


class PoolFull(Exhausted):
    """No room, even after evicting every entry that is neither leased nor pinned: the bytes
    ``needed``, those ``free`` and those ``evictable`` for the caller (0 where not known: over
    the wire the type travels, the figures only in the message)."""

    def __init__(self, message: str, needed: int = 0, free: int = 0, evictable: int = 0) -> None:
        super().__init__(message)
        self.needed, self.free, self.evictable = needed, free, evictable


class Busy(Exhausted):
    """As many sessions or transfer streams as the daemon allows are open; retry later."""


class LeaseLapsed(NotFound):
    """A lease ended before its entry's bytes were all read (its holder paused or stalled
    past the lease TTL, and the blocks went to another entry): what was read fails its
    checksum and is never used; acquire the entry again."""


class WrongState(StoreError):
    """An operation out of order: commit after abort, double commit, short write, draining."""

    code = "FAILED_PRECONDITION"


class ChecksumMismatch(StoreError):
    """The bytes are not the bytes that were committed. Never use them."""

    code = "DATA_LOSS"


class Unauthenticated(StoreError):
    code = "UNAUTHENTICATED"


class Forbidden(StoreError):
    """An admin call without the admin token."""

    code = "PERMISSION_DENIED"


class Unavailable(StoreError):
    """The daemon cannot be reached (or is shutting down)."""

    code = "UNAVAILABLE"


class DeviceError(StoreError):
    """A device runtime refused: no such device in this process, a pool handle opened twice,
    memory freed while importers still hold it."""

    code = "FAILED_PRECONDITION"
