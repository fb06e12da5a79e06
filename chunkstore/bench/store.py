"""``chunkstore bench store``: the daemon's lookup latency and read paths, side by side.

It starts a real daemon (and a real redis-server) on loopback and reports:
- lookup: batches of 64 keys (half present) over the unix socket: p50 / p99 latency and keys
  looked up per second;
- read of one chunk in SmolLM2's KV shape (default 4096 tokens, fp32) into a tensor, each
  round: a plain memcpy of the same bytes (torch copy_), the shared-memory path (acquire, copy
  out of the pool, verify the xxh3 checksum, release), a GET of the same bytes from Redis as a
  Redis-backed KV cache would do it, and the gRPC stream (for the record). Ratios are medians
  of per-round ratios: ``shm_vs_memcpy`` = memcpy time / shm time (bandwidth ratio),
  ``shm_vs_redis`` = Redis time / shm time (speed-up).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

from chunkstore.bench.timing import timed
from chunkstore.client import ChunkStoreClient, as_bytes
from chunkstore.testing.daemon import start_daemon
from chunkstore.testing.redis import RedisServer


def _ratio(numerator: list[float], denominator: list[float]) -> float:
    return round(statistics.median(n / d for n, d in zip(numerator, denominator, strict=True)), 3)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    shape = (args.layers, args.tokens, args.kv_heads, args.head_dim)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    nbytes = 2 * keys.numel() * keys.element_size()
    pool_bytes = max(4 * nbytes, 256 << 20)
    with tempfile.TemporaryDirectory(prefix="chunkstore-bench-") as tmp:
        daemon = start_daemon(
            Path(tmp) / "daemon", pool_bytes=pool_bytes, block_size=args.block_size
        )
        try:
            with (
                RedisServer(Path(tmp) / "redis") as server,
                ChunkStoreClient(daemon.unix, transport="shm") as shm,
                ChunkStoreClient(daemon.unix, transport="stream") as stream,
            ):
                yield _lookups(shm, args)
                yield _reads(args, shm, stream, server, keys, values, nbytes)
        finally:
            daemon.stop()


def _lookups(client: ChunkStoreClient, args: argparse.Namespace) -> dict[str, Any]:
    small = torch.zeros(1, 1, 1, 8)
    present = [i.to_bytes(16, "little") for i in range(args.batch // 2)]
    for key in present:
        client.put(key, small, small, 0)
    batch = present + [(10**6 + i).to_bytes(16, "little") for i in range(args.batch // 2)]
    for _ in range(20):
        client.lookup(batch)  # warm up the channel
    latencies = []
    began = time.perf_counter()
    for _ in range(args.lookup_batches):
        latencies.append(timed(lambda: client.lookup(batch)))
    elapsed = time.perf_counter() - began
    return {
        "bench": "store.lookup",
        "transport": "unix socket",
        "batch": len(batch),
        "batches": args.lookup_batches,
        "p50_ms": round(_percentile(latencies, 50) * 1e3, 3),
        "p99_ms": round(_percentile(latencies, 99) * 1e3, 3),
        "lookups_per_s": round(len(batch) * args.lookup_batches / elapsed),
    }


def _reads(
    args: argparse.Namespace,
    shm: ChunkStoreClient,
    stream: ChunkStoreClient,
    server: RedisServer,
    keys: torch.Tensor,
    values: torch.Tensor,
    nbytes: int,
) -> dict[str, Any]:
    key = b"bench-read-key-0"
    shm.put(key, keys, values, 0)
    source = torch.cat([keys.reshape(-1).view(torch.uint8), values.reshape(-1).view(torch.uint8)])
    out = torch.empty(nbytes, dtype=torch.uint8)
    r = redis.Redis.from_url(server.url)
    r.set(key, as_bytes(source).tobytes())

    def memcpy() -> None:
        out.copy_(source)

    def via(client: ChunkStoreClient) -> Callable[[], None]:
        def read() -> None:
            [entry] = client.acquire([key])
            assert entry is not None
            try:
                client.read_into(entry, out)
            finally:
                client.release([entry.lease_id])

        return read

    def redis_get() -> None:
        data = r.get(key)
        assert isinstance(data, bytes)
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)

    paths = {"memcpy": memcpy, "shm": via(shm), "redis": redis_get, "grpc": via(stream)}
    for fn in paths.values():
        fn()  # warm up; every path must produce the same bytes
        assert torch.equal(out, source), "a read path returned different bytes"
        out.zero_()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            times[name].append(timed(fn))
    p50 = {name: statistics.median(t) for name, t in times.items()}
    return {
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="chunk length (default 4096)")
    parser.add_argument("--layers", type=int, default=30, help="layers (SmolLM2: 30)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (SmolLM2: 64)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--block-size", type=int, default=1 << 20, help="pool block size")
    parser.add_argument("--repeats", type=int, default=10, help="timed read rounds")
    parser.add_argument("--batch", type=int, default=64, help="keys per lookup")
    parser.add_argument("--lookup-batches", type=int, default=2000, help="lookups timed")
