"""vLLM's paged KV cache: slot mapping and context-parallel ownership.

Slot mapping (docs/design.md#sources): a token at position ``pos`` of request ``r`` lands in slot
``block_table[r, pos // block_size] * block_size + pos % block_size``. Under context
parallelism the sequence is interleaved over ``cp_world_size`` ranks in runs of
``cp_kv_cache_interleave_size`` tokens inside "virtual blocks" of ``block_size * cp_world_size``
tokens; a rank stores only its own tokens, and other tokens map to slot -1.
"""

from __future__ import annotations

import torch

PAD_SLOT = -1


def slot_mapping(
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slots of scheduled tokens given each token's request and position."""
    blocks_per_req = block_table.shape[1]
    table_indices = req_indices.long() * blocks_per_req + positions.long() // block_size
    block_numbers = block_table.reshape(-1)[table_indices].long()
    return block_numbers * block_size + positions.long() % block_size


def request_slots(block_ids: torch.Tensor, start: int, count: int, block_size: int) -> torch.Tensor:
    """Slots of positions [start, start + count) of one request whose block table is
    ``block_ids``: ``slot_mapping`` of that request alone."""
    positions = torch.arange(start, start + count)
    return slot_mapping(torch.zeros_like(positions), positions, block_ids[None, :], block_size)


def cp_owner(
    positions: torch.Tensor,
    cp_world_size: int,
    interleave_size: int = 1,
    block_size: int | None = None,
) -> torch.Tensor:
    """The context-parallel rank that stores each position."""
    pos = positions.long()
    if block_size is not None:
        pos = pos % (block_size * cp_world_size)
    return (pos // interleave_size) % cp_world_size


def cp_slot_mapping(
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    cp_world_size: int,
    cp_rank: int,
    interleave_size: int = 1,
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
