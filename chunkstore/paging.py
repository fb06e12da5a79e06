"""vLLM's paged KV cache: slot mapping, context-parallel ownership, and writing a chunk in.

Slot mapping (seed 004): a token at position ``pos`` of request ``r`` lands in slot
``block_table[r, pos // block_size] * block_size + pos % block_size``. Under context
parallelism (seed 003) the sequence is interleaved over ``cp_world_size`` ranks in runs of
``cp_kv_cache_interleave_size`` tokens inside "virtual blocks" of ``block_size * cp_world_size``
tokens; a rank stores only its own tokens, and other tokens map to slot -1.
"""

from __future__ import annotations

import torch

from chunkstore.errors import LayoutError
from chunkstore.rope import RotaryConfig, rotate_keys, rotation_table

PAD_SLOT = -1


def slot_mapping(
    req_indices: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slots of scheduled tokens given each token's request and position (seed 004)."""
    blocks_per_req = block_table.shape[1]
    table_indices = req_indices.long() * blocks_per_req + positions.long() // block_size
    block_numbers = block_table.reshape(-1)[table_indices].long()
    return block_numbers * block_size + positions.long() % block_size


def cp_owner(positions: torch.Tensor, cp_world_size: int, interleave_size: int = 1,
             block_size: int | None = None) -> torch.Tensor:
    """The context-parallel rank that stores each position."""
    pos = positions.long()
    if block_size is not None:
        pos = pos % (block_size * cp_world_size)
    return (pos // interleave_size) % cp_world_size


def cp_slot_mapping(
    req_indices: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
    block_size: int, cp_world_size: int, cp_rank: int, interleave_size: int = 1,
) -> torch.Tensor:
    """Slot mapping on one context-parallel rank: PAD_SLOT for tokens another rank owns."""
    if not 0 <= cp_rank < cp_world_size:
        raise ValueError(f"cp_rank {cp_rank} outside world size {cp_world_size}")
    virtual_block_size = block_size * cp_world_size
    pos = positions.long()
    table_indices = req_indices.long() * block_table.shape[1] + pos // virtual_block_size
    offsets = pos % virtual_block_size
    local = (offsets // interleave_size) % cp_world_size == cp_rank
    local_offsets = (offsets // (cp_world_size * interleave_size)) * interleave_size + (
        offsets % interleave_size
    )
    block_numbers = block_table.reshape(-1)[table_indices].long()
    slots = block_numbers * block_size + local_offsets
    return torch.where(local, slots, torch.full_like(slots, PAD_SLOT))


def write_chunk(
    keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, slots: torch.Tensor, delta: int | torch.Tensor,
    rotary: RotaryConfig | None, tile_tokens: int = 256,
) -> None:
    """Write one chunk's KV for every layer into a paged cache, rotating keys by ``delta``.

    keys / values: [layers, tokens, kv_heads, head_dim]; caches: [layers, num_blocks,
    block_size, kv_heads, head_dim]; slots: [tokens] (PAD_SLOT skips a token another rank
    owns). ``rotary=None`` (or delta 0) copies keys unrotated. Work goes tile by tile, so the
    rotated tile is still in cache when it is scattered into the pool: the remap costs about
    what the copy costs.
    """
    layers, tokens = keys.shape[:2]
    row_shape = keys.shape[2:]
    if values.shape[:2] != (layers, tokens) or slots.shape != (tokens,):
        raise LayoutError(f"keys {tuple(keys.shape)}, values {tuple(values.shape)} and "
                          f"{tokens} slots do not describe one chunk")
    if key_cache.shape[0] != layers or key_cache.shape[3:] != row_shape:
        raise LayoutError(f"cache {tuple(key_cache.shape)} does not fit keys {tuple(keys.shape)}")
    flat_k = key_cache.view(layers, -1, *row_shape)
    flat_v = value_cache.view(layers, -1, *value_cache.shape[3:])
    slots = slots.to(keys.device).long()
    keep = slots != PAD_SLOT
    rotate = rotary is not None and not (isinstance(delta, int) and delta == 0)
    if rotate:
        assert rotary is not None
        cos, sin = rotation_table(rotary, delta, tokens, keys.device)
    if not bool(keep.all()):
        index = keep.nonzero().squeeze(1)
        keys, values, slots = keys[:, index], values[:, index], slots[index]
        if rotate:
            cos, sin = cos[index], sin[index]
        tokens = slots.shape[0]
    buffer = torch.empty((min(tile_tokens, tokens), *row_shape), dtype=keys.dtype,
                         device=keys.device)
    for start in range(0, tokens, tile_tokens):
        end = min(start + tile_tokens, tokens)
        tile_slots = slots[start:end]
        for layer in range(layers):
            src = keys[layer, start:end]
            if rotate:
                out = buffer[: end - start]
                rotate_keys(src, cos[start:end], sin[start:end], rotary, out=out)  # type: ignore[arg-type]
                src = out
            flat_k[layer].index_copy_(0, tile_slots, src)
            flat_v[layer].index_copy_(0, tile_slots, values[layer, start:end])
