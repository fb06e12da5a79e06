"""Where a layer's tokens go under vLLM's hybrid KV-cache manager (``cache_groups``,
``RegisteredCache.group_slots``): each KV-cache group's own block table; in a sliding-window
group nowhere for positions whose block is the null block (out of the window of every token
to come), and the blocks such a group may have let go counted as vLLM counts them; a group
that keeps every token never loses one (no exact place: the load is computed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chunkstore_vllm.cache_groups import NULL_BLOCK, CacheGroups
from chunkstore_vllm.cpu_layout import CpuKVLayout
from chunkstore_vllm.heads import RankHeads
from chunkstore_vllm.registered_cache import RegisteredCache

BLOCK = 4
# tiny-gemma3's layout: (sliding, sliding, global) x 2 in three groups, window 5
GROUPS = CacheGroups(
    (("l.0.attn", "l.3.attn"), ("l.1.attn", "l.4.attn"), ("l.2.attn", "l.5.attn")),
    (5, 5, 0),
    (BLOCK, BLOCK, BLOCK),
)


def cache() -> RegisteredCache:
    access = CpuKVLayout(SimpleNamespace(), BLOCK)
    registered = RegisteredCache(access, RankHeads(0, 1, 1, 1), BLOCK)
    registered.set_layers({f"l.{i}.attn": torch.zeros(1) for i in range(6)}, GROUPS)
    return registered


def test_each_layer_is_in_its_group() -> None:
    assert cache().layer_groups == [0, 1, 2, 0, 1, 2]


def test_a_sliding_group_takes_only_the_tokens_whose_block_is_there() -> None:
    tables = ([NULL_BLOCK, 7, 8], [NULL_BLOCK, 3, 4], [1, 2, 5])
    placed = cache().group_slots(tables, 2, 8)  # positions 2..9
    slots, held = placed[0]
    assert held is not None and held.tolist() == [False, False] + [True] * 6
    assert slots.tolist() == [7 * BLOCK + i for i in range(4)] + [8 * BLOCK, 8 * BLOCK + 1]
    assert placed[2][1] is None  # the global group holds them all
    assert placed[2][0].tolist() == [1 * BLOCK + 2, 1 * BLOCK + 3, *range(8, 12), 20, 21]


def test_a_group_that_keeps_every_token_never_lacks_one() -> None:
    with pytest.raises(ValueError, match="no block"):
        cache().group_slots(([1, 2], [3, 4], [NULL_BLOCK, 6]), 0, 8)
    with pytest.raises(ValueError, match="ends before"):
        cache().group_slots(([1], [3], [5]), 0, 8)


def test_blocks_a_sliding_group_lets_go_as_vllm_counts_them() -> None:
    # SlidingWindowManager.get_num_skipped_tokens: positions < computed - window + 1
    assert [GROUPS.released(0, computed, BLOCK) for computed in (4, 7, 8, 12, 13)] == [
        0,
        0,
        1,
        2,
        2,
    ]
    assert GROUPS.released(2, 100, BLOCK) == 0  # the global group keeps every block


def test_one_group_that_keeps_every_token_is_the_plain_case() -> None:
    assert not CacheGroups.from_kv_cache_config(None).hybrid
    assert GROUPS.hybrid
