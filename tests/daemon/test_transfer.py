"""Peer pulls over Mooncake's Transfer Engine ("tcp", the fabric this machine has), with real
daemons, a real Redis and the real engine on both sides: the entry lands bit-exact in the
puller's pool and the next request hits; the owner cannot evict what a puller is reading; an
owner killed mid-pull leaves nothing half-stored; whatever the engine cannot serve goes over
the gRPC stream, counted by why.

Some tests pull in this process (``EnginePeers`` into an ``Index`` of its own), which is the
code the daemon's directory runs, so that they can act between the lease and the read."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.config import ServeConfig
from chunkstore.daemon.directory import directory_key
from chunkstore.daemon.index import Index
from chunkstore.daemon.peers import EnginePeers, _Peer
from chunkstore.daemon.pool import SharedMemoryPool
from chunkstore.daemon.transfer import MooncakeEngine, read_runs
from chunkstore.errors import ChecksumMismatch, InvalidRequest, StoreError, Unavailable
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.processes.redis import RedisServer
from chunkstore.protocol.shm import gather, map_shared_pool
from chunkstore.testing.entries import entry_key, random_kv, wait_for

ENGINE = ("--transfer-engine", "mooncake")


@pytest.fixture
def redis_url(tmp_path: Path):
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


def _cluster_flags(url: str) -> tuple[str, ...]:
    return ("--redis", url, "--directory-ttl-s", "2")


def _fragment(client: ChunkStoreClient) -> None:
    """Leave a hole at the start of the pool, so the next entry's blocks are not one run."""
    small = random_kv(2)
    client.put(entry_key(100), *small, virtual_start=0)
    client.put(entry_key(101), *small, virtual_start=0)
    client.evict([entry_key(100)])


def test_a_pull_over_the_engine_stores_the_entry_bit_exact(serve, redis_url: str) -> None:
    cluster = _cluster_flags(redis_url)
    # Block sizes differ, and the owner's blocks are not contiguous: reads are cut to fit both.
    a = serve(*ENGINE, *cluster, "--node", "a", name="a", block_size=1 << 16)
    b = serve(*ENGINE, *cluster, "--node", "b", name="b", block_size=1 << 18)
    assert a.ready["transfer"].startswith("127.0.0.1:")
    k, v = random_kv(1024, heads=4)  # 4 MiB
    directory = redis.Redis.from_url(redis_url, decode_responses=True)
    with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
        _fragment(on_a)
        assert on_a.put(entry_key(1), k, v, virtual_start=7)
        [held] = on_a.acquire([entry_key(1)])
        assert held is not None and held.blocks[1] != held.blocks[0] + 1
        on_a.release([held.lease_id])
        wait_for(lambda: directory.zscore(directory_key(entry_key(1)), a.tcp) is not None)
        assert on_b.lookup([entry_key(1)]) == [None]  # the miss queues the pull
        wait_for(lambda: on_b.lookup([entry_key(1)])[0] is not None)
        stored = on_b.get(entry_key(1))
        assert stored is not None and stored.layout.virtual_start == 7
        assert torch.equal(stored.keys, k) and torch.equal(stored.values, v)
        assert on_a.stats().active_leases == 0  # the puller let go of its lease
    metrics = b.scrape()
    nbytes = 2 * k.numel() * k.element_size()
    assert metrics['chunkstore_bytes_total{direction="write",transport="mooncake"}'] == nbytes
    assert metrics['chunkstore_remote_fetches_total{result="ok"}'] == 1
    assert sum(v for k, v in metrics.items() if "peer_pull_fallbacks_total" in k) == 0
    assert "whoever reaches it can read the pool" in a.log()  # said at start-up


class _Owner:
    """A real owner daemon with the engine and an entry, and this process as the puller."""

    def __init__(self, daemon: RunningDaemon, tmp_path: Path, entries: int = 1) -> None:
        self.daemon = daemon
        self.client = ChunkStoreClient(daemon.unix)
        self.kv = random_kv(64, heads=4)
        for i in range(entries):
            assert self.client.put(entry_key(i + 1), *self.kv, virtual_start=0)
        self.pool = SharedMemoryPool(1 << 16, 256, tmp_path)
        self.engine = MooncakeEngine("127.0.0.1", "tcp", "", self.pool.region())
        self.fell_back: list[str] = []
        self.peers = EnginePeers(self.engine, self.fell_back.append, None)

    def close(self) -> None:
        self.peers.close()
        self.engine.close()
        self.pool.close()
        self.client.close()


