"""Slot mapping and context-parallel ownership (docs/design.md#sources)."""

from __future__ import annotations

import pytest
import torch

from chunkstore.kv.paging import (
    PAD_SLOT,
    cp_owner,
    cp_slot_mapping,
    request_slots,
    slot_mapping,
)

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


def test_one_request_slots_are_its_rows_slot_mapping() -> None:
    # Positions 3..6 of request 2 of step 2 (blocks [4, 5, 6, 8]), as the connector asks.
    blocks = torch.tensor([4, 5, 6, 8])
    assert request_slots(blocks, 3, 4, BLOCK_SIZE).tolist() == [11, 12, 13, 16]


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
        assert all(
            (p // interleave) % world == rank
            for p in positions[mine].tolist()
            if block_size % (interleave * world) == 0
        )
    assert len(seen) == 200
    if world == 1:
        assert torch.equal(
            cp_slot_mapping(req, positions, table, block_size, 1, 0),
            slot_mapping(req, positions, table, block_size),
        )


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
