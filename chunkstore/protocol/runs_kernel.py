"""The numba kernels behind ``device_ipc.gather_runs`` and ``keyed_run_sums`` on CPU memory (a
mapped pool, the fake device's, bytes off the stream), and the daemon's pass over an entry
at a summed lease: runs of an entry's bytes copied and summed with ``keyed_digest``'s
secret weights in one pass (imported at the first call, as ``streamcopy_kernel`` is: vLLM
scans a worker's loaded modules and trips on numba's objects).

A run is cut at the weights' spans: within one, each lane's sum is a dot product of the
bytes with a slice of the lane's inner table, in uint64 (a byte times a 31-bit weight, over
2048 bytes: under 2^50; the products of zero-extended 32-bit values vectorize without
AVX-512), then reduced and weighted by the span's outer weight. Both lanes in one loop over
the bytes, each copied once: the sums are of the bytes the copy holds (12 GB/s here, one
thread, either way: copied, or summed where they are).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from chunkstore.protocol.keyed_digest import MODULUS, SPAN

_MOD = np.uint64(MODULUS)


@njit(nogil=True, cache=True, boundscheck=False)
def _run(
    source: np.ndarray,
    target: np.ndarray,
    position: int,
    inner: np.ndarray,
    outer: np.ndarray,
    sums: np.ndarray,
    copy: bool,
) -> None:
    """``source`` (bytes of the entry from ``position`` on) copied into ``target`` (not
    where ``copy`` is False), their keyed sums added into ``sums`` (two lanes, each kept
    below MODULUS; ``inner`` uint32 [2, SPAN], ``outer`` int64 [2, spans]). No lanes in
    ``inner``: a copy only."""
    if inner.shape[0] == 0:
        target[:] = source
        return
    done = 0
    while done < source.shape[0]:
        at = position + done
        offset = at % SPAN
        take = min(source.shape[0] - done, SPAN - offset)
        piece, into = source[done : done + take], target[done : done + take]
        first, second = inner[0, offset : offset + take], inner[1, offset : offset + take]
        a = np.uint64(0)
        b = np.uint64(0)
        if not copy:  # summed in place: a loop storing into what it reads stays scalar
            for j in range(take):
                byte = np.uint64(piece[j])
                a += byte * np.uint64(first[j])
                b += byte * np.uint64(second[j])
        else:
            for j in range(take):
                byte = piece[j]
                into[j] = byte
                a += np.uint64(byte) * np.uint64(first[j])
                b += np.uint64(byte) * np.uint64(second[j])
        span = at // SPAN
        sums[0] = (sums[0] + np.int64(a % _MOD) * outer[0, span]) % MODULUS
        sums[1] = (sums[1] + np.int64(b % _MOD) * outer[1, span]) % MODULUS
        done += take


@njit(nogil=True, cache=True, boundscheck=False)
def gather_keyed(
    region: np.ndarray,
    blocks: np.ndarray,
    block_size: int,
    starts: np.ndarray,
    length: int,
    out: np.ndarray,
    inner: np.ndarray,
    outer: np.ndarray,
) -> np.ndarray:
    """The runs of ``length`` bytes of an entry at ``starts`` copied out of its ``blocks``
    of ``region`` into ``out`` one after another; their keyed sums (``_run``'s), int64[2]."""
    sums = np.zeros(2, dtype=np.int64)
    at = 0
    for r in range(starts.shape[0]):
        position = starts[r]
        end = position + length
        while position < end:  # a run may cross into the next block
            offset = position % block_size
            take = min(end - position, block_size - offset)
            source = blocks[position // block_size] * block_size + offset
            into = out[at : at + take]
            _run(region[source : source + take], into, position, inner, outer, sums, True)
            at += take
            position += take
    return sums


@njit(nogil=True, cache=True, boundscheck=False)
def sums_of_runs(
    data: np.ndarray, starts: np.ndarray, length: int, inner: np.ndarray, outer: np.ndarray
) -> np.ndarray:
    """Keyed sums (int64[2]) of runs of ``length`` bytes held one after another in ``data``,
    the run at ``starts[r]`` in the entry the r-th (``_run``'s)."""
    sums = np.zeros(2, dtype=np.int64)
    for r in range(starts.shape[0]):
        run = data[r * length : (r + 1) * length]
        _run(run, run, starts[r], inner, outer, sums, False)
    return sums
