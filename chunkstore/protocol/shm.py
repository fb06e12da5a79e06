"""The shared-memory pool as both sides see it: an entry's bytes lie in fixed-size blocks of one
mapped region, in the order of its block list. The daemon writes and hashes them there; a
client on the same host maps the region and copies in and out without going through the
daemon. Plain functions over a uint8 array, so neither side needs the other's code.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from chunkstore.protocol import streamcopy
from chunkstore.protocol.keyed_digest import MODULUS


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
        """The digest (xxh3-64) of the next whole stripe, hashed elsewhere."""
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


class Pieces:
    """Where an entry's bytes go when not to one array: uint8 arrays (a serving engine's
    cache blocks, say) whose lengths add up to the entry's, in the order of its bytes."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        self.parts = list(parts)
        self.ends = list(itertools.accumulate(int(p.shape[0]) for p in self.parts))
        self.nbytes = self.ends[-1] if self.ends else 0

    def spans(self, lo: int, hi: int) -> Iterator[tuple[np.ndarray, int]]:
        """(the piece's slice, the entry offset it starts at) covering bytes [lo, hi)."""
        i = bisect.bisect_right(self.ends, lo)
        while lo < hi:
            part = self.parts[i]
            begin = self.ends[i] - part.shape[0]
            take = min(self.ends[i], hi) - lo
            yield part[lo - begin : lo - begin + take], lo
            lo += take
            i += 1

    def fill(self, data: np.ndarray) -> None:
        """The pieces from the entry's bytes in one array."""
        for piece, offset in self.spans(0, self.nbytes):
            piece[:] = data[offset : offset + piece.shape[0]]


def _gather_stripe(
    region: np.ndarray, runs: Sequence[tuple[int, int]], out: Pieces, lo: int
) -> None:
    """Copy the stripe at entry offset ``lo`` out of its ``runs`` (``extents``) into ``out``."""
    at = lo
    for start, length in runs:
        if len(out.parts) == 1:  # one array: no pieces to split the run over
            streamcopy.copy(out.parts[0][at : at + length], region[start : start + length])
        else:
            for piece, offset in out.spans(at, at + length):
                source = start + offset - at
                streamcopy.copy(piece, region[source : source + piece.shape[0]])
        at += length


_COPIER = ThreadPoolExecutor(1, thread_name_prefix="chunkstore-copy")


def _by_stripes(
    count: int,
    threads: int,
    work: Callable[[Sequence[int]], list[int]],
    helper: Executor | None = None,
    first: int = 0,
) -> list[int]:
    """``work`` over stripes first..first+count-1, on one thread or two taking alternate
    stripes (the streaming copy and python-xxhash 4's hashes of over 64 KiB both release the
    GIL, so both run side by side): the caller's and one helper (``helper``'s, or this
    module's), so a read wakes one thread, not two; the stripe digests it returns, in stripe
    order. A thread inherits its starter's CPUs: a caller bound to some cores passes a
    helper of its own that runs elsewhere."""
    end = first + count
    if threads <= 1 or count < 2:
        return work(range(first, end))
    helper_work = (helper or _COPIER).submit(work, range(first + 1, end, 2))
    try:
        even = work(range(first, end, 2))
    finally:
        odd = helper_work.result()
    digests = [d for pair in zip(even, odd, strict=False) for d in pair]
    return digests + even[len(odd) :]


