"""``chunkstore bench store``: what a user of the store does, timed side by side.

It starts a real daemon (and a real redis-server) on loopback and reports:
- lookup: batches of 64 keys (half present) over the unix socket: p50 / p99 latency and keys
  looked up per second;
- read of one chunk in SmolLM2's KV shape (default 4096 tokens, fp32: 189 MB) into a tensor,
  each round: a plain memcpy of the same bytes (torch copy_), the shared-memory path (acquire,
  copy out of the pool, verify the xxh3 checksum, release), a GET of the same bytes from Redis
  as a Redis-backed KV cache would do it, and the gRPC stream (for the record);
- put of the same chunk (reserve, copy into the pool hashing each stripe, commit; the daemon
  re-hashes at commit only with ``--verify-commits true``), into an emptied key each round;
- 64 entries of 1 MiB read one at a time (acquire, read, release each) and 64 per call (one
  acquire, one ``read_many``, one release);
- every read ends with ``release(wait=False)``, as ``ChunkStoreClient.get`` does: the bytes
  are in the tensor and checked when it is sent, and its answer is read before the next call;
- with ``--readers``: the aggregate bandwidth of N reader processes reading the chunk.

``--tier disk`` runs the disk tier's bench instead (``bench/disk.py``).

``--peers`` also runs Mooncake Store in daemon mode (``bench/mooncake.py``: its master and
store process, this process as its client, zero-copy calls into its registered buffer) and
Redis through the same steps, and reports ``get_vs_mooncake``, ``put_vs_mooncake``,
``lookup_vs_mooncake``, ``small_get_vs_mooncake`` (chunkstore's time over Mooncake's: below 1,
chunkstore is faster). Ratios are medians of per-round ratios, measured in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
import torch

from chunkstore.bench.chunk import add_chunk_arguments, chunk_kv
from chunkstore.bench.scale import read_bandwidth
from chunkstore.bench.timing import timed
from chunkstore.client import ChunkStoreClient, as_bytes
from chunkstore.processes.daemon import RunningDaemon, start_daemon
from chunkstore.processes.redis import RedisServer

if TYPE_CHECKING:
    from chunkstore.bench.mooncake import MooncakeStore


def _ratio(numerator: list[float], denominator: list[float]) -> float:
    return round(statistics.median(n / d for n, d in zip(numerator, denominator, strict=True)), 3)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


SMALL = 64  # entries of --small-bytes read one at a time, and in one call
SETTLE_S = 0.01  # the pause before each timed call (_rounds)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.tier == "disk":
        from chunkstore.bench import disk

        yield from disk.run(args)
        return
    keys, values, nbytes = chunk_kv(args)
    small_bytes = args.small_bytes
    pool_bytes = max(4 * nbytes + 2 * SMALL * small_bytes, 256 << 20)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chunkstore-bench-")))
        daemon = stack.enter_context(
            start_daemon(tmp / "daemon", pool_bytes=pool_bytes, block_size=args.block_size)
        )
        server = stack.enter_context(RedisServer(tmp / "redis"))
        shm = stack.enter_context(ChunkStoreClient(daemon.unix, transport="shm"))
        stream = stack.enter_context(ChunkStoreClient(daemon.unix, transport="stream"))
        peer = None
        if args.peers:
            from chunkstore.bench.mooncake import MooncakeStore

            buffer_bytes = nbytes + SMALL * small_bytes
            peer = MooncakeStore(tmp / "mooncake", 2 * buffer_bytes + (64 << 20), buffer_bytes)
            stack.callback(peer.close)
        r = redis.Redis.from_url(server.url)
        source = torch.cat(
            [keys.reshape(-1).view(torch.uint8), values.reshape(-1).view(torch.uint8)]
        )
        rows = [
            _lookups(shm, args, peer, r if peer else None),
            _reads(args, shm, stream, r, peer, keys, values, source),
            _puts(args, shm, r if peer else None, peer, keys, values, source),
            _small_gets(args, shm, peer, small_bytes),
        ]
        yield from rows
        if args.readers:
            yield _readers(daemon, args, nbytes)
        if peer is not None:
            yield {
                "bench": "store.vs_mooncake",
                **{k: v for row in rows for k, v in row.items() if k.endswith("_vs_mooncake")},
            }


def _lookups(
    client: ChunkStoreClient,
    args: argparse.Namespace,
    peer: MooncakeStore | None,
    r: redis.Redis | None,
) -> dict[str, Any]:
    small = torch.zeros(1, 1, 1, 8)
    present = [i.to_bytes(16, "little") for i in range(args.batch // 2)]
    for key in present:
        client.put(key, small, small, 0)
    batch = present + [(10**6 + i).to_bytes(16, "little") for i in range(args.batch // 2)]
    ways: dict[str, Callable[[], object]] = {"chunkstore": lambda: client.lookup(batch)}
    if peer is not None:
        names = [key.hex() for key in batch]
        for name in names[: args.batch // 2]:
            peer.buffer[:8] = 0
            peer.put(name, 0, 8)
        ways["mooncake"] = lambda: peer.exist(names)
    if r is not None:
        for key in present:
            r.set(key, b"x" * 8)

        def redis_exists() -> None:
            pipe = r.pipeline(transaction=False)
            for key in batch:
                pipe.exists(key)
            pipe.execute()

        ways["redis"] = redis_exists
    for fn in ways.values():
        for _ in range(20):
            fn()  # warm up the channels
    latencies: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.lookup_batches):
        for name, fn in ways.items():
            latencies[name].append(timed(fn))
    p50 = {name: _percentile(t, 50) for name, t in latencies.items()}
    row: dict[str, Any] = {
        "bench": "store.lookup",
        "transport": "unix socket",
        "batch": len(batch),
        "batches": args.lookup_batches,
        "p50_ms": round(p50["chunkstore"] * 1e3, 3),
        "p99_ms": round(_percentile(latencies["chunkstore"], 99) * 1e3, 3),
        "lookups_per_s": round(len(batch) / statistics.mean(latencies["chunkstore"])),
    }
    for name in ways.keys() - {"chunkstore"}:
        row[f"{name}_p50_ms"] = round(p50[name] * 1e3, 3)
    if peer is not None:
        row["lookup_vs_mooncake"] = round(p50["chunkstore"] / p50["mooncake"], 3)
    return row


def _rounds(
    ways: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None
) -> dict[str, list[float]]:
    """Each way timed once per round, in the same rounds; ``before`` runs untimed first, then
    a pause of ``SETTLE_S``, so no way pays for what the one before left running: torch's
    OpenMP threads spin on after a copy and took ~5 ms from the shm read that came next
    (2 cores), a daemon or Redis may still be freeing what ``before`` dropped."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            if before is not None:
                before()
            time.sleep(SETTLE_S)
            times[name].append(timed(fn))
    return times


