"""The shared-memory pool as both sides see it: an entry's bytes lie in fixed-size blocks of one
mapped region, in the order of its block list. The daemon writes and hashes them there; a
client on the same host maps the region and copies in and out without going through the
daemon. Plain functions over a uint8 array, so neither side needs the other's code.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first block, run length, index in ``blocks``) for each run of consecutive blocks:
    consecutive blocks are one contiguous copy."""
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield blocks[i], j - i, i
        i = j


STRIPE = 1 << 20  # the checksum's unit, and the piece copied then hashed while in L2


class EntryDigest:
    """An entry's checksum: xxh3-64 over the xxh3-64 digests of its 1 MiB stripes, in order
    (the last one may be short). The bytes can be fed in pieces of any size, and whole
    stripes can be hashed apart, by several threads, and added in order (``add_stripe``):
    the result is the same whichever way."""

    def __init__(self) -> None:
        self._digests = bytearray()
        self._stripe = xxhash.xxh3_64()
        self._filled = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(STRIPE - self._filled, len(view))
            self._stripe.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == STRIPE:
                self._close()

    def add_stripe(self, digest: int) -> None:
        """The digest of the next whole stripe, hashed elsewhere (``stripe_digest``)."""
        if self._filled:
            raise ValueError("a stripe added in the middle of one being fed")
        self._digests += digest.to_bytes(8, "little")

    def _close(self) -> None:
        self._digests += self._stripe.intdigest().to_bytes(8, "little")
        self._stripe.reset()
        self._filled = 0

    def intdigest(self) -> int:
        tail = self._stripe.intdigest().to_bytes(8, "little") if self._filled else b""
        return xxhash.xxh3_64_intdigest(bytes(self._digests) + tail)


def stripe_digest(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(data)


def extents(blocks: Sequence[int], block_size: int, lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """(pool offset, length) of the entry's bytes [lo, hi), in order, consecutive blocks
    merged."""
    while lo < hi:
        index, within = divmod(lo, block_size)
        start = blocks[index] * block_size + within
        length = min(block_size - within, hi - lo)
        while (
            lo + length < hi and index + 1 < len(blocks) and blocks[index + 1] == blocks[index] + 1
        ):
            index += 1
            length = min(length + block_size, hi - lo)
        yield start, length
        lo += length


def _gather_stripes(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    out: np.ndarray,
    stripes: Sequence[int],
    hashed: bool,
) -> list[int]:
    """Copy these stripes of the entry into ``out``; each one's digest, hashed from ``out``
    right after its copy (in L2), if ``hashed``."""
    digests = []
    nbytes = out.shape[0]
    for stripe in stripes:
        lo, hi = stripe * STRIPE, min((stripe + 1) * STRIPE, nbytes)
        at = lo
        for start, length in extents(blocks, block_size, lo, hi):
            np.copyto(out[at : at + length], region[start : start + length])
            at += length
        if hashed:
            digests.append(stripe_digest(out[lo:hi].data))
    return digests


_COPIERS = ThreadPoolExecutor(2, thread_name_prefix="chunkstore-copy")


def _by_stripes(count: int, threads: int, work: Callable[[Sequence[int]], list[int]]) -> list[int]:
    """``work`` over stripes 0..count-1, on one thread or two taking alternate stripes (numpy's
    copies and python-xxhash 4's hashes of over 64 KiB both release the GIL, so both run side
    by side); the stripe digests it returns, in stripe order."""
    if threads <= 1 or count < 2:
        return work(range(count))
    even, odd = _COPIERS.map(work, [range(0, count, 2), range(1, count, 2)])
    digests = [d for pair in zip(even, odd, strict=False) for d in pair]
    return digests + even[len(odd) :]


def gather(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    out: np.ndarray,
    digest: EntryDigest | None = None,
    threads: int = 1,
) -> None:
    """Copy an entry's bytes out of its blocks into ``out`` (uint8, the entry's length),
    feeding ``digest`` on the way: each stripe is hashed right after its copy, while it is in
    L2, so one pass over memory, not two. ``threads``: 1 or 2 (``_by_stripes``). One thread
    is numpy's memcpy, not torch's copy: torch splits a copy over its intra-op threads, one
    per core in every reader process, and readers side by side oversubscribe the cores."""
    count = -(-out.shape[0] // STRIPE)

    def work(stripes: Sequence[int]) -> list[int]:
        return _gather_stripes(region, blocks, block_size, out, stripes, digest is not None)

    for value in _by_stripes(count, threads, work):
        digest.add_stripe(value)  # type: ignore[union-attr]


def scatter_parts(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    parts: Sequence[np.ndarray],
    digest: EntryDigest | None = None,
    threads: int = 1,
) -> None:
    """Copy an entry given as consecutive parts (uint8: keys, then values) into its blocks,
    feeding ``digest`` with each stripe as it landed in the pool (what the daemon hashes at
    commit), hashed right after its copy. ``threads``: 1 or 2 (``_by_stripes``)."""
    placed, offset = [], 0
    for part in parts:
        placed.append((offset, part))
        offset += part.shape[0]
    nbytes = offset

    def work(stripes: Sequence[int]) -> list[int]:
        digests = []
        for stripe in stripes:
            lo, hi = stripe * STRIPE, min((stripe + 1) * STRIPE, nbytes)
            for start, part in placed:
                at, end = max(lo, start), min(hi, start + part.shape[0])
                for pool_at, length in extents(blocks, block_size, at, end) if at < end else ():
                    np.copyto(
                        region[pool_at : pool_at + length], part[at - start : at - start + length]
                    )
                    at += length
            if digest is not None:
                digests.append(_stripe_in_place(region, blocks, block_size, lo, hi))
        return digests

    for value in _by_stripes(-(-nbytes // STRIPE), threads, work):
        digest.add_stripe(value)  # type: ignore[union-attr]


def scatter(
    region: np.ndarray, blocks: Sequence[int], block_size: int, data: np.ndarray, offset: int = 0
) -> None:
    """Copy ``data`` (uint8) into an entry's blocks, starting ``offset`` bytes into the
    entry (the daemon's Write of one piece; it hashes the entry at commit)."""
    at = offset
    for pool_at, length in extents(blocks, block_size, offset, offset + data.shape[0]):
        region[pool_at : pool_at + length] = data[at - offset : at - offset + length]
        at += length


def _stripe_in_place(
    region: np.ndarray, blocks: Sequence[int], block_size: int, lo: int, hi: int
) -> int:
    """The digest of the entry's stripe [lo, hi), read where it lies in the pool."""
    stripe = xxhash.xxh3_64()
    for pool_at, length in extents(blocks, block_size, lo, hi):
        stripe.update(region[pool_at : pool_at + length].data)
    return stripe.intdigest()


def checksum(region: np.ndarray, blocks: Sequence[int], block_size: int, nbytes: int) -> int:
    """An entry's checksum (``EntryDigest``), read in place."""
    digest = EntryDigest()
    for lo in range(0, nbytes, STRIPE):
        digest.add_stripe(
            _stripe_in_place(region, blocks, block_size, lo, min(lo + STRIPE, nbytes))
        )
    return digest.intdigest()


def map_shared_pool(path: str | Path, capacity: int) -> np.ndarray:
    """A client's view of a daemon's shared-memory pool (raises OSError if it cannot map it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < capacity:
            raise OSError(f"{path} is smaller than the pool it should hold")
        mapped = mmap.mmap(fd, capacity, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.uint8)
