"""Slot mapping (seed 004), context-parallel ownership (seed 003), writing a chunk in."""

from __future__ import annotations

import pytest
import torch

from chunkstore.errors import LayoutError
from chunkstore.paging import PAD_SLOT, cp_owner, cp_slot_mapping, slot_mapping, write_chunk
from chunkstore.rope import RotaryConfig, remap_keys

BLOCK_SIZE = 2


def seed_004_table(rows: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(4, 6, dtype=torch.int32)  # max model len 12 / block size 2
    for r, row in enumerate(rows):
        table[r, : len(row)] = torch.tensor(row)
    return table


def test_seed_004_step_1_all_prefill() -> None:
    table = seed_004_table([[1, 2], [3], [4, 5, 6]])
    req = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 4])
    assert slot_mapping(req, pos, table, BLOCK_SIZE).tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]


def test_seed_004_step_2_chunked_prefill() -> None:
    table = seed_004_table([[1, 2], [3, 7], [4, 5, 6, 8]])
    req = torch.tensor([0, 1, 2, 2, 2])
    pos = torch.tensor([3, 2, 5, 6, 7])
    assert slot_mapping(req, pos, table, BLOCK_SIZE).tolist() == [5, 14, 13, 16, 17]


@pytest.mark.parametrize(("world", "interleave"), [(1, 1), (2, 1), (2, 4), (4, 2), (3, 1)])
def test_cp_ranks_partition_the_sequence(world: int, interleave: int) -> None:
    block_size = 8
    positions = torch.arange(200)
    req = torch.zeros_like(positions)
    blocks_needed = -(-200 // (block_size * world))
    table = torch.arange(1, blocks_needed + 1)[None]
    owners = cp_owner(positions, world, interleave, block_size)
    seen: set[int] = set()
    for rank in range(world):
        slots = cp_slot_mapping(req, positions, table, block_size, world, rank, interleave)
        mine = slots != PAD_SLOT
        assert torch.equal(mine, owners == rank)
        local = slots[mine].tolist()
        assert len(set(local)) == len(local)  # no two tokens share a slot on one rank
        seen.update((rank, s) for s in local)
        # Each run of `interleave` consecutive tokens stays together on one rank.
        assert all((p // interleave) % world == rank for p in positions[mine].tolist()
                   if block_size % (interleave * world) == 0)
    assert len(seen) == 200
    if world == 1:
        assert torch.equal(cp_slot_mapping(req, positions, table, block_size, 1, 0),
                           slot_mapping(req, positions, table, block_size))


def test_cp_interleave_worked_example() -> None:
    # 2 ranks, interleave 2, block size 4 -> virtual block of 8 tokens: ranks own runs of 2.
    table = torch.tensor([[10, 11]])
    pos = torch.arange(16)
    req = torch.zeros_like(pos)
    r0 = cp_slot_mapping(req, pos, table, 4, 2, 0, 2).tolist()
    r1 = cp_slot_mapping(req, pos, table, 4, 2, 1, 2).tolist()
    pad = PAD_SLOT
    assert r0 == [40, 41, pad, pad, 42, 43, pad, pad, 44, 45, pad, pad, 46, 47, pad, pad]
    assert r1 == [pad, pad, 40, 41, pad, pad, 42, 43, pad, pad, 44, 45, pad, pad, 46, 47]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [3, 256])
def test_write_chunk_rotates_keys_and_copies_values_into_their_slots(dtype, tile) -> None:
    rotary = RotaryConfig(head_dim=16, rotary_dim=16, theta=10000.0)
    layers, tokens, heads = 3, 11, 2
    torch.manual_seed(0)
    keys = torch.randn(layers, tokens, heads, 16).to(dtype)
    values = torch.randn(layers, tokens, heads, 16).to(dtype)
    key_cache = torch.zeros(layers, 8, 4, heads, 16, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    actual_start, virtual_start = 6, 2
    table = torch.tensor([[5, 1, 7, 3, 2]])
    positions = torch.arange(actual_start, actual_start + tokens)
    slots = slot_mapping(torch.zeros_like(positions), positions, table, 4)
    write_chunk(keys, values, key_cache, value_cache, slots, actual_start - virtual_start,
                rotary, tile_tokens=tile)
    flat_k = key_cache.view(layers, -1, heads, 16)
    flat_v = value_cache.view(layers, -1, heads, 16)
    for layer in range(layers):
        expected = remap_keys(keys[layer], actual_start - virtual_start, rotary)
        torch.testing.assert_close(flat_k[layer, slots], expected, rtol=0, atol=0)
        assert torch.equal(flat_v[layer, slots], values[layer])
    untouched = torch.ones(flat_k.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[:, untouched].any() and not flat_v[:, untouched].any()


def test_write_chunk_skips_tokens_another_cp_rank_owns() -> None:
    rotary = RotaryConfig(head_dim=8, rotary_dim=8, theta=10000.0)
    keys, values = torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    key_cache, value_cache = torch.zeros(1, 4, 2, 1, 8), torch.zeros(1, 4, 2, 1, 8)
    slots = torch.tensor([0, PAD_SLOT, 1, PAD_SLOT, 2, PAD_SLOT])
    write_chunk(keys, values, key_cache, value_cache, slots, 5, rotary)
    flat = value_cache.view(-1, 1, 8)
    assert torch.equal(flat[:3], values[0, ::2]) and not flat[3:].any()


def test_write_chunk_rejects_mismatched_layouts() -> None:
    keys = torch.randn(2, 4, 1, 8)
    with pytest.raises(LayoutError):
        write_chunk(keys, keys, torch.zeros(2, 4, 2, 2, 8), torch.zeros(2, 4, 2, 2, 8),
                    torch.arange(4), 0, None)
