"""The numba kernels behind ``device_ipc.gather_runs`` and ``run_sums`` on CPU memory (a mapped
pool, the fake device's, bytes off the stream): a context-parallel rank's runs of an entry's
bytes gathered and summed in one pass (imported at the first call, as ``streamcopy_kernel``
is: vLLM scans a worker's loaded modules and trips on numba's objects).

torch's ops took 250 ms for a DCP 2 rank's half of a 47 MB entry here (30x a whole read and
check), most of it the weights made per byte. A run's weights are consecutive, so
``sum(b_j * (w + j)) = w * sum(b_j) + sum(j * b_j)``: the loop copies a byte and adds two
int32 sums over pieces of at most 2 KiB (a vectorized loop), and the weights wrap from
the modulus to 1 between pieces: 16 ms for that half, one thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit

Sums = tuple[np.signedinteger, np.signedinteger]  # plain, weighted (int64)
_PIECE = 2048  # bytes summed in int32: 255 x 2048^2 / 2 < 2^31
_RAMP = np.arange(_PIECE, dtype=np.int32)  # a piece's offsets, as int32 (no cast a byte)


@njit(nogil=True, cache=True, boundscheck=False)
def _piece(source: np.ndarray, target: np.ndarray, phase: int) -> Sums:
    """``source`` (at most _PIECE bytes, whose first byte's weight is phase + 1, without a
    wrap) copied into ``target``; its plain and weighted sums."""
    plain = np.int32(0)
    linear = np.int32(0)
    for j in range(source.shape[0]):
        b = source[j]
        target[j] = b
        v = np.int32(b)
        plain += v
        linear += v * _RAMP[j]
    return np.int64(plain), np.int64(plain) * (phase + 1) + linear


@njit(nogil=True, cache=True, boundscheck=False)
def _run(source: np.ndarray, target: np.ndarray, position: int, modulus: int) -> Sums:
    """``source`` (bytes of the entry from ``position`` on) copied into ``target``; its
    plain and weighted sums, a byte's weight its position modulo ``modulus``, plus 1."""
    plain = np.int64(0)
    weighted = np.int64(0)
    done = 0
    while done < source.shape[0]:
        phase = (position + done) % modulus
        take = min(source.shape[0] - done, modulus - phase, _PIECE)
        p, w = _piece(source[done : done + take], target[done : done + take], phase)
        plain += p
        weighted += w
        done += take
    return plain, weighted


@njit(nogil=True, cache=True, boundscheck=False)
def gather_summed(
    region: np.ndarray,
    blocks: np.ndarray,
    block_size: int,
    starts: np.ndarray,
    length: int,
    out: np.ndarray,
    modulus: int,
) -> Sums:
    """The runs of ``length`` bytes of an entry at ``starts`` copied out of its ``blocks``
    of ``region`` into ``out`` one after another; their plain and weighted sums (``_run``'s,
    ``modulus``: ``shm.SUM_MODULUS``)."""
    plain = np.int64(0)
    weighted = np.int64(0)
    at = 0
    for r in range(starts.shape[0]):
        position = starts[r]
        end = position + length
        while position < end:  # a run may cross into the next block
            offset = position % block_size
            take = min(end - position, block_size - offset)
            source = blocks[position // block_size] * block_size + offset
            p, w = _run(region[source : source + take], out[at : at + take], position, modulus)
            plain += p
            weighted += w
            at += take
            position += take
    return plain, weighted


@njit(nogil=True, cache=True, boundscheck=False)
def sums_of_runs(data: np.ndarray, starts: np.ndarray, length: int, modulus: int) -> Sums:
    """Plain and weighted sums of runs of ``length`` bytes held one after another in
    ``data``, the run at ``starts[r]`` in the entry the r-th (``_run``'s)."""
    plain = np.int64(0)
    weighted = np.int64(0)
    for r in range(starts.shape[0]):
        run = data[r * length : (r + 1) * length]
        p, w = _run(run, run, starts[r], modulus)  # a copy onto itself: the same loop
        plain += p
        weighted += w
    return plain, weighted
