"""The tenants' shares on their own, without a pool: what may be evicted for whom."""

from __future__ import annotations

import pytest

from chunkstore.daemon.budgets import Budgets
from chunkstore.daemon.eviction import make_policy
from chunkstore.daemon.records import Budget, Entry
from chunkstore.errors import PoolFull
from chunkstore.kv.entry import EntryLayout

BLOCK = 64


def entry(i: int, tenant: str, blocks: int) -> Entry:
    layout = EntryLayout(1, 1, 4, "float32", "mla", 4 * blocks, 0)  # 16 bytes a token
    return Entry(bytes([i]) * 16, layout, layout.nbytes, list(range(blocks)), 0, tenant=tenant)


def holding(budgets: Budgets, *entries: Entry) -> None:
    for e in entries:
        budgets.held[e.tenant] += len(e.blocks)
        budgets.place(e)


def test_a_tenant_over_its_quota_evicts_its_own_or_is_refused() -> None:
    budgets = Budgets(make_policy("lru"), BLOCK)
    budgets.budgets = {"a": Budget(quota=6 * BLOCK)}
    a1, a2 = entry(1, "a", 2), entry(2, "a", 2)
    holding(budgets, a1, a2)
    assert not budgets.over_quota("a", 2)  # 6 blocks: at the quota, not past it
    assert budgets.over_quota("a", 3)  # its own evictable entries make room
    a1.leases = 1
    budgets.place(a1)
    assert budgets.evictable["a"] == 2
    with pytest.raises(PoolFull, match="tenant a is at its quota") as full:
        budgets.over_quota("a", 5)  # 4 held, 2 of them leased: 2 + 5 > 6
    assert (full.value.needed, full.value.free, full.value.evictable) == (
        5 * BLOCK,
        2 * BLOCK,
        2 * BLOCK,
    )
    assert not budgets.over_quota("b", 1000)  # no budget, no quota


def test_the_victim_leaves_other_tenants_reserved_shares_whole() -> None:
    budgets = Budgets(make_policy("lru"), BLOCK)
    budgets.budgets = {"a": Budget(reserved=3 * BLOCK)}
    a1, s1, a2 = entry(1, "a", 2), entry(2, "", 2), entry(3, "a", 2)
    holding(budgets, a1, s1, a2)  # a1 the least recently used, then s1
    assert budgets.victim(None) is s1  # a holds 4 blocks: 2 fewer would dip into its 3
    assert budgets.victim("a") is a1  # for its own room a evicts its own, oldest first
    budgets.budgets = {"a": Budget(reserved=2 * BLOCK)}
    assert budgets.victim(None) is a1  # 2 fewer keep its reserved 2
    assert budgets.evictable_for("a", "b") == 2 and budgets.evictable_for("a", "a") == 4
    assert budgets.evictable_total(None) == 4  # a's 2 above its share, the shared 2


def test_pinned_leased_and_spilling_entries_are_out_of_the_order() -> None:
    budgets = Budgets(make_policy("worth"), BLOCK)
    e = entry(1, "", 1)
    holding(budgets, e)
    assert budgets.victim(None) is e
    for change in ("pinned", "leases", "evicted"):
        setattr(e, change, 1)
        budgets.place(e)
        assert budgets.victim(None) is None and budgets.evictable[""] == 0
        setattr(e, change, 0 if change != "evicted" else False)
        budgets.place(e)
        assert budgets.victim(None) is e and budgets.evictable[""] == 1
