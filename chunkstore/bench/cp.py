"""``chunkstore bench cp``: what a decode context-parallel rank reads of a stored entry (the
rows whose positions it owns, 1/dcp of the bytes, summed for the group's check) against
reading the whole entry and checking it (what every rank read before), over each transport,
in one run.

A real daemon holds one chunk (SmolLM2's KV shape, 1,024 tokens by default: 47 MB in fp32);
``--device fake`` (or cuda, npu) adds one with a device pool. Per transport and DCP size,
each round times rank 0's part (``ChunkStoreClient.read_runs``, the sums brought to the
host: what ``Loads`` waits for) and the whole entry (``read_into``, checked), in alternating
order; ``part_vs_whole`` is the median of their per-round ratios (below 1: the part is
faster). ``first_summed_ms``: a summed Acquire, the daemon's pass over the entry at each
summed lease (it adds up the keyed sums under the lease's fresh key and checks the xxh3).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from chunkstore.bench.chunk import add_chunk_arguments, chunk_kv
from chunkstore.bench.timing import timed
from chunkstore.client import ChunkStoreClient, LeasedEntry
from chunkstore.kv.paging import cp_owner
from chunkstore.processes.daemon import start_daemon

KEY = b"bench-cp-key-000"


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    keys, values, nbytes = chunk_kv(args)
    blocks = 2 * -(-nbytes // args.block_size)  # under the eviction watermark
    pools = {"shm": ()} | ({"ipc": ("--device", args.device)} if args.device else {})
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chunkstore-bench-")))
        for pool, flags in pools.items():
            daemon = start_daemon(
                tmp / pool, *flags, pool_bytes=blocks * args.block_size, block_size=args.block_size
            )
            stack.callback(daemon.stop)
            with ChunkStoreClient(daemon.unix) as client:
                assert client.put(KEY, keys, values, 0)
                began = time.perf_counter()
                [lease] = client.acquire([KEY], summed=True)
                first = time.perf_counter() - began
                assert lease is not None and lease.summed
                client.release([lease.lease_id])
            for transport in [pool] if pool == "ipc" else ["shm", "stream"]:
                wanted = "stream" if transport == "stream" else "auto"
                with ChunkStoreClient(daemon.unix, transport=wanted) as client:
                    assert client.transport == transport, client.transport
                    [lease] = client.acquire([KEY], summed=True)
                    assert lease is not None
                    for dcp in args.dcp:
                        row = _timed(args, client, lease, dcp)
                        yield {"bench": "cp", "transport": transport, **row} | (
                            {"first_summed_ms": round(first * 1e3, 1)} if transport != "ipc" else {}
                        )
                    client.release([lease.lease_id])


def _timed(
    args: argparse.Namespace, client: ChunkStoreClient, lease: LeasedEntry, dcp: int
) -> dict[str, Any]:
    """Rank 0's part of the entry against the whole, ``args.repeats`` rounds."""
    layout = lease.layout
    row = lease.nbytes // (2 * layout.num_layers * layout.num_tokens)
    owners = cp_owner(torch.arange(layout.num_tokens), dcp, args.interleave)
    rows = (owners == 0).nonzero().flatten()
    where = client.device_pool.device if client.device_pool is not None else torch.device("cpu")
    lines = torch.arange(2 * layout.num_layers, device=where)[:, None] * layout.num_tokens
    starts = ((lines + rows.to(where)[None, :]) * row).flatten()
    part = torch.empty(len(starts) * row, dtype=torch.uint8, device=where)
    whole = torch.empty(lease.nbytes, dtype=torch.uint8, device=where)

    def read_part() -> None:
        client.read_runs(lease, starts, row, part).tolist()  # the sums on the host: waited for

    def read_whole() -> None:
        client.read_into(lease, whole)

    read_part()  # warm: pages, threads, the device's first launch
    read_whole()
    times: dict[str, list[float]] = {"part": [], "whole": []}
    ways = {"part": read_part, "whole": read_whole}
    for round_ in range(args.repeats):
        for name in list(ways) if round_ % 2 == 0 else list(reversed(ways)):
            times[name].append(timed(ways[name]))
    p50 = {name: statistics.median(t) for name, t in times.items()}
    ratios = [p / w for p, w in zip(times["part"], times["whole"], strict=True)]
    return {
        "dcp": dcp,
        "interleave": args.interleave,
        "tokens": layout.num_tokens,
        "bytes": lease.nbytes,
        "part_bytes": part.numel(),
        "repeats": args.repeats,
        "part_ms_p50": round(p50["part"] * 1e3, 2),
        "whole_ms_p50": round(p50["whole"] * 1e3, 2),
        "part_vs_whole": round(statistics.median(ratios), 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chunk_arguments(parser, tokens=1024)
    parser.add_argument(
        "--dcp", type=int, nargs="+", default=[2, 4, 8], help="DCP sizes (default 2 4 8)"
    )
    parser.add_argument(
        "--interleave", type=int, default=1, help="cp_kv_cache_interleave_size (default 1)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds (both ways each)")
    parser.add_argument(
        "--device",
        default="",
        help="also a daemon with a device pool on this device (fake, cuda, npu); read over IPC",
    )