def _leased_read(client: ChunkStoreClient, key: bytes, out: torch.Tensor) -> Callable[[], None]:
    """A get of ``key`` into ``out`` through ``client``: acquire, read (checked), release."""

    def read() -> None:
        [entry] = client.acquire([key])
        assert entry is not None
        try:
            client.read_into(entry, out)
        finally:
            client.release([entry.lease_id], wait=False)

    return read


def _read_paths(
    shm: ChunkStoreClient,
    stream: ChunkStoreClient,
    r: redis.Redis,
    key: bytes,
    out: torch.Tensor,
    source: torch.Tensor,
) -> dict[str, Callable[[], object]]:
    """Each way the chunk's bytes reach ``out``: a plain copy (the floor), the pool mapped
    here, Redis, the gRPC stream."""

    def memcpy() -> None:
        out.copy_(source)

    def redis_get() -> None:
        data = r.get(key)
        assert isinstance(data, bytes)
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)

    return {
        "memcpy": memcpy,
        "shm": _leased_read(shm, key, out),
        "redis": redis_get,
        "grpc": _leased_read(stream, key, out),
    }


def _reads(
    args: argparse.Namespace,
    shm: ChunkStoreClient,
    stream: ChunkStoreClient,
    r: redis.Redis,
    peer: MooncakeStore | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    source: torch.Tensor,
) -> dict[str, Any]:
    key = b"bench-read-key-0"
    nbytes = source.shape[0]
    shm.put(key, keys, values, 0)
    out = torch.empty(nbytes, dtype=torch.uint8)
    r.set(key, as_bytes(source).tobytes())

    paths = _read_paths(shm, stream, r, key, out, source)
    for fn in paths.values():
        fn()  # warm up; every path must produce the same bytes
        assert torch.equal(out, source), "a read path returned different bytes"
        out.zero_()
    if peer is not None:
        peer.buffer[:nbytes] = source.numpy()
        peer.put("bench-read", 0, nbytes)
        peer.buffer[:nbytes] = 0
        paths["mooncake"] = lambda: peer.get("bench-read", 0, nbytes)
        paths["mooncake"]()
        assert np.array_equal(peer.buffer[:nbytes], source.numpy()), "mooncake's bytes differ"
    times = _rounds(paths, args.repeats)
    p50 = {name: statistics.median(t) for name, t in times.items()}
    row = {
        "bench": "store.read",
        "tokens": args.tokens,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "bytes": nbytes,
        "block_size": args.block_size,
        "repeats": args.repeats,
        **{f"{name}_ms_p50": round(t * 1e3, 2) for name, t in p50.items()},
        **{f"{name}_gb_s": round(nbytes / t / 1e9, 2) for name, t in p50.items()},
        "shm_vs_memcpy": _ratio(times["memcpy"], times["shm"]),
        "shm_vs_redis": _ratio(times["redis"], times["shm"]),
        "shm_vs_grpc": _ratio(times["grpc"], times["shm"]),
    }
    if peer is not None:
        row["get_vs_mooncake"] = _ratio(times["shm"], times["mooncake"])
    return row


