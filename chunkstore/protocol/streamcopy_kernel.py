"""The numba kernel behind ``streamcopy.copy`` (imported at the first copy, not with the
package: vLLM 0.32 scans the loaded modules when a worker starts and trips on an object
numba's llvmlite defines, which breaks an in-process engine)."""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


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
def streaming(dst: np.ndarray, src: np.ndarray) -> None:
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
