"""The shared-memory pool as both sides see it: an entry's bytes lie in fixed-size blocks of one
mapped region, in the order of its block list. The daemon writes and hashes them there; a
client on the same host maps the region and copies in and out without going through the
daemon. Plain functions over a uint8 array, so neither side needs the other's code.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
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


PIECE = 1 << 20  # copy and hash in pieces that stay in L2 between the two


def gather(
    region: np.ndarray, blocks: Sequence[int], block_size: int, out: np.ndarray, digest: Any = None
) -> None:
    """Copy an entry's bytes out of its blocks into ``out`` (uint8, the entry's length),
    feeding ``digest`` (an xxhash object) on the way: one pass over memory, not two.

    One thread per reader (numpy's memcpy), not torch's copy: torch splits a copy over its
    intra-op threads, one per core in every reader process, and readers side by side then
    oversubscribe the cores (two readers on two cores: 2 GB/s together, one alone 5 GB/s;
    single-threaded copies: 12 GB/s alone, more together)."""
    nbytes = out.shape[0]
    for first, count, index in block_runs(blocks):
        start = index * block_size
        end = min(start + count * block_size, nbytes)
        offset = first * block_size - start
        for lo in range(start, end, PIECE):
            hi = min(lo + PIECE, end)
            np.copyto(out[lo:hi], region[lo + offset : hi + offset])
            if digest is not None:
                digest.update(out[lo:hi].data)


def scatter(
    region: np.ndarray,
    blocks: Sequence[int],
    block_size: int,
    data: np.ndarray,
    offset: int = 0,
    digest: Any = None,
) -> None:
    """Copy ``data`` (uint8) into an entry's blocks, starting ``offset`` bytes into the entry,
    feeding ``digest`` (an xxhash object) with the bytes as they landed in the pool, piece by
    piece while they are in L2 (as ``gather`` does): what is hashed is what the daemon will
    hash at commit, in one pass over memory."""
    end_offset = offset + data.shape[0]
    for first, count, index in block_runs(blocks):
        run_start = index * block_size
        run_end = run_start + count * block_size
        lo, hi = max(run_start, offset), min(run_end, end_offset)
        if hi <= lo:
            continue
        dest = first * block_size + (lo - run_start)
        if digest is None:
            region[dest : dest + hi - lo] = data[lo - offset : hi - offset]
            continue
        for piece in range(lo, hi, PIECE):
            end = min(piece + PIECE, hi)
            at = dest + piece - lo
            np.copyto(region[at : at + end - piece], data[piece - offset : end - offset])
            digest.update(region[at : at + end - piece].data)


def checksum(region: np.ndarray, blocks: Sequence[int], block_size: int, nbytes: int) -> int:
    """xxh3-64 of an entry's bytes, read in place."""
    h = xxhash.xxh3_64()
    remaining = nbytes
    for first, count, _ in block_runs(blocks):
        take = min(count * block_size, remaining)
        h.update(region[first * block_size : first * block_size + take].data)
        remaining -= take
        if remaining <= 0:
            break
    return h.intdigest()


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