def _puts(
    args: argparse.Namespace,
    client: ChunkStoreClient,
    r: redis.Redis | None,
    peer: MooncakeStore | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    source: torch.Tensor,
) -> dict[str, Any]:
    """One put of the chunk per way and round, each into a key emptied before (untimed)."""
    key, nbytes = b"bench-put-key-00", source.shape[0]
    ways: dict[str, Callable[[], object]] = {"shm": lambda: client.put(key, keys, values, 0)}
    payload = as_bytes(source).tobytes() if r is not None else b""
    if r is not None:
        ways["redis"] = lambda: r.set(key, payload)
    if peer is not None:
        peer.buffer[:nbytes] = source.numpy()
        ways["mooncake"] = lambda: peer.put("bench-put", 0, nbytes)

    def empty() -> None:
        client.evict([key])
        if r is not None:
            r.delete(key)
        if peer is not None:
            peer.remove("bench-put")

    for fn in ways.values():
        empty()
        fn()  # warm up
    empty()
    ways["shm"]()
    stored = client.get(key)
    assert stored is not None and torch.equal(stored.keys, keys), "put stored other bytes"
    times = _rounds(ways, args.repeats, before=empty)
    p50 = {name: statistics.median(t) for name, t in times.items()}
    row = {
        "bench": "store.put",
        "bytes": nbytes,
        "repeats": args.repeats,
        **{f"{name}_ms_p50": round(t * 1e3, 2) for name, t in p50.items()},
        **{f"{name}_gb_s": round(nbytes / t / 1e9, 2) for name, t in p50.items()},
    }
    if peer is not None:
        row["put_vs_mooncake"] = _ratio(times["shm"], times["mooncake"])
    return row


def _small_gets(
    args: argparse.Namespace,
    client: ChunkStoreClient,
    peer: MooncakeStore | None,
    small_bytes: int,
) -> dict[str, Any]:
    keys = [(2 * 10**6 + i).to_bytes(16, "little") for i in range(SMALL)]
    names = [f"bench-small-{i}" for i in range(SMALL)]
    outs = [torch.empty(small_bytes, dtype=torch.uint8) for _ in keys]
    _store_small(client, peer, keys, names, small_bytes)
    ways = _small_ways(client, peer, keys, names, outs, small_bytes)
    for fn in ways.values():
        fn()  # warm up
    times = _rounds(ways, args.repeats)
    p50 = {name: statistics.median(t) for name, t in times.items()}
    row = {
        "bench": "store.small_get",
        "entries": SMALL,
        "entry_bytes": small_bytes,
        "repeats": args.repeats,
        **{f"{name}_ms_p50": round(t * 1e3, 2) for name, t in p50.items()},
    }
    if peer is not None:
        row["small_get_vs_mooncake"] = _ratio(times["batch"], times["mooncake_batch"])
        row["small_get_one_at_a_time_vs_mooncake"] = _ratio(
            times["one_at_a_time"], times["mooncake_one_at_a_time"]
        )
    return row


