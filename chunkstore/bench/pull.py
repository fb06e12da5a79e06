"""``chunkstore bench pull``: one entry pulled from a peer daemon over Mooncake's Transfer
Engine against the same entry over the peer's gRPC stream, in one run.

A real owner daemon (``--transfer-engine mooncake``, a real redis-server for its directory)
holds one chunk in SmolLM2's KV shape (default 4096 tokens, fp32: 189 MB). This process pulls
it as a daemon's directory does (``peers.EnginePeers`` / ``peers.StreamPeers`` into an index
and pool of its own): lease over gRPC, move the bytes, commit against the owner's checksum
(verified), release. Each round pulls it both ways, in alternating order, into an emptied
pool. ``pull_engine_vs_stream`` is the median of per-round engine / stream times (below 1:
the engine is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkstore.bench.chunk import add_chunk_arguments, chunk_kv
from chunkstore.bench.timing import timed
from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.index import Index
from chunkstore.daemon.peers import EnginePeers, PeerSource, StreamPeers
from chunkstore.daemon.pool import SharedMemoryPool
from chunkstore.daemon.transfer import MooncakeEngine
from chunkstore.processes.daemon import start_daemon
from chunkstore.processes.redis import RedisServer

KEY = b"bench-pull-key-0"


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    keys, values, nbytes = chunk_kv(args)
    blocks = -(-nbytes // args.block_size)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chunkstore-bench-")))
        server = stack.enter_context(RedisServer(tmp / "redis"))
        owner = start_daemon(
            tmp / "owner",
            *("--redis", server.url, "--transfer-engine", "mooncake"),
            *("--transfer-protocol", args.protocol),
            pool_bytes=2 * blocks * args.block_size,
            block_size=args.block_size,
        )
        stack.callback(owner.stop)
        with ChunkStoreClient(owner.unix) as client:
            assert client.put(KEY, keys, values, 0)
        pool = SharedMemoryPool(args.block_size, blocks + 1)
        stack.callback(pool.close)
        engine = MooncakeEngine("127.0.0.1", args.protocol, "", pool.region())
        stack.callback(engine.close)
        fell_back: list[str] = []
        ways: dict[str, PeerSource] = {
            "engine": EnginePeers(engine, fell_back.append, None),
            "stream": StreamPeers(None),
        }
        for way in ways.values():
            stack.callback(way.close)
        yield _pulls(args, owner.tcp, Index(pool), ways, nbytes)
        if fell_back:
            raise RuntimeError(f"engine pulls fell back to the stream: {fell_back}")


def _pulls(
    args: argparse.Namespace, owner: str, index: Index, ways: dict[str, PeerSource], nbytes: int
) -> dict[str, Any]:
    def pull(way: PeerSource) -> None:
        index.clear()
        pulled = way.pull(owner, KEY, index)
        assert pulled is not None and pulled.stored and pulled.nbytes == nbytes

    for way in ways.values():
        pull(way)  # warm up: connections, sessions, the engine's first handshake
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(args.repeats):
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
        for name in order:
            times[name].append(timed(lambda: pull(ways[name])))  # noqa: B023
    p50 = {name: statistics.median(t) for name, t in times.items()}
    ratio = statistics.median(e / s for e, s in zip(times["engine"], times["stream"], strict=True))
    return {
        "bench": "pull",
        "protocol": args.protocol,
        "tokens": args.tokens,
        "dtype": args.dtype,
        "bytes": nbytes,
        "block_size": args.block_size,
        "repeats": args.repeats,
        **{f"pull_{name}_ms_p50": round(t * 1e3, 1) for name, t in p50.items()},
        **{f"pull_{name}_gb_s": round(nbytes / t / 1e9, 2) for name, t in p50.items()},
        "pull_engine_vs_stream": round(ratio, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chunk_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (both ways each)")
    parser.add_argument(
        "--protocol", default="tcp", help="the engine's protocol (default tcp; rdma, ascend)"
    )
