"""Copies that stream past the caches: ``copy(dst, src)`` writes with non-temporal stores.

A plain copy first reads each destination line into the cache (to own it), then writes it back:
1.5x the memory traffic of the bytes moved. Pool copies are far larger than the caches and
nobody reads the destination soon, so both the put's copy into the pool and the get's copy out
of it store around the caches instead. glibc's memcpy does this only above
``x86_non_temporal_threshold`` (240 MiB on the development machine), which our 1 MiB
stripes never reach. Measured there (2 threads, 180 MiB into the pool): 8.8 ms against
12.5 ms for numpy's copy (docs/benchmarks.md, "chunkstore bench store --json").

The kernel (``streamcopy_kernel``, compiled by numba at the first copy and cached on disk) is
a loop of 8-byte stores tagged ``!nontemporal`` (x86: ``movnti``; AArch64: ``stnp``), then a
full fence, so the bytes are visible to every other process before the caller tells anyone (a
commit, a release). Without numba it is numpy's copy, with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

Kernel = Callable[[np.ndarray, np.ndarray], None]
_kernel: Kernel | None = None


def kernel() -> Kernel:
    """The copy loop, loaded at the first call: numba's, or numpy's without numba."""
    global _kernel
    if _kernel is None:
        try:
            from chunkstore.protocol.streamcopy_kernel import streaming

            _kernel = streaming
        except ImportError as exc:  # numba missing: correct but slower
            log.warning("streaming copy unavailable (%s); using numpy's copy", exc)
            _kernel = np.copyto
    return _kernel


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` (both 1-D contiguous uint8 of one length), stored around the caches;
    releases the GIL."""
    if dst.shape != src.shape:
        raise ValueError(f"copy of {src.shape} bytes into {dst.shape}")
    (_kernel or kernel())(dst, src)
