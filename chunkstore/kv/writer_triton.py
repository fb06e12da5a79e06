"""The fused device writer: one Triton kernel reads a stored chunk's keys once, rotates them in
float32 registers and writes them and the values straight into a paged cache's slots.

The torch writer (``writer.write_torch``) needs several kernels for the same job (widen,
multiply, add, narrow, scatter from a strided view): 16-18x a device copy of the same bytes on
an H200 (docs/device-check.md). Here each program moves one token's row of one layer, a tile of
its heads at a time; a rotated dim reads its pair's other dim from the same row (the same cache
lines) and its angle from the rotation table.

Every destination is addressed by strides (layer, block, offset in the block, head, dim) and a
block size, so one kernel serves the flat [layers, slots, heads, dim] view ``write_chunk`` hands
a ``Writer`` (blocks of one slot) and each back end's per-layer [blocks, block_size, heads,
dim] view from ``cache_layouts`` (NHD, HND, split, stacked, MLA's latent).

It rounds as ``rope.rotate_with_torch`` does, so both write the same bits: ``a * cos`` rounded
to float32, then ``- b * sin`` added in one fused multiply-add, as torch's ``addcmul`` does
(measured on this project's x86 CPUs; on CUDA nvcc contracts its ``a + alpha * b * c``, and
the self-check and tests/device compare), narrowed once to the storage dtype with
round-to-nearest-even.
bfloat16 is narrowed by hand on the raw bits: Triton's interpreter truncates a plain cast.
Plain masked loads and stores only, nothing CUDA-only, so triton-ascend can build the same
source.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from chunkstore.kv.paging import PAD_SLOT
from chunkstore.kv.rope import RotaryConfig, rotation_table

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements one program holds per row tile (a tile of heads x the head's dims): room in
# registers for the row, its pairs' other dims and their angles.
TILE_ELEMENTS = 4096


@triton.jit
def _narrow(wide, like):
    """float32 to the dtype of ``like``, rounded to nearest even (bfloat16 on the bits, as
    torch narrows; NaN stays NaN)."""
    if like.dtype == tl.bfloat16:
        bits = wide.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(wide != wide, 0x7FC0, rounded)
        narrow = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        narrow = wide.to(like.dtype)
    return narrow


@triton.jit
def _write_rows(
    keys,
    values,
    key_dst,
    value_dst,
    slots,
    cos,
    sin,
    # The strides of each tensor's axes: l layer, t token, b block, o offset in the block,
    # h head, d dim.
    keys_l,
    keys_t,
    keys_h,
    keys_d,
    values_l,
    values_t,
    values_h,
    values_d,
    key_dst_l,
    key_dst_b,
    key_dst_o,
    key_dst_h,
    key_dst_d,
    value_dst_l,
    value_dst_b,
    value_dst_o,
    value_dst_h,
    value_dst_d,
    block_size,
    heads,
    key_dims,
    value_dims,
    pairs,
    rotary_offset,
    HEADS_TILE: tl.constexpr,
    KEY_TILE: tl.constexpr,
    VALUE_TILE: tl.constexpr,
    ROTATE: tl.constexpr,
    NEOX: tl.constexpr,
    HAS_VALUES: tl.constexpr,
):
    """One token of one layer, a tile of its heads: grid (tokens, layers, head tiles)."""
    token = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    head = (tl.program_id(2) * HEADS_TILE + tl.arange(0, HEADS_TILE)[:, None]).to(tl.int64)
    slot = tl.load(slots + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    # A negative slot is another rank's token: no head of it is written.
    live = head < tl.where(slot >= 0, heads, 0)

    dim = tl.arange(0, KEY_TILE)[None, :].to(tl.int64)
    key_mask = live & (dim < key_dims)
    row = keys + layer * keys_l + token * keys_t + head * keys_h
    key = tl.load(row + dim * keys_d, mask=key_mask)
    if ROTATE:
        r = dim - rotary_offset
        rotated = key_mask & (r >= 0) & (r < 2 * pairs)
        if NEOX:  # pair j: dims j and j + pairs
            first = r < pairs
            pair = tl.where(first, r, r - pairs)
            other = tl.where(first, r + pairs, r - pairs)
        else:  # pair j: dims 2j and 2j + 1
            first = (r & 1) == 0
            pair = r >> 1
            other = r ^ 1
        partner = tl.load(row + (other + rotary_offset) * keys_d, mask=rotated)
        c = tl.load(cos + token * pairs + pair, mask=rotated)
        s = tl.load(sin + token * pairs + pair, mask=rotated)
        b = partner.to(tl.float32)
        # The first of a pair: a * cos - b * sin; the second: b * cos + a * sin, where its
        # partner is a. As rotate_with_torch: the product rounded, then one fused multiply-add.
        wide = tl.fma(tl.where(first, -b, b), s, key.to(tl.float32) * c)
        key = tl.where(rotated, _narrow(wide, key), key)
    key_at = key_dst + layer * key_dst_l + block * key_dst_b + offset * key_dst_o + head * key_dst_h
    tl.store(key_at + dim * key_dst_d, key, mask=key_mask)

    if HAS_VALUES:
        dim = tl.arange(0, VALUE_TILE)[None, :].to(tl.int64)
        value_mask = live & (dim < value_dims)
        row = values + layer * values_l + token * values_t + head * values_h
        value = tl.load(row + dim * values_d, mask=value_mask)
        value_at = (
            value_dst
            + layer * value_dst_l
            + block * value_dst_b
            + offset * value_dst_o
            + head * value_dst_h
        )
        tl.store(value_at + dim * value_dst_d, value, mask=value_mask)


def kernel_fits(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    key_dst: torch.Tensor,
    value_dst: torch.Tensor | None,
) -> bool:
    """The kernel writes float32, float16 or bfloat16 into a cache of the same dtype on the
    keys' device; other writes go through torch ops."""
    tensors = [t for t in (values, key_dst, value_dst) if t is not None]
    return keys.dtype in DTYPES and all(
        t.dtype == keys.dtype and t.device == keys.device for t in tensors
    )


