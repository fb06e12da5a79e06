"""Chaos against one real daemon: 8 client processes put, get, hold and look up entries in a
pool far too small for them, over a disk tier too small for them as well (so entries spill,
come back from disk and are evicted from both), while they are SIGKILLed and SIGSTOPped
(past the lease TTL) at random. Every byte any of them reads is checked against what its key
must hold, and when the storm ends every lease, reservation, session, quarantined block and
spill has come back.

CHUNKSTORE_CHAOS_SECONDS sets how long it storms (60; ``make soak`` runs 1800 and reports the
daemon's RSS growth per 100k calls)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.testing.entries import entry_key, random_kv, wait_for

SECONDS = float(os.environ.get("CHUNKSTORE_CHAOS_SECONDS", "60"))
KEYS = 40
CLIENTS = 8

WORKER = """
import json, random, sys, time
import torch
from chunkstore.client import ChunkStoreClient
from chunkstore.errors import ChecksumMismatch, StoreError
from chunkstore.testing.entries import entry_key, random_kv

sys.path.insert(0, {tests!r})
from test_chaos import content

address, seed, until = {address!r}, {seed}, {until}
rng = random.Random(seed)
counts = dict(calls=0, verified=0, refused=0)
with ChunkStoreClient(address, transport=rng.choice(["shm", "stream"]), timeout=30) as c:
    while time.time() < until:
        i = rng.randrange({keys})
        op = rng.random()
        counts["calls"] += 1
        try:
            if op < 0.35:
                c.put(entry_key(i), *content(i), virtual_start=i)
            elif op < 0.75:
                got = c.get(entry_key(i))
                if got is not None:
                    k, v = content(i)
                    if not (torch.equal(got.keys, k) and torch.equal(got.values, v)):
                        print(json.dumps({{"wrong": i}}), flush=True)
                        sys.exit(3)
                    counts["verified"] += 1
            elif op < 0.9:
                leases = [x for x in c.acquire([entry_key(j) for j in range(i, i + 3)]) if x]
                time.sleep(rng.random() * 0.2)  # held a while: not evictable meanwhile
                c.release([x.lease_id for x in leases])
            else:
                c.lookup([entry_key(j) for j in range({keys})])
        except ChecksumMismatch as err:
            print(json.dumps({{"corrupt": i, "error": str(err)}}), flush=True)
            sys.exit(4)
        except StoreError:
            counts["refused"] += 1  # a full pool, a lease lost in a pause: fine, go on
print(json.dumps(counts), flush=True)
"""


def content(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What key ``i`` must hold: 1 to 6 blocks of 64 KiB, seeded by the key."""
    return random_kv(8 + (i % 6) * 40, seed=i)


def spawn(address: str, seed: int, until: float) -> subprocess.Popen[str]:
    script = WORKER.format(
        address=address, seed=seed, until=until, keys=KEYS, tests=str(Path(__file__).parent)
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def rpcs(daemon: RunningDaemon) -> float:
    """Calls the daemon has answered (every method, killed clients' too)."""
    counts = daemon.scrape().items()
    return sum(v for k, v in counts if k.startswith("chunkstore_rpc_seconds_count"))


def test_chaos_returns_only_right_bytes_and_every_resource(serve, tmp_path: Path) -> None:
    running = serve(
        "--lease-ttl-s",
        "1",
        "--disk-dir",
        str(tmp_path / "disk"),
        "--disk-size",
        "6M",  # two thirds of the 40 keys' 9 MiB
        pool_bytes=4 << 20,
        block_size=1 << 16,  # 64 blocks
    )
    rng = random.Random(0)
    until = time.time() + SECONDS
    workers = {n: spawn(running.unix, n, until) for n in range(CLIENTS)}
    finished: list[dict] = []
    kills = pauses = 0
    warm = time.time() + SECONDS / 4  # RSS growth is measured from here, past the start-up's
    rss_warm: tuple[float, int] | None = None  # (calls, RSS) then
    seed = CLIENTS
    while time.time() < until - 3:
        if rss_warm is None and time.time() >= warm:
            rss_warm = (rpcs(running), running.rss_kib())
        time.sleep(rng.uniform(0.2, 1.0))
        n = rng.randrange(CLIENTS)
        victim = workers[n]
        if victim.poll() is not None:
            continue
        if rng.random() < 0.4:
            victim.kill()  # mid-put, mid-read, holding leases: whatever it was doing
            victim.wait()
            kills += 1
            workers[n] = spawn(running.unix, seed, until)
            seed += 1
        else:
            victim.send_signal(signal.SIGSTOP)  # often past the 1 s TTL
            time.sleep(rng.uniform(0.3, 2.5))
            victim.send_signal(signal.SIGCONT)
            pauses += 1
    for worker in workers.values():
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, f"a worker failed ({worker.returncode}): {out} {err[-3000:]}"
        finished.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(f["verified"] for f in finished) > 0 and kills and pauses

    with ChunkStoreClient(running.unix) as checker:

        def settled() -> bool:
            s = checker.stats()
            held = (s.active_leases, s.active_reservations, s.blocks_quarantined, s.sessions)
            spilling = s.disk.spill_queue_bytes + s.disk.spills_writing
            return held == (0, 0, 0, 1) and not spilling  # 1: the checker's own session

        wait_for(settled, timeout=30)
        for i in range(KEYS):
            # Looked up and read at once: reading a disk entry back evicts memory ones, and
            # one the disk lacks (its spill dropped: the queue was full) is then gone.
            if checker.lookup([entry_key(i)])[0] is None:
                continue
            got = checker.get(entry_key(i))  # from memory, or read back from disk
            assert got is not None, i
            k, v = content(i)
            assert torch.equal(got.keys, k) and torch.equal(got.values, v), i
        stats = checker.stats()
        assert stats.evictions["capacity"] + stats.evictions["watermark"] > 0  # overfilled
        assert stats.disk.counts["promotions"] > 0 and stats.disk.counts["evictions"] > 0
        assert stats.disk.counts.get("errors_read", 0) == 0  # no file read back wrong
        # Nothing leased, reserved or spilling: clearing empties both tiers, and every
        # block is free again (none lost or leaked in the storm).
        checker.clear()
        stats = checker.stats()
        assert (stats.entries, stats.disk.entries, stats.disk.bytes_used) == (0, 0, 0)
        assert stats.blocks_free == stats.blocks_total
    assert rss_warm is not None
    calls = rpcs(running)
    growth = running.rss_kib() - rss_warm[1]
    print(
        f"chaos: {SECONDS:.0f} s, {calls:.0f} calls, {kills} kills, {pauses} pauses; daemon "
        f"RSS {growth:+d} KiB over the last three quarters "
        f"({growth * 100_000 / max(calls - rss_warm[0], 1):+.0f} KiB per 100k calls)"
    )
