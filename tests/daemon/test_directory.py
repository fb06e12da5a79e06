"""The cluster directory: two real daemons and a real Redis. A chunk stored on one node is
found by the other through Redis, pulled over its gRPC stream (checksum-verified) and served
locally after that; evicted or dead nodes leave the directory; without Redis the daemon
serves on alone."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.directory import directory_key
from chunkstore.processes.redis import RedisServer, free_port
from chunkstore.testing.entries import entry_key, random_kv

TTL = "2"


def eventually(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.1)


@pytest.fixture
def cluster(serve, tmp_path: Path):
    with RedisServer(tmp_path / "redis") as server:
        cluster = ("--redis", server.url, "--directory-ttl-s", TTL)
        yield server, [serve("--node", name, *cluster, name=name) for name in ("node-a", "node-b")]


def test_a_chunk_stored_on_one_node_is_pulled_by_the_other(cluster) -> None:
    server, (a, b) = cluster
    directory = redis.Redis.from_url(server.url, decode_responses=True)
    k, v = random_kv(12)
    with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
        assert on_a.put(entry_key(1), k, v, virtual_start=5)
        eventually(lambda: directory.zscore(directory_key(entry_key(1)), a.tcp) is not None)
        assert on_b.lookup([entry_key(1)]) == [None]  # a miss here; it queues the pull
        eventually(lambda: on_b.lookup([entry_key(1)])[0] is not None)
        stored = on_b.get(entry_key(1))
        assert stored is not None and stored.layout.virtual_start == 5
        assert torch.equal(stored.keys, k) and torch.equal(stored.values, v)
        # Now b holds it too, and says so.
        eventually(lambda: directory.zscore(directory_key(entry_key(1)), b.tcp) is not None)
        # A key nobody holds is looked for and not found.
        assert on_b.lookup([entry_key(2)]) == [None]
        eventually(lambda: b.scrape().get('chunkstore_remote_fetches_total{result="absent"}') == 1)
    assert b.scrape()['chunkstore_remote_fetches_total{result="ok"}'] == 1


def test_a_probe_neither_counts_nor_pulls_what_it_misses(cluster) -> None:
    """The router's placement Lookup (``probe``): a miss is not wanted from a peer, and no
    lookup is counted in the hit rate."""
    server, (a, b) = cluster
    directory = redis.Redis.from_url(server.url, decode_responses=True)
    with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
        assert on_a.put(entry_key(1), *random_kv(4), virtual_start=0)
        eventually(lambda: directory.zscore(directory_key(entry_key(1)), a.tcp) is not None)
        counted = b.scrape()["chunkstore_lookup_chunks_total"]
        assert on_b.lookup([entry_key(1)], probe=True) == [None]
        assert on_a.lookup([entry_key(1)], probe=True) == [4]
        # A plain miss after it: the one fetcher takes wants in order, so once this one is
        # answered, a want of the probe's would have been too.
        assert on_b.lookup([entry_key(2)]) == [None]
        eventually(lambda: b.scrape().get('chunkstore_remote_fetches_total{result="absent"}') == 1)
        assert b.scrape().get('chunkstore_remote_fetches_total{result="ok"}', 0) == 0
        assert on_b.lookup([entry_key(1)], probe=True) == [None]
        assert b.scrape()["chunkstore_lookup_chunks_total"] == counted + 1  # the plain one


def test_evicted_and_dead_nodes_leave_the_directory(cluster) -> None:
    server, (a, b) = cluster
    directory = redis.Redis.from_url(server.url, decode_responses=True)
    with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
        on_a.put(entry_key(1), *random_kv(4), virtual_start=0)
        on_b.put(entry_key(1), *random_kv(4), virtual_start=0)
        name = directory_key(entry_key(1))
        eventually(lambda: set(directory.zrange(name, 0, -1)) == {a.tcp, b.tcp})
        on_a.evict([entry_key(1)])
        eventually(lambda: set(directory.zrange(name, 0, -1)) == {b.tcp})
    b.process.send_signal(signal.SIGKILL)  # no clean withdrawal: the claim must lapse
    b.process.wait()
    eventually(lambda: not directory.zrangebyscore(name, time.time(), "+inf"), timeout=10)


def test_a_peer_with_bad_bytes_is_not_copied(cluster, tmp_path: Path) -> None:
    server, (a, b) = cluster
    from chunkstore.protocol.shm import map_shared_pool

    with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
        on_a.put(entry_key(1), *random_kv(8), virtual_start=0)
        [entry] = on_a.acquire([entry_key(1)])
        assert entry is not None
        region = map_shared_pool(a.ready["shm_path"], on_a.stats().bytes_capacity)
        region[entry.blocks[0] * on_a.block_size + 3] ^= 0xFF  # a bit rots on node a
        on_a.release([entry.lease_id])
        eventually(
            lambda: bool(redis.Redis.from_url(server.url).exists(directory_key(entry_key(1))))
        )
        on_b.lookup([entry_key(1)])
        eventually(lambda: b.scrape()['chunkstore_remote_fetches_total{result="failed"}'] == 1)
        assert on_b.lookup([entry_key(1)]) == [None]  # never stored on b
        assert "hashes to" in b.log()  # the checksum caught it
    assert b.scrape()["chunkstore_directory_errors_total"] == 0  # a bad peer is not Redis down


def test_without_redis_the_daemon_serves_alone(serve) -> None:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    daemon = serve("--redis", unreachable, "--directory-ttl-s", TTL)
    with ChunkStoreClient(daemon.unix) as client:
        k, v = random_kv(4)
        assert client.put(entry_key(1), k, v, virtual_start=0)
        assert client.lookup([entry_key(2)]) == [None]
        stored = client.get(entry_key(1))
        assert stored is not None and torch.equal(stored.keys, k)
    eventually(lambda: daemon.scrape()["chunkstore_directory_errors_total"] > 0)
    assert "serving on alone" in daemon.log()


def test_an_entry_only_on_a_peers_disk_is_advertised_and_pulled(serve, tmp_path: Path) -> None:
    """Node a stores a chunk, stops (its pool gone, the entry on its disk tier) and starts
    again: it still claims the chunk in Redis, and b's pull makes a read it back from disk."""
    with RedisServer(tmp_path / "redis") as server:
        cluster = ("--redis", server.url, "--directory-ttl-s", TTL)
        tier = ("--disk-dir", str(tmp_path / "disk-a"))
        a = serve("--node", "node-a", *cluster, *tier, name="a-first")
        k, v = random_kv(12)
        with ChunkStoreClient(a.unix) as on_a:
            assert on_a.put(entry_key(1), k, v, virtual_start=5)
        assert a.stop() == 0
        a = serve("--node", "node-a", *cluster, *tier, name="a-again")
        b = serve("--node", "node-b", *cluster, name="node-b")
        directory = redis.Redis.from_url(server.url, decode_responses=True)
        eventually(lambda: directory.zscore(directory_key(entry_key(1)), a.tcp) is not None)
        with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
            assert on_a.stats().entries == 0  # in a's disk tier only
            assert on_b.lookup([entry_key(1)]) == [None]  # queues the pull
            eventually(lambda: on_b.lookup([entry_key(1)])[0] is not None)
            stored = on_b.get(entry_key(1))
            assert stored is not None and stored.layout.virtual_start == 5
            assert torch.equal(stored.keys, k) and torch.equal(stored.values, v)
            assert on_a.stats().disk.counts["promotions"] == 1