def gather_many(
    region: np.ndarray,
    block_size: int,
    reads: Sequence[tuple[Sequence[int], np.ndarray | Pieces]],
    digests: Sequence[EntryDigest] | None = None,
    threads: int = 1,
    helper: Executor | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Copy entries' bytes out of their blocks: each ``(blocks, out)`` into ``out`` (uint8,
    the entry's length, or its ``Pieces``), feeding ``digests`` (one per entry) on the way.
    The stripes of all the entries are shared out over ``threads`` (1 or 2,
    ``_by_stripes``), so many small entries read as fast as one large one. Each stripe is
    hashed from the pool right after its copy: the copy left the source in L2, while a
    streamed destination is not in any cache (hashing ``out`` after a cached copy made a
    read 1.3x slower: docs/benchmarks.md, "chunkstore bench store --json"). The pool's bytes
    are hashed after they were copied, so a change to them before or during the copy shows
    as a mismatch. One thread is one copy, not torch's: torch splits a copy over its
    intra-op threads, one per core in every reader process, and readers side by side
    oversubscribe the cores.
    ``progress``: the entries are read front to back together, stripe by stripe, and it
    is called with n after every entry's first n bytes are in ``out`` (not yet checked:
    the digests are whole only at the end); e.g. a cache's first layers, while the rest
    is read."""
    outs = [out if isinstance(out, Pieces) else Pieces([out]) for _, out in reads]
    rounds = -(-max((out.nbytes for out in outs), default=0) // STRIPE)
    stripes = [
        (i, s) for s in range(rounds) for i, out in enumerate(outs) if s * STRIPE < out.nbytes
    ]

    def work(picked: Sequence[int]) -> list[int]:
        hashed = []
        for i, stripe in (stripes[k] for k in picked):
            lo = stripe * STRIPE
            runs = list(extents(reads[i][0], block_size, lo, min(lo + STRIPE, outs[i].nbytes)))
            _gather_stripe(region, runs, outs[i], lo)
            if digests is not None:
                hashed.append(_hash_runs(region, runs))
        return hashed

    if progress is None:
        values = _by_stripes(len(stripes), threads, work, helper)
    else:
        values, first = [], 0
        for stripe in range(rounds):
            count = sum(1 for out in outs if stripe * STRIPE < out.nbytes)
            values += _by_stripes(count, threads, work, helper, first)
            first += count
            progress((stripe + 1) * STRIPE)
    for (i, _), value in zip(stripes, values, strict=False):
        digests[i].add_stripe(value)  # type: ignore[index]


def gather_spans(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    spans: Sequence[tuple[int, int]],
    out: np.ndarray,
) -> list[int]:
    """Copy an entry's byte ``spans`` ([lo, hi) each) out of its blocks into ``out`` (uint8,
    their total length), one after another, each hashed (xxh3-64) in the pool right after
    its copy (``gather_many`` says why there): the spans' digests, in order."""
    digests, at = [], 0
    for lo, hi in spans:
        runs = list(extents(blocks, block_size, lo, hi))
        for start, length in runs:
            streamcopy.copy(out[at : at + length], region[start : start + length])
            at += length
        digests.append(_hash_runs(region, runs))
    return digests


def gather_runs_summed(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    starts: np.ndarray,
    length: int,
    out: np.ndarray,
    weights: tuple[np.ndarray, np.ndarray],
    threads: int = 1,
    helper: Executor | None = None,
) -> tuple[int, int]:
    """An entry's runs of ``length`` bytes at ``starts`` (int64, each inside the entry)
    copied out of its blocks into ``out`` (uint8) one after another, with their two keyed
    sums (``keyed_digest``; ``weights``: a ``SumKey``'s inner and outer tables, or
    ``NO_LANES`` for a copy alone), in one pass of numba's loop (``runs_kernel``); over
    ``threads`` (1 or 2: the caller's and ``helper``'s, or this module's, each half the
    runs)."""
    from chunkstore.protocol.runs_kernel import gather_keyed

    table = np.asarray(blocks, dtype=np.int64)

    def gather(first: int, end: int) -> tuple[int, int]:
        part = out[first * length : end * length]
        sums = gather_keyed(region, table, block_size, starts[first:end], length, part, *weights)
        return int(sums[0]), int(sums[1])

    half = len(starts) // 2 if threads > 1 else 0
    if not half:
        return gather(0, len(starts))
    second = (helper or _COPIER).submit(gather, half, len(starts))
    try:
        mine = gather(0, half)
    finally:
        more = second.result()
    return (mine[0] + more[0]) % MODULUS, (mine[1] + more[1]) % MODULUS


def keyed_and_checksum(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    nbytes: int,
    weights: tuple[np.ndarray, np.ndarray],
) -> tuple[int, tuple[int, int]]:
    """An entry's checksum (``EntryDigest``) and its keyed sums under ``weights``, both of
    one private copy of each stripe: a change made while it is read shows in the checksum,
    or is in neither (the sums then vouch only for bytes that passed it). 1 MiB at a time,
    in L2: 47 MB in about 8 ms here, one thread."""
    from chunkstore.protocol.runs_kernel import gather_keyed

    table = np.asarray(blocks, dtype=np.int64)
    buffer = np.empty(min(STRIPE, nbytes), dtype=np.uint8)
    digest, sums = EntryDigest(), (0, 0)
    for lo in range(0, nbytes, STRIPE):
        copy = buffer[: min(STRIPE, nbytes - lo)]
        more = gather_keyed(region, table, block_size, np.array([lo]), len(copy), copy, *weights)
        digest.add_stripe(xxhash.xxh3_64_intdigest(copy.data))
        sums = (sums[0] + int(more[0])) % MODULUS, (sums[1] + int(more[1])) % MODULUS
    return digest.intdigest(), sums