class _DuringRead(Index):
    """The real index, with ``during`` run after the reservation and before the engine reads
    (the lease in the owner's daemon is held then)."""

    def __init__(self, pool: SharedMemoryPool, during: Callable[[], None]) -> None:
        super().__init__(pool)
        self.during = during

    def store_with(self, key, layout, fill, claimed, tenant="") -> bool:  # type: ignore[no-untyped-def]
        def then_fill(blocks: list[int]) -> None:
            self.during()
            fill(blocks)

        return super().store_with(key, layout, then_fill, claimed, tenant)


def test_the_owner_cannot_evict_what_a_peer_is_reading(serve, tmp_path: Path) -> None:
    owner = _Owner(serve(*ENGINE, "--redis", "redis://127.0.0.1:1/0"), tmp_path)
    try:
        tried: list[tuple[int, int]] = []

        def evict() -> None:
            reply = owner.client.evict([entry_key(1)])
            tried.append((reply.evicted, reply.busy))

        index = _DuringRead(owner.pool, evict)
        pulled = owner.peers.pull(owner.daemon.tcp, entry_key(1), index)
        assert pulled is not None and pulled.transport == "mooncake" and pulled.stored
        assert tried == [(0, 1)]  # busy: leased by the puller
        entry = index.lookup([entry_key(1)])[0]
        assert entry is not None and owner.fell_back == []
        # What landed in this pool is the owner's entry, byte for byte.
        nbytes = entry.nbytes
        mine = np.empty(nbytes, dtype=np.uint8)
        gather(owner.pool.region(), entry.blocks, owner.pool.block_size, mine)
        k, v = owner.kv
        expected = torch.cat([k.flatten().view(torch.uint8), v.flatten().view(torch.uint8)])
        assert np.array_equal(mine, expected.numpy())
        assert owner.client.evict([entry_key(1)]).evicted == 1  # released after the read
    finally:
        owner.close()


def test_bytes_read_over_the_engine_are_checked_before_they_are_stored(
    serve, tmp_path: Path
) -> None:
    owner = _Owner(serve(*ENGINE, "--redis", "redis://127.0.0.1:1/0"), tmp_path)
    try:
        [entry] = owner.client.acquire([entry_key(1)])
        assert entry is not None
        region = map_shared_pool(
            owner.daemon.ready["shm_path"], owner.client.stats().bytes_capacity
        )
        region[entry.blocks[-1] * owner.client.block_size + 5] ^= 0x01  # a bit rots there
        owner.client.release([entry.lease_id])
        index = Index(owner.pool)
        with pytest.raises(ChecksumMismatch, match="committed by its peer"):
            owner.peers.pull(owner.daemon.tcp, entry_key(1), index)
        assert owner.fell_back == []  # bad bytes are not the engine's failure: no retry
        stats = index.stats()
        assert (stats.entries, stats.blocks_free) == (0, stats.blocks_total)
    finally:
        owner.close()


def test_an_owner_killed_mid_pull_leaves_nothing_stored(serve, tmp_path: Path) -> None:
    owner = _Owner(serve(*ENGINE, "--redis", "redis://127.0.0.1:1/0"), tmp_path)
    try:

        def kill() -> None:
            owner.daemon.process.send_signal(signal.SIGKILL)
            owner.daemon.process.wait()

        index = _DuringRead(owner.pool, kill)
        with pytest.raises(StoreError):
            owner.peers.pull(owner.daemon.tcp, entry_key(1), index)
        assert owner.fell_back == ["read_failed"]  # the engine failed, then the stream did
        stats = index.stats()
        assert (stats.entries, stats.active_reservations) == (0, 0)
        assert stats.blocks_free == stats.blocks_total  # the reserved blocks went back
    finally:
        owner.close()


