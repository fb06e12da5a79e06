"""``chunkstore bench scale``: what the daemon costs as the store grows and readers multiply.

Real daemons on a unix socket, 4 KiB entries (one pool block each), and:
- at each size (default 1k / 10k / 100k entries): lookup p50 and p99 (64-key batches, half
  present), the put rate of the last puts that reached the size, a Stats call, a Prometheus
  scrape, lookup p99 while a thread scrapes without pause, and Clear;
- evicting puts into a full pool (watermarks at 1.0: each put evicts one entry) with none and
  with ``--pinned`` of the oldest entries pinned;
- aggregate bandwidth of 1 / 2 / 4 / 8 reader processes reading one 32 MiB entry over shared
  memory (acquire, copy out, verify the checksum, release), side by side in one run.

Ratios (``*_100k_vs_1k``: larger / smaller size; ``put_pinned_vs_none``: rate with pins / rate
without; ``read_Nx_vs_1x``: aggregate bandwidth of N readers / one) are what to compare: the
timings themselves are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chunkstore.bench.timing import timed
from chunkstore.client import ChunkStoreClient
from chunkstore.processes.daemon import RunningDaemon, start_daemon

ENTRY = 4096
SHAPE = (1, 8, 2, 32)  # layers, tokens, kv heads, head dim: 4 KiB of fp32 keys and values


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _label(entries: int) -> str:
    return f"{entries // 1000}k" if entries % 1000 == 0 else str(entries)


def _progress(message: str) -> None:
    print(f"bench scale: {message}", file=sys.stderr, flush=True)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _fill(client: ChunkStoreClient, start: int, stop: int) -> float:
    """Put entries ``start..stop``; returns puts per second over the last thousand."""
    kv = torch.zeros(SHAPE)
    tail = max(start, stop - 1000)
    began = time.perf_counter()
    for i in range(start, stop):
        if i == tail:
            began = time.perf_counter()
        if i % 10_000 == 0 and i > start:
            _progress(f"{i} entries")
        client.put(_key(i), kv, kv, 0)
    return (stop - tail) / (time.perf_counter() - began)


def _lookup_latencies(client: ChunkStoreClient, stored: int, rounds: int) -> list[float]:
    rng = np.random.default_rng(0)
    times = []
    for _ in range(rounds):
        present = [_key(int(i)) for i in rng.integers(0, stored, 32)]
        batch = present + [_key(10**9 + int(i)) for i in rng.integers(0, 10**6, 32)]
        times.append(timed(functools.partial(client.lookup, batch)))
    return times


def _scrape(url: str) -> None:
    with urllib.request.urlopen(url, timeout=30) as reply:
        reply.read()


def _at_size(daemon: RunningDaemon, size: int, rounds: int) -> dict[str, Any]:
    with ChunkStoreClient(daemon.unix) as client:
        _progress(f"filling to {size} entries")
        put_rate = _fill(client, 0, size)
        _lookup_latencies(client, size, 50)  # warm up
        lookups = _lookup_latencies(client, size, rounds)
        stats = [timed(client.stats) for _ in range(20)]
        scrapes = [timed(lambda: _scrape(daemon.metrics_url)) for _ in range(20)]
        stop = threading.Event()

        def scrape_on() -> None:
            while not stop.is_set():
                _scrape(daemon.metrics_url)

        scraper = threading.Thread(target=scrape_on, daemon=True)
        scraper.start()
        try:
            during = _lookup_latencies(client, size, rounds)
        finally:
            stop.set()
            scraper.join()
        began = time.perf_counter()
        reply = client.clear()
        clear = time.perf_counter() - began
        if reply.evicted != size:
            raise RuntimeError(f"Clear evicted {reply.evicted} of {size} entries")
    return {
        "entries": size,
        "lookup_p50_ms": _ms(statistics.median(lookups)),
        "lookup_p99_ms": _ms(float(np.percentile(lookups, 99))),
        "lookup_p99_during_scrapes_ms": _ms(float(np.percentile(during, 99))),
        "puts_per_s": round(put_rate),
        "stats_ms": _ms(statistics.median(stats)),
        "scrape_ms": _ms(statistics.median(scrapes)),
        "clear_ms": _ms(clear),
    }


def _evicting_puts(workdir: Path, capacity: int, pinned: int, puts: int) -> float:
    """Puts per second into a full pool of ``capacity`` entries whose oldest ``pinned`` are
    pinned: each put evicts the least recently used unpinned entry."""
    with start_daemon(
        workdir,
        "--high-watermark",
        "1.0",
        "--low-watermark",
        "1.0",
        pool_bytes=capacity * ENTRY,
        block_size=ENTRY,
    ) as daemon:
        with ChunkStoreClient(daemon.unix) as client:
            _fill(client, 0, capacity)
            for start in range(0, pinned, 4096):
                client.pin([_key(i) for i in range(start, min(start + 4096, pinned))])
            _progress(f"evicting puts with {pinned} pinned")
            rate = _fill(client, capacity, capacity + puts)
            if client.stats().evictions.get("capacity", 0) < min(puts, 1000):
                raise RuntimeError("the puts did not evict")
        return rate


def _reader(address: str, key: bytes, nbytes: int, seconds: float, start: Any, out: Any) -> None:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    with ChunkStoreClient(address) as client:
        start.wait()
        began, reads = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            [entry] = client.acquire([key])
            assert entry is not None
            try:
                client.read_into(entry, buffer)
            finally:
                client.release([entry.lease_id])
            reads += 1
        out.put((reads, time.perf_counter() - began))


def read_bandwidth(daemon: RunningDaemon, readers: int, mib: int, seconds: float) -> float:
    """Aggregate GB/s of ``readers`` processes reading one entry over and over."""
    nbytes = mib << 20  # keys and values
    key = _key(10**12 + mib)
    tokens = nbytes // (2 * 4 * 64)
    with ChunkStoreClient(daemon.unix) as client:
        if client.lookup([key]) == [None]:
            kv = torch.randn(1, tokens, 1, 64)
            client.put(key, kv, kv, 0)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(readers + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_reader, args=(daemon.unix, key, nbytes, seconds, start, out))
        for _ in range(readers)
    ]
    for p in procs:
        p.start()
    start.wait()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    return sum(reads * nbytes / elapsed for reads, elapsed in results) / 1e9


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="chunkstore-bench-") as tmp:
        rows = []
        with start_daemon(
            Path(tmp) / "sizes", pool_bytes=max(sizes) * 5 // 4 * ENTRY, block_size=ENTRY
        ) as daemon:
            for size in sizes:
                row = {"bench": "scale.size", **_at_size(daemon, size, args.lookups)}
                rows.append(row)
                yield row
        small, large = rows[0], rows[-1]
        ratio = f"{_label(large['entries'])}_vs_{_label(small['entries'])}"
        yield {
            "bench": "scale.size_ratios",
            f"lookup_{ratio}": round(large["lookup_p50_ms"] / small["lookup_p50_ms"], 3),
            f"scrape_{ratio}": round(large["scrape_ms"] / small["scrape_ms"], 3),
            f"stats_{ratio}": round(large["stats_ms"] / small["stats_ms"], 3),
            f"puts_{ratio}": round(large["puts_per_s"] / small["puts_per_s"], 3),
        }
        capacity = args.pinned + 2 * args.evicting_puts
        none = _evicting_puts(Path(tmp) / "unpinned", capacity, 0, args.evicting_puts)
        pinned = _evicting_puts(Path(tmp) / "pinned", capacity, args.pinned, args.evicting_puts)
        yield {
            "bench": "scale.evicting_puts",
            "pinned": args.pinned,
            "puts_per_s_none_pinned": round(none),
            "puts_per_s_pinned": round(pinned),
            "put_pinned_vs_none": round(pinned / none, 3),
        }
        readers = [int(r) for r in args.readers.split(",")]
        with start_daemon(
            Path(tmp) / "readers", pool_bytes=(args.entry_mib + 4) << 20, block_size=1 << 20
        ) as daemon:
            gb_s = {}
            for n in readers:
                _progress(f"{n} reader(s)")
                gb_s[n] = read_bandwidth(daemon, n, args.entry_mib, args.read_seconds)
        yield {
            "bench": "scale.readers",
            "entry_mib": args.entry_mib,
            **{f"read_gb_s_{n}x": round(g, 2) for n, g in gb_s.items()},
            **{f"read_{n}x_vs_1x": round(g / gb_s[readers[0]], 3) for n, g in gb_s.items()},
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", default="1000,10000,100000", help="entry counts, comma-separated"
    )
    parser.add_argument("--lookups", type=int, default=1000, help="lookups timed per size")
    parser.add_argument("--pinned", type=int, default=10_000, help="entries pinned")
    parser.add_argument("--evicting-puts", type=int, default=2000, help="evicting puts timed")
    parser.add_argument("--readers", default="1,2,4,8", help="reader processes, comma-separated")
    parser.add_argument("--entry-mib", type=int, default=32, help="size of the entry read")
    parser.add_argument("--read-seconds", type=float, default=3.0, help="seconds per reader run")
