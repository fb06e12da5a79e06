"""The keyed checksum that parts of an entry, read by different processes, are checked with
together (context-parallel ranks each read their rows): sums over the bytes with secret
weights, which add up over disjoint parts to the whole's. Pure math over numpy arrays; the
kernels that read pools with it are ``runs_kernel`` (numba, host memory) and
``device_ipc.keyed_run_sums`` (torch, any device).

Any checksum linear in the bytes with public weights is forgeable: a change orthogonal to
the weights keeps it (+1 at byte p and -1 at p + 65521 kept ``TensorDigest``'s two sums,
whatever the modulus). Here byte i of an entry weighs ``w(i) = inner[i % SPAN] *
outer[i // SPAN] mod MODULUS`` (MODULUS = 2^31 - 1, a prime), both tables drawn from a
64-bit secret seed, one pair of tables a lane, ``LANES`` independent lanes. A change d
(nonzero) keeps a lane only if every span's sum of d_j * inner[j] is 0 mod MODULUS (for
a span where d is nonzero: probability 1/(MODULUS-1) over inner) or the spans' sums
weighted by outer cancel (again 1/(MODULUS-1) over outer): under 2^-30 a lane, under 2^-60
for both, to one who does not know the seeds. The daemon draws a fresh seed pair per
summed lease and tells only the lease's holder.

It fits int64 without overflow when reduced per span: a byte (8 bits) times an inner
weight (31 bits), over SPAN = 2048 bytes, is under 2^50; reduced, times an outer weight,
under 2^62. That holds in numba, numpy and torch on any device alike.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MODULUS = (1 << 31) - 1  # a prime: every nonzero difference has an inverse
SPAN = 2048  # bytes an inner table weighs; one outer weight a span
LANES = 2  # independent seeds: a forgery passes one with probability ~2^-30

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment and mixers (Steele et al.)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _stream(seed: int, first: int, count: int) -> np.ndarray:
    """Weights in [1, MODULUS) for stream positions [first, first + count) of ``seed``:
    splitmix64, one output a position (exact uint64 arithmetic, the same on every host)."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) + (np.arange(first, first + count, dtype=np.uint64) + 1) * _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x ^= x >> np.uint64(31)
    return (x % np.uint64(MODULUS - 1) + np.uint64(1)).astype(np.int64)


NO_LANES = (np.zeros((0, SPAN), dtype=np.uint32), np.zeros((0, 0), dtype=np.int64))  # a copy


@dataclass(frozen=True)
class SumKey:
    """The secret seeds of a keyed checksum, one per lane (64 bits each)."""

    seeds: tuple[int, ...]

    @classmethod
    def fresh(cls) -> SumKey:
        return cls(tuple(secrets.randbits(64) for _ in range(LANES)))

    def inner(self) -> np.ndarray:
        """[LANES, SPAN] uint32 (each below 2^31): the weight of a byte at each offset within
        its span."""
        return np.stack([_stream(seed, 0, SPAN) for seed in self.seeds]).astype(np.uint32)

    def outer(self, nbytes: int) -> np.ndarray:
        """[LANES, spans of an entry of ``nbytes``] int64: each span's weight (from the same
        stream as ``inner``, after it: a longer entry's table starts with a shorter one's)."""
        spans = -(-nbytes // SPAN)
        return np.stack([_stream(seed, SPAN, spans) for seed in self.seeds])

    def tables(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """``inner`` and ``outer`` for an entry of ``nbytes``: what the kernels take."""
        return self.inner(), self.outer(nbytes)


@dataclass(frozen=True)
class Summed:
    """What a summed lease vouches for: the key, and the entry's keyed sums under it (one a
    lane, each below MODULUS). Parts of the entry that hold each of its bytes once, read
    apart, add up to ``sums`` unless a byte differs."""

    key: SumKey
    sums: tuple[int, ...]


def packed(sums: Sequence[int]) -> int:
    """Lane sums, added up in any range (reduced here), as one integer to compare and say."""
    return sum((int(s) % MODULUS) << (32 * lane) for lane, s in enumerate(sums))


def keyed_sums(data: np.ndarray, position: int, inner: np.ndarray, outer: np.ndarray) -> list[int]:
    """The reference: each lane's keyed sum of ``data`` (uint8), the bytes of an entry from
    ``position`` on (``outer`` covering them); the kernels compute the same integers."""
    positions = np.arange(position, position + data.shape[0], dtype=np.int64)
    sums = []
    for lane in range(inner.shape[0]):
        spans = np.zeros(outer.shape[1], dtype=np.int64)  # a span's products: under 2^50
        np.add.at(spans, positions // SPAN, data.astype(np.int64) * inner[lane, positions % SPAN])
        sums.append(int((spans % MODULUS * outer[lane] % MODULUS).sum() % MODULUS))
    return sums
