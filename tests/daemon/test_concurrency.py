"""Several client processes at once: every byte read is what was written, nothing leaks."""

from __future__ import annotations

import subprocess
import sys

from chunkstore.client import ChunkStoreClient

WORKER = """
import random, sys, torch
from chunkstore.client import ChunkStoreClient
from chunkstore.errors import Exhausted

def content(i):
    g = torch.Generator().manual_seed(i)
    tokens = 8 + (i * 7) % 40
    return (torch.randn((2, tokens, 3, 64), generator=g),
            torch.randn((2, tokens, 3, 64), generator=g))

seed, address, transport = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = random.Random(seed)
reads = 0
with ChunkStoreClient(address, transport=transport) as c:
    for _ in range(80):
        i = rng.randrange(24)
        key = i.to_bytes(16, "little")
        op = rng.random()
        if op < 0.4:
            try:
                c.put(key, *content(i), virtual_start=i)
            except Exhausted:
                pass  # every block leased or reserved for a moment: fine, try later
        elif op < 0.8:
            got = c.get(key)  # checksum-verified by the client
            if got is not None:
                k, v = content(i)
                assert torch.equal(got.keys, k) and torch.equal(got.values, v), key
                assert got.layout.virtual_start == i
                reads += 1
        else:
            leases = [x for x in c.acquire([key, (i + 1).to_bytes(16, "little")]) if x]
            c.release([x.lease_id for x in leases])
print(reads)
"""


def test_concurrent_clients_read_exactly_what_was_written(serve) -> None:
    # A small pool: entries of 24 to 190 KiB in 64 KiB blocks, so eviction runs throughout.
    daemon = serve(pool_bytes=2 << 20, block_size=1 << 16)
    with ChunkStoreClient(daemon.unix) as client:
        start = client.stats()
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    str(seed),
                    daemon.unix if seed % 2 else daemon.tcp,
                    "shm" if seed % 2 else "stream",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(4)
        ]
        reads = 0
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err
            reads += int(out)
        assert reads > 0
        stats = client.stats()
        assert stats.evictions.get("capacity", 0) + stats.evictions.get("watermark", 0) > 0
        assert stats.active_leases == 0 and stats.active_reservations == 0
        client.clear()
        end = client.stats()
        assert end.blocks_free == start.blocks_free == end.blocks_total
        assert end.entries == 0 and end.bytes_used == 0
