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