def gather(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    out: np.ndarray,
    digest: EntryDigest | None = None,
    threads: int = 1,
) -> None:
    """One entry's ``gather_many``."""
    gather_many(region, block_size, [(blocks, out)], None if digest is None else [digest], threads)


def scatter_parts(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    parts: Sequence[np.ndarray],
    digest: EntryDigest | None = None,
    threads: int = 1,
) -> None:
    """Copy an entry given as consecutive parts (uint8: keys, then values) into its blocks,
    feeding ``digest`` with each stripe of the parts, hashed right after its copy while it is
    in L2 (``gather_many`` says why the source). It is the digest of what the writer meant
    to store: every read hashes the pool, and refuses a copy that differs (so does the
    daemon's commit with ``verify_commits``).
    ``threads``: 1 or 2 (``_by_stripes``)."""
    placed, offset = [], 0
    for part in parts:
        placed.append((offset, part))
        offset += part.shape[0]
    nbytes = offset

    def work(stripes: Sequence[int]) -> list[int]:
        digests = []
        for stripe in stripes:
            lo, hi = stripe * STRIPE, min((stripe + 1) * STRIPE, nbytes)
            pieces = []
            for start, part in placed:
                at, end = max(lo, start), min(hi, start + part.shape[0])
                if at < end:
                    pieces.append(part[at - start : end - start])
                for pool_at, length in extents(blocks, block_size, at, end) if at < end else ():
                    streamcopy.copy(
                        region[pool_at : pool_at + length], part[at - start : at - start + length]
                    )
                    at += length
            if digest is not None:
                hasher = xxhash.xxh3_64()
                for piece in pieces:
                    hasher.update(piece.data)
                digests.append(hasher.intdigest())
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
    return _hash_runs(region, list(extents(blocks, block_size, lo, hi)))


def _hash_runs(region: np.ndarray, runs: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 of the pool's bytes in ``runs`` (offset, length), in order."""
    if len(runs) == 1:  # a stripe in consecutive blocks: one call
        start, length = runs[0]
        return xxhash.xxh3_64_intdigest(region[start : start + length].data)
    stripe = xxhash.xxh3_64()
    for start, length in runs:
        stripe.update(region[start : start + length].data)
    return stripe.intdigest()


def checksum(region: np.ndarray, blocks: Sequence[int], block_size: int, nbytes: int) -> int:
    """An entry's checksum (``EntryDigest``), read in place."""
    digest = EntryDigest()
    for lo in range(0, nbytes, STRIPE):
        digest.add_stripe(
            _stripe_in_place(region, blocks, block_size, lo, min(lo + STRIPE, nbytes))
        )
    return digest.intdigest()


SUM_MODULUS = 65521  # ``TensorDigest``'s weights cycle through 1..65521 by position


def digest_of_sums(length: int, plain: int, weighted: int) -> int:
    """``TensorDigest`` of an entry of ``length`` bytes from its two sums, wherever they were
    added up (on the device, or by a fused get's kernel): sums of disjoint parts of the
    entry add up to the whole's."""
    mask = (1 << 64) - 1
    words = (length & mask, plain & mask, weighted & mask)
    return xxhash.xxh3_64_intdigest(b"".join(w.to_bytes(8, "little") for w in words))


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


MADV_POPULATE_READ = 22  # Linux 5.14 (mmap.MADV_POPULATE_READ from Python 3.13 on)
_POPULATE_STEP = 64 << 20


def populate(region: np.ndarray, stop: Callable[[], bool] = lambda: False) -> bool:
    """Map every page of a pool view into this process now, as a first read would, a step
    at a time (the GIL is released during each step: call it on a background thread).
    A shared-memory page takes ~0.3 us to map on its first touch; a read of a 189 MB entry
    into a fresh map pays ~18 ms of that on one core. Costs 2 MiB of page tables per GiB.
    ``stop``: asked between steps. False where it stopped or failed (a kernel older than
    5.14, a map gone); pages it did not map are mapped by their first touch, as before."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    base, size = region.ctypes.data, region.nbytes
    for at in range(0, size, _POPULATE_STEP):
        if stop():
            return False
        if madvise(base + at, min(_POPULATE_STEP, size - at), MADV_POPULATE_READ) != 0:
            return False  # EINVAL: an older kernel; ENOMEM: unmapped; first touch maps then
    return True
