"""Eviction policies (serve --eviction): the heap order against a plain sort, what each policy
evicts under pressure in a real index, and a daemon process running the worth policy."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.eviction import HeapOrder, make_policy, recompute_cost
from chunkstore.daemon.index import Index
from chunkstore.daemon.pool import SharedMemoryPool
from chunkstore.errors import InvalidRequest
from chunkstore.kv.entry import EntryLayout
from chunkstore.protocol.shm import checksum
from chunkstore.testing.entries import entry_key, random_kv

BLOCK = 256


@dataclass(eq=False)
class Item:
    key: bytes
    rank: float
    layout: EntryLayout = field(default_factory=lambda: layout(1))
    nbytes: int = 1


def layout(tokens: int, start: int = 0, kind: str = "chunk") -> EntryLayout:
    return EntryLayout(1, 1, 4, "float32", "mla", tokens, start, kind)  # 16 bytes a token


def test_the_heap_order_heads_what_a_sort_of_the_live_entries_heads() -> None:
    rng = random.Random(7)
    order: HeapOrder[Item] = HeapOrder()
    live: dict[bytes, tuple[float, int]] = {}  # key -> (rank, when added)
    added = 0
    for _ in range(20_000):
        key = bytes([rng.randrange(64)]) * 16
        if key in live and rng.random() < 0.5:
            assert order.remove(Item(key, 0.0))
            del live[key]
        else:
            if key in live:  # ranked again: out, then in with its new rank
                order.remove(Item(key, 0.0))
            rank = float(rng.randrange(100))
            order.add(Item(key, rank))
            live[key] = (rank, added)
            added += 1
        head = order.head()
        expected = min(live, key=lambda k: live[k]) if live else None
        assert (head.key if head else None) == expected
        assert len(order) == len(live) and set(order) == set(live)
    assert len(order._heap) <= 2 * len(live) + 65  # stale items do not pile up


def fill(
    index: Index, key: bytes, tokens: int, start: int = 0, kind: str = "chunk", hold: float = 0.0
) -> None:
    session = index.open_session("t")
    lay = layout(tokens, start, kind)
    reservation = index.reserve(session, key, lay, lay.nbytes)
    index.commit(
        session,
        reservation.id,
        checksum(index.pool.region(), reservation.blocks, BLOCK, lay.nbytes),
        hold=hold,
    )
    index.end_session(session)


def read(index: Index, keys: list[bytes], times: int = 1) -> None:
    session = index.open_session("reader")
    for _ in range(times):
        leases = [got[0].id for got in index.acquire(session, keys) if got is not None]
        index.release(session, leases)
    index.end_session(session)


def present(index: Index, key: bytes) -> bool:
    return index.lookup([key])[0] is not None


@pytest.mark.parametrize("eviction", ["lru", "worth"])
def test_a_hot_entry_outlives_a_scan_by_worth_and_not_by_recency(
    tmp_path: Path, eviction: str
) -> None:
    pool = SharedMemoryPool(BLOCK, 8, directory=tmp_path)
    index = Index(pool, high_watermark=1.0, low_watermark=1.0, eviction=eviction)
    hot = entry_key(0)
    fill(index, hot, 16)  # one block each
    read(index, [hot], times=5)
    for i in range(1, 11):  # ten entries read once each pass through a pool of eight
        fill(index, entry_key(i), 16)
    assert index.stats().evictions == {"capacity": 3}
    # Recency: the hot entry was released before the scan began, so it went first. Worth:
    # read five times, it outranks entries read once (until aging catches up with it).
    assert present(index, hot) == (eviction == "worth")
    pool.close()


def test_a_held_entry_outlives_pressure_until_its_first_read_or_its_time(tmp_path: Path) -> None:
    """Commit's hold (the router's cold chunks): a fresh entry read once ranks lowest by
    worth, so the saves of the same moment evict it before the request it was stored for
    reads it. Held, it is not evicted until its first lease, or its time (at most the
    lease TTL); never more than half the pool is held."""
    now = [0.0]
    pool = SharedMemoryPool(BLOCK, 8, directory=tmp_path)
    index = Index(
        pool, lease_ttl=5.0, high_watermark=1.0, low_watermark=1.0, eviction="worth",
        clock=lambda: now[0],
    )  # fmt: skip
    for i in range(8):  # a pool of entries read three times each
        fill(index, entry_key(i), 16)
        read(index, [entry_key(i)], times=3)
    fill(index, entry_key(100), 16)  # read once, not held: the next save evicts it
    fill(index, entry_key(101), 16)
    assert not present(index, entry_key(100))
    fill(index, entry_key(200), 16, hold=60.0)  # held (for the lease TTL's 5 s at most)
    for i in range(300, 306):
        fill(index, entry_key(i), 16)
    assert present(index, entry_key(200)) and index.stats().held_entries == 1
    read(index, [entry_key(200)])  # its first read ends the hold
    assert index.stats().holds == {"read": 1} and index.stats().held_entries == 0
    fill(index, entry_key(200 + 1), 16, hold=60.0)
    now[0] = 4.9
    index.expire()
    assert index.stats().held_entries == 1
    now[0] = 5.0  # the lease TTL: the hold lapses, and the entry is evictable as any other
    index.expire()
    assert index.stats().holds == {"read": 1, "lapsed": 1}
    for i in range(400, 408):
        fill(index, entry_key(i), 16)
    assert not present(index, entry_key(201))
    for i in range(500, 506):  # half the pool held at most: the fifth is stored, not held
        fill(index, entry_key(i), 16, hold=60.0)
    assert index.stats().held_entries == 4 and index.stats().holds["refused"] == 2
    pool.close()


def test_worth_evicts_a_prefix_from_its_tail_and_weighs_position_for_chunks(tmp_path: Path) -> None:
    pool = SharedMemoryPool(BLOCK, 4, directory=tmp_path)
    index = Index(pool, high_watermark=1.0, low_watermark=1.0, eviction="worth")
    blocks = [entry_key(i) for i in range(3)]
    for i, key in enumerate(blocks):  # one prompt's prefix blocks, read together
        fill(index, key, 16, start=16 * i, kind="prefix")
    read(index, blocks)
    fill(index, entry_key(9), 16)
    fill(index, entry_key(10), 16)  # needs room: the block furthest in goes, not the head
    assert [present(index, k) for k in blocks] == [True, True, False]
    pool.close()
    # A chunk further into a prompt costs more to compute again than the same chunk at 0.
    assert recompute_cost(layout(100, 4000)) > 1.4 * recompute_cost(layout(100, 0))
    with pytest.raises(InvalidRequest, match="not one of lru, worth"):
        make_policy("lfu")


def test_a_daemon_runs_the_worth_policy_and_refuses_an_unknown_one(serve, tmp_path: Path) -> None:
    from chunkstore.processes.daemon import start_daemon

    daemon = serve(
        "--eviction", "worth", "--high-watermark", "1", "--low-watermark", "1", pool_bytes=8 << 16
    )
    with ChunkStoreClient(daemon.unix) as client:
        k, v = random_kv(21, seed=0)  # one 64 KiB block an entry
        assert client.put(entry_key(0), k, v, virtual_start=0)
        for _ in range(5):
            assert client.get(entry_key(0)) is not None
        for i in range(1, 11):
            assert client.put(entry_key(i), *random_kv(21, seed=i), virtual_start=0)
        assert client.stats().evictions["capacity"] == 3
        assert client.lookup([entry_key(0)]) != [None]  # the hot one stayed
        # Committed with a hold (hold_ms, over the socket), a fresh entry outlives the
        # saves after it until it is read.
        held = random_kv(21, seed=20)
        assert client.put_checksummed(entry_key(20), *held, virtual_start=0, hold=30.0)
        for i in range(21, 31):
            assert client.put(entry_key(i), *random_kv(21, seed=i), virtual_start=0)
        assert client.lookup([entry_key(20), entry_key(21)]) == [21, None]
        assert daemon.scrape()["chunkstore_held_entries"] == 1
        assert client.get(entry_key(20)) is not None
        counts = daemon.scrape()
        assert counts["chunkstore_held_entries"] == 0
        assert counts['chunkstore_holds_total{outcome="read"}'] == 1
    with pytest.raises(RuntimeError, match="--eviction: one of lru, worth"):
        start_daemon(tmp_path / "bad", "--eviction", "lfu", timeout=20)