def _store_small(
    client: ChunkStoreClient,
    peer: MooncakeStore | None,
    keys: list[bytes],
    names: list[str],
    small_bytes: int,
) -> None:
    """Seeded small entries of ``small_bytes`` each, put in the daemon and the peer store."""
    tokens = small_bytes // (2 * 4 * 64)
    generator = torch.Generator().manual_seed(1)
    for i, key in enumerate(keys):
        kv = torch.randn(1, tokens, 1, 64, generator=generator)
        client.put(key, kv, kv, 0)
        if peer is not None:
            both = torch.cat([kv.reshape(-1), kv.reshape(-1)]).view(torch.uint8).numpy()
            peer.buffer[i * small_bytes : (i + 1) * small_bytes] = both
            peer.put(names[i], i * small_bytes, small_bytes)


def _small_ways(
    client: ChunkStoreClient,
    peer: MooncakeStore | None,
    keys: list[bytes],
    names: list[str],
    outs: list[torch.Tensor],
    small_bytes: int,
) -> dict[str, Callable[[], object]]:
    """The small entries got one call each, or all in one Acquire and one read; and the
    peer store's one at a time and batched."""

    def one_at_a_time() -> None:
        for key, out in zip(keys, outs, strict=True):
            [entry] = client.acquire([key])
            assert entry is not None
            try:
                client.read_into(entry, out)
            finally:
                client.release([entry.lease_id], wait=False)

    def per_call() -> None:
        entries = client.acquire(keys)
        try:
            assert all(entries)
            client.read_many(entries, outs)  # type: ignore[arg-type]
        finally:
            client.release([e.lease_id for e in entries if e is not None], wait=False)

    ways: dict[str, Callable[[], object]] = {"one_at_a_time": one_at_a_time, "batch": per_call}
    if peer is not None:
        offsets = [i * small_bytes for i in range(SMALL)]

        def mooncake_one_at_a_time() -> None:
            for name, offset in zip(names, offsets, strict=True):
                peer.get(name, offset, small_bytes)

        ways["mooncake_one_at_a_time"] = mooncake_one_at_a_time
        ways["mooncake_batch"] = lambda: peer.batch_get(names, offsets, small_bytes)
    return ways


def _readers(daemon: RunningDaemon, args: argparse.Namespace, nbytes: int) -> dict[str, Any]:
    counts = [int(n) for n in args.readers.split(",")]
    mib = max(1, nbytes >> 20)
    return {
        "bench": "store.readers",
        "entry_mib": mib,
        "seconds": args.reader_seconds,
        **{
            f"readers_{n}_gb_s": round(read_bandwidth(daemon, n, mib, args.reader_seconds), 2)
            for n in counts
        },
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chunk_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
    parser.add_argument("--batch", type=int, default=64, help="keys per lookup")
    parser.add_argument("--lookup-batches", type=int, default=2000, help="lookups timed")
    parser.add_argument(
        "--small-bytes", type=int, default=1 << 20, help="size of the 64 small entries (1 MiB)"
    )
    parser.add_argument(
        "--readers", default="", help="reader process counts for aggregate bandwidth, e.g. 1,2,4"
    )
    parser.add_argument("--reader-seconds", type=float, default=3.0, help="seconds per count")
    parser.add_argument(
        "--tier",
        choices=["memory", "disk"],
        default="memory",
        help="memory (default): the pool, against memcpy, Redis and (--peers) Mooncake; disk: "
        "the disk tier's spill and disk hit against dd with O_DIRECT on the same file system "
        "(bench/disk.py)",
    )
    parser.add_argument(
        "--disk-dir",
        default="/var/tmp",
        help="with --tier disk: where the tier's files and dd's go (default /var/tmp; a tmpfs "
        "measures memory, not a disk)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also run Mooncake Store (daemon mode; the mooncake extra) and Redis through "
        "the same steps, and report chunkstore's time over Mooncake's",
    )