def _launch(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    key_dst: torch.Tensor,
    value_dst: torch.Tensor | None,
    slots: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor] | None,
    rotary: RotaryConfig | None,
) -> None:
    """keys / values: [layers, tokens, heads, dims]; key_dst / value_dst: [layers, blocks,
    block_size, heads, dims], any strides; rotation: cos, sin [tokens, rotary_dim / 2] or
    None (keys copied)."""
    layers, tokens, heads, key_dims = keys.shape
    if tokens == 0:
        return
    device = keys.device
    if rotation is not None and rotary is not None:
        cos, sin = (t.to(device, torch.float32).contiguous() for t in rotation)
        pairs, rotary_offset = rotary.rotary_dim // 2, rotary.rotary_offset
        neox = rotary.style == "neox"
    else:
        cos = sin = keys  # never read
        pairs, rotary_offset, neox = 0, 0, True
    value_dims = values.shape[3] if values is not None else 1
    key_tile = triton.next_power_of_2(key_dims)
    value_tile = triton.next_power_of_2(value_dims)
    heads_tile = min(
        triton.next_power_of_2(heads), max(1, TILE_ELEMENTS // max(key_tile, value_tile))
    )
    no_strides = (0, 0, 0, 0, 0)
    grid = (tokens, layers, triton.cdiv(heads, heads_tile))
    _write_rows[grid](
        keys,
        keys if values is None else values,
        key_dst,
        key_dst if value_dst is None else value_dst,
        slots.to(device).contiguous(),
        cos,
        sin,
        *keys.stride(),
        *(no_strides[:4] if values is None else values.stride()),
        *key_dst.stride(),
        *(no_strides if value_dst is None else value_dst.stride()),
        key_dst.shape[2],
        heads,
        key_dims,
        value_dims,
        pairs,
        rotary_offset,
        HEADS_TILE=heads_tile,
        KEY_TILE=key_tile,
        VALUE_TILE=value_tile,
        ROTATE=rotation is not None and rotary is not None,
        NEOX=neox,
        HAS_VALUES=values is not None and value_dst is not None,
    )


def write_triton(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor | None,
    slots: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotary: RotaryConfig | None,
) -> None:
    """The ``writer.Writer`` of a device: every layer of a chunk ([layers, tokens, heads,
    dims]) into flat caches [layers, slots, heads, dims], each slot a block of one."""
    rotation = (cos, sin) if cos is not None and sin is not None else None
    _launch(
        keys,
        values,
        flat_k.unsqueeze(2),
        None if flat_v is None else flat_v.unsqueeze(2),
        slots,
        rotation,
        rotary,
    )


def write_layer_triton(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    key_view: torch.Tensor,
    value_view: torch.Tensor | None,
    slots: torch.Tensor,
    rotation: tuple[torch.Tensor, torch.Tensor] | None,
    rotary: RotaryConfig | None,
) -> bool:
    """One layer's keys and values ([tokens, heads, dims]) into a back end's K and V views
    ([blocks, block_size, heads, dims], any strides: ``cache_layouts``), keys rotated by
    ``rotation`` (cos, sin per token) where given. False (nothing written) where the kernel
    does not fit (``kernel_fits``): the caller writes with torch ops."""
    if not kernel_fits(keys, values, key_view, value_view):
        return False
    _launch(
        keys.unsqueeze(0),
        None if values is None or value_view is None else values.unsqueeze(0),
        key_view.unsqueeze(0),
        None if value_view is None else value_view.unsqueeze(0),
        slots,
        rotation,
        rotary,
    )
    return True


def self_check(device_type: str, write_torch: Callable[..., None]) -> str | None:
    """None where the kernel, on this device, writes what ``write_torch`` (``writer``'s torch
    ops, the reference: passed in, as ``writer`` imports this module) writes on the CPU, bit
    for bit (bfloat16 keys rotated, a padded slot skipped, into a flat cache and into a
    strided HND view); else what went wrong. A writer that fails it is not used."""
    rotary = RotaryConfig(head_dim=16, rotary_dim=16, theta=10000.0)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 5, 2, 16, generator=g).bfloat16()  # [layers, tokens, heads, dims]
    values = torch.randn(2, 5, 2, 16, generator=g).bfloat16()
    slots = torch.tensor([3, PAD_SLOT, 0, 7, 4])
    cos, sin = rotation_table(rotary, 1234, len(slots))
    want_k, want_v = (torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16) for _ in "kv")
    write_torch(keys, values, want_k, want_v, slots, cos, sin, rotary)

    def there(t: torch.Tensor) -> torch.Tensor:
        return t.to(device_type)

    try:
        flat_k, flat_v = there(torch.zeros_like(want_k)), there(torch.zeros_like(want_v))
        write_triton(
            there(keys), there(values), flat_k, flat_v, there(slots), there(cos), there(sin), rotary
        )
        # One layer in blocks of two slots, heads before the block's tokens in memory (HND).
        hnd_k, hnd_v = (
            there(torch.zeros(4, 2, 2, 16, dtype=torch.bfloat16)).transpose(1, 2) for _ in "kv"
        )
        rotation = (there(cos), there(sin))
        write_layer_triton(
            there(keys[1]), there(values[1]), hnd_k, hnd_v, there(slots), rotation, rotary
        )
        got = {
            "flat keys": (flat_k.cpu(), want_k),
            "flat values": (flat_v.cpu(), want_v),
            "HND keys": (hnd_k.reshape(8, 2, 16).cpu(), want_k[1]),
            "HND values": (hnd_v.reshape(8, 2, 16).cpu(), want_v[1]),
        }
    except Exception as exc:  # the compiler or the driver refused it: torch ops serve
        return f"the kernel failed on {device_type}: {exc!r}"
    wrong = [name for name, (written, wanted) in got.items() if not torch.equal(written, wanted)]
    if wrong:
        return f"the kernel wrote other bits than torch ops on {device_type}: {', '.join(wrong)}"
    return None