def test_a_puller_that_dies_holds_the_owners_blocks_one_lease_ttl(serve, tmp_path: Path) -> None:
    owner = _Owner(
        serve(*ENGINE, "--redis", "redis://127.0.0.1:1/0", "--lease-ttl-s", "1"), tmp_path
    )
    try:
        puller = _Peer(owner.daemon.tcp, None, 10.0, None)
        held = puller.acquire(entry_key(1))  # ... and never reads nor releases: it died
        assert held is not None
        assert owner.client.evict([entry_key(1)]).busy == 1
        wait_for(lambda: owner.client.stats().active_leases == 0, timeout=10)
        assert owner.client.evict([entry_key(1)]).evicted == 1
        puller.close()
    finally:
        owner.close()


def test_what_the_engine_cannot_serve_goes_over_the_stream(
    serve, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = _cluster_flags(redis_url)
    # A peer without the engine: the pull goes over the stream, counted.
    a = serve(*cluster, "--node", "a", name="a")
    b = serve(*ENGINE, *cluster, "--node", "b", name="b")
    k, v = random_kv(8)
    with ChunkStoreClient(a.unix) as on_a, ChunkStoreClient(b.unix) as on_b:
        on_a.put(entry_key(1), k, v, virtual_start=0)
        wait_for(lambda: bool(redis.Redis.from_url(redis_url).exists(directory_key(entry_key(1)))))
        on_b.lookup([entry_key(1)])
        wait_for(lambda: on_b.lookup([entry_key(1)])[0] is not None)
        stored = on_b.get(entry_key(1))
        assert stored is not None and torch.equal(stored.keys, k)
    metrics = b.scrape()
    assert metrics['chunkstore_peer_pull_fallbacks_total{reason="peer_without_engine"}'] == 1
    assert metrics['chunkstore_bytes_total{direction="write",transport="grpc"}'] > 0

    # No engine here (not installed): said clearly; pulls go over the stream, counted.
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    pool = SharedMemoryPool(1 << 16, 64, tmp_path)
    try:
        with pytest.raises(Unavailable, match=r"pip install 'chunkstore\[mooncake\]'"):
            MooncakeEngine("127.0.0.1", "tcp", "", pool.region())
        fell_back: list[str] = []
        peers = EnginePeers(None, fell_back.append, None)
        index = Index(pool)
        pulled = peers.pull(a.tcp, entry_key(1), index)
        assert pulled is not None and pulled.transport == "grpc" and pulled.stored
        assert fell_back == ["engine_unavailable"]
        peers.close()
    finally:
        pool.close()


def test_read_runs_cut_reads_to_what_is_contiguous_on_both_sides() -> None:
    # 25 bytes in blocks of 10: ours 0,1,2 (one run), theirs 5,6 then 9.
    assert read_runs([0, 1, 2], 10, [5, 6, 9], 10, 25) == [(0, 50, 20), (20, 90, 5)]
    # Different block sizes: ours 20 bytes, theirs 10.
    assert read_runs([0, 1], 20, [3, 4, 7, 8], 10, 35) == [(0, 30, 20), (20, 70, 15)]
    assert read_runs([4], 64, [0], 64, 1) == [(256, 0, 1)]
    with pytest.raises(ValueError):
        read_runs([0], 10, [0, 1], 10, 15)  # too few blocks for the bytes


def test_the_engine_settings_are_checked() -> None:
    def config(**kw: object) -> ServeConfig:
        c = ServeConfig(socket="", **kw)  # type: ignore[arg-type]
        c.validate()
        return c

    with pytest.raises(InvalidRequest, match="needs --redis"):
        config(transfer_engine="mooncake")
    with pytest.raises(InvalidRequest, match="one of none, mooncake"):
        config(transfer_engine="nixl")
    with pytest.raises(InvalidRequest, match="one of tcp, rdma, ascend"):
        config(transfer_protocol="ib")
    with pytest.raises(InvalidRequest, match="--allow-insecure-peers"):
        config(
            transfer_engine="mooncake",
            redis="redis://r:6379/0",
            peer_token="t",
            peer_ca="ca.pem",
            tls_cert="c",
            tls_key="k",
        )
    cluster = config(transfer_engine="mooncake", redis="redis://r:6379/0", advertise="10.0.0.5:1")
    assert cluster.transfer_listen_host() == "10.0.0.5"
