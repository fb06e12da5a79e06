"""The fused CPU remap-and-write kernel: one pass reads a stored chunk and writes its rotated
keys and its values into the paged cache at their slots.

Plain torch needs several passes over the keys (multiply, add, scatter), about four times the
cost of the copy on these CPUs; this loop costs about what the copy does (docs/benchmarks.md,
"chunkstore bench remap --json"). Numba compiles it once per process (cached on disk).
bfloat16 is handled as raw 16-bit words: widened to float32 by a shift, rotated, narrowed with
round-to-nearest-even as torch does.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from chunkstore.kv.rope import RotaryConfig, pair_indices


@njit(parallel=True, cache=True, boundscheck=False)
def _write_f32(src_k, src_v, dst_k, dst_v, slots, cos, sin, first, second):
    layers, tokens, heads, dims = src_k.shape
    pairs = first.shape[0]
    for layer in prange(layers):
        for t in range(tokens):
            s = slots[t]
            if s < 0:
                continue
            for h in range(heads):
                for d in range(dims):
                    dst_k[layer, s, h, d] = src_k[layer, t, h, d]
                for d in range(dst_v.shape[3]):
                    dst_v[layer, s, h, d] = src_v[layer, t, h, d]
                for j in range(pairs):
                    a = src_k[layer, t, h, first[j]]
                    b = src_k[layer, t, h, second[j]]
                    dst_k[layer, s, h, first[j]] = a * cos[t, j] - b * sin[t, j]
                    dst_k[layer, s, h, second[j]] = b * cos[t, j] + a * sin[t, j]


@njit(inline="always")
def _narrow(bits):
    """float32 bits to bfloat16 bits, rounded to nearest even as torch narrows."""
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)


@njit(parallel=True, cache=True, boundscheck=False)
def _write_bf16(src_k, src_v, dst_k, dst_v, slots, cos, sin, first, second):
    layers, tokens, heads, dims = src_k.shape
    pairs = first.shape[0]
    for layer in prange(layers):
        row = np.empty(dims, np.uint32)
        wide = row.view(np.float32)
        for t in range(tokens):
            s = slots[t]
            if s < 0:
                continue
            for h in range(heads):
                for d in range(dims):
                    row[d] = np.uint32(src_k[layer, t, h, d]) << 16
                for d in range(dst_v.shape[3]):
                    dst_v[layer, s, h, d] = src_v[layer, t, h, d]
                for j in range(pairs):
                    a = wide[first[j]]
                    b = wide[second[j]]
                    wide[first[j]] = a * cos[t, j] - b * sin[t, j]
                    wide[second[j]] = b * cos[t, j] + a * sin[t, j]
                for d in range(dims):
                    dst_k[layer, s, h, d] = _narrow(row[d])


def _as_array(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


_KERNELS = {torch.float32: _write_f32, torch.bfloat16: _write_bf16}


def fused_kernel_fits(keys: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor) -> bool:
    """The kernels take float32 or bfloat16 into contiguous caches; other writes go through
    torch ops (``writer.write_torch``)."""
    return keys.dtype in _KERNELS and flat_k.is_contiguous() and flat_v.is_contiguous()


def write_cpu(
    keys: torch.Tensor,
    values: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotary: RotaryConfig | None,
) -> None:
    kernel = _KERNELS[keys.dtype]
    if rotary is None or cos is None or sin is None:
        first = second = np.empty(0, np.int64)
        cos_a = sin_a = np.empty((keys.shape[1], 0), np.float32)
    else:
        first, second = (i.numpy() for i in pair_indices(rotary))
        cos_a, sin_a = cos.contiguous().numpy(), sin.contiguous().numpy()
    kernel(
        _as_array(keys.contiguous()),
        _as_array(values.contiguous()),
        _as_array(flat_k),
        _as_array(flat_v),
        slots.contiguous().numpy(),
        cos_a,
        sin_a,
        first,
        second,
    )


# vLLM's CPU attention cache ("vec" kernels), one layer: per block and head, K dim-major
# [head_dim, block_size] then V token-major [block_size, head_dim] (connector/cpu_layout.py).
# One entry's layer at a time, on the connector's load thread while the model computes on
# the other cores: single-threaded, and without the GIL.


@njit(cache=True, boundscheck=False, nogil=True)
def _write_vec_f32(src_k, src_v, key_part, value_part, slots, cos, sin, first, second):
    tokens, heads, dims = src_k.shape
    block_size = key_part.shape[3]
    pairs = first.shape[0]
    row = np.empty(dims, np.float32)
    for t in range(tokens):
        s = slots[t]
        b, o = s // block_size, s % block_size
        for h in range(heads):
            for d in range(dims):
                row[d] = src_k[t, h, d]
            for j in range(pairs):
                a = src_k[t, h, first[j]]
                c = src_k[t, h, second[j]]
                row[first[j]] = a * cos[t, j] - c * sin[t, j]
                row[second[j]] = c * cos[t, j] + a * sin[t, j]
            for d in range(dims):
                key_part[b, h, d, o] = row[d]
            for d in range(value_part.shape[3]):
                value_part[b, h, o, d] = src_v[t, h, d]


@njit(cache=True, boundscheck=False, nogil=True)
def _write_vec_bf16(src_k, src_v, key_part, value_part, slots, cos, sin, first, second):
    tokens, heads, dims = src_k.shape
    block_size = key_part.shape[3]
    pairs = first.shape[0]
    row = np.empty(dims, np.uint32)
    wide = row.view(np.float32)
    for t in range(tokens):
        s = slots[t]
        b, o = s // block_size, s % block_size
        for h in range(heads):
            for d in range(dims):
                row[d] = np.uint32(src_k[t, h, d]) << 16
            for j in range(pairs):
                a = wide[first[j]]
                c = wide[second[j]]
                wide[first[j]] = a * cos[t, j] - c * sin[t, j]
                wide[second[j]] = c * cos[t, j] + a * sin[t, j]
            for d in range(dims):
                key_part[b, h, d, o] = _narrow(row[d])
            for d in range(value_part.shape[3]):
                value_part[b, h, o, d] = src_v[t, h, d]


_VEC_KERNELS = {torch.float32: _write_vec_f32, torch.bfloat16: _write_vec_bf16}


def write_vec_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_part: torch.Tensor,
    value_part: torch.Tensor,
    slots: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor] | None,
    rotary: RotaryConfig,
) -> bool:
    """Rotate one layer's keys ([tokens, heads, head_dim]) by ``rotation`` (cos, sin
    [tokens, rotary_dim / 2]; None: copy) and write them and the values at ``slots`` of
    vLLM's CPU "vec" cache views (key_part [blocks, heads, head_dim, block_size], value_part
    [blocks, heads, block_size, head_dim]). False (nothing written) for a dtype it has no
    kernel for."""
    kernel = _VEC_KERNELS.get(keys.dtype)
    if kernel is None or key_part.dtype != keys.dtype or values.dtype != keys.dtype:
        return False
    if rotation is None:
        first = second = np.empty(0, np.int64)
        cos_a = sin_a = np.empty((keys.shape[0], 0), np.float32)
    else:
        first, second = (i.numpy() for i in pair_indices(rotary))
        cos_a, sin_a = (x.contiguous().numpy() for x in rotation)
    kernel(
        _as_array(keys),
        _as_array(values),
        _as_array(key_part),
        _as_array(value_part),
        slots.contiguous().numpy(),
        cos_a,
        sin_a,
        first,
        second,
    )
    return True
