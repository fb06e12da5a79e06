"""Copies that stream past the caches: ``copy(dst, src)`` writes with non-temporal stores.

A plain copy first reads each destination line into the cache (to own it), then writes it back:
1.5x the memory traffic of the bytes moved. Pool copies are far larger than the caches and
nobody reads the destination soon, so both the put's copy into the pool and the get's copy out
of it store around the caches instead. glibc's memcpy does this only above
``x86_non_temporal_threshold`` (240 MiB on the development machine), which our 1 MiB
stripes never reach. Measured there (2 threads, 180 MiB into the pool): 8.8 ms against
12.5 ms for numpy's copy (README, "store").

The kernel is a numba loop of 8-byte stores tagged ``!nontemporal`` (x86: ``movnti``; AArch64:
``stnp``), then a full fence, so the bytes are visible to every other process before the
caller tells anyone (a commit, a release). Without numba it is numpy's copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
except ImportError:  # numba missing: numpy's copy, correct but slower
    njit = None


def _plain(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src)


if njit is not None:

    @intrinsic
    def _load_u64(typingctx: Any, buf: Any, at: Any) -> Any:
        """The 8 bytes of ``buf`` (uint8) at byte ``at``, any alignment."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(64).as_pointer())
            return builder.load(ptr, align=1)

        return types.uint64(buf, at), codegen

    @intrinsic
    def _store_u64_streaming(typingctx: Any, buf: Any, at: Any, value: Any) -> Any:
        """Store ``value`` at byte ``at`` of ``buf`` (uint8) around the caches."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            array = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.bitcast(builder.gep(array.data, [args[1]]), ir.IntType(64).as_pointer())
            store = builder.store(args[2], ptr, align=8)
            flag = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            store.set_metadata("nontemporal", flag)
            return context.get_dummy_value()

        return types.void(buf, at, value), codegen

    @intrinsic
    def _fence(typingctx: Any) -> Any:
        """Order the streaming stores before every later store (x86 ``mfence``)."""

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.fence("seq_cst")
            return context.get_dummy_value()

        return types.void(), codegen

    @njit(nogil=True, cache=True, boundscheck=False)
    def _streaming(dst: np.ndarray, src: np.ndarray) -> None:
        n = src.shape[0]
        misaligned = np.int64(dst.ctypes.data % 8)
        head = min(n, (8 - misaligned) % 8)  # plain stores up to dst's first 8-byte boundary
        for i in range(head):
            dst[i] = src[i]
        end = head + (n - head) // 8 * 8
        for at in range(head, end, 8):
            _store_u64_streaming(dst, at, _load_u64(src, at))
        for i in range(end, n):
            dst[i] = src[i]
        _fence()

    def copy(dst: np.ndarray, src: np.ndarray) -> None:
        """``dst[:] = src`` (both 1-D contiguous uint8 of one length), stored around the
        caches; releases the GIL."""
        if dst.shape != src.shape:
            raise ValueError(f"copy of {src.shape} bytes into {dst.shape}")
        _streaming(dst, src)

else:
    copy = _plain
