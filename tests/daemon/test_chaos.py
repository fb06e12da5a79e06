"""Chaos against one real daemon: 8 client processes put, get, hold and look up entries in a
pool far too small for them, over a disk tier too small for them as well (so entries spill,
come back from disk and are evicted from both), while they are SIGKILLed and SIGSTOPped
(past the lease TTL) at random. They are three tenants: the shared namespace, alice (under a
quota) and bob (with a reserved share), each storing different bytes under the same keys.
Every byte any of them reads is checked against what its key must hold for its tenant;
alice never holds more than her quota; when the storm ends every lease, reservation,
session, quarantined block and spill has come back, the tenants' figures add up to the
pool's, and bob's reserved share still holds against a flood.

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
from chunkstore.daemon.tenants import hash_token
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.testing.entries import entry_key, random_kv, wait_for

SECONDS = float(os.environ.get("CHUNKSTORE_CHAOS_SECONDS", "60"))
KEYS = 40
CLIENTS = 8

WORKER = """
import json, random, sys, time
import torch
from chunkstore.client import ChunkStoreClient
from chunkstore.errors import ChecksumMismatch, LeaseLapsed, StoreError
from chunkstore.testing.entries import entry_key, random_kv

sys.path.insert(0, {tests!r})
from test_chaos import TOKENS, content, readable

address, seed, until, tenant = {address!r}, {seed}, {until}, {tenant!r}
rng = random.Random(seed)
counts = dict(calls=0, verified=0, refused=0, lapsed=0)
token = TOKENS[tenant]
transport = rng.choice(["shm", "stream"])
with ChunkStoreClient(address, transport=transport, timeout=30, token=token) as c:
    while time.time() < until:
        i = rng.randrange({keys})
        op = rng.random()
        counts["calls"] += 1
        try:
            if op < 0.35:
                c.put(entry_key(i), *content(i, tenant), virtual_start=i)
            elif op < 0.75:
                got = c.get(entry_key(i))
                if got is not None:
                    if not any(
                        torch.equal(got.keys, k) and torch.equal(got.values, v)
                        for k, v in readable(i, tenant)
                    ):
                        print(json.dumps({{"wrong": i}}), flush=True)
                        sys.exit(3)
                    counts["verified"] += 1
            elif op < 0.9:
                leases = [x for x in c.acquire([entry_key(j) for j in range(i, i + 3)]) if x]
                time.sleep(rng.random() * 0.2)  # held a while: not evictable meanwhile
                c.release([x.lease_id for x in leases])
            else:
                c.lookup([entry_key(j) for j in range({keys})])
        except LeaseLapsed:
            counts["lapsed"] += 1  # paused between its lease and its copy: bytes refused
        except ChecksumMismatch as err:
            print(json.dumps({{"corrupt": i, "error": str(err)}}), flush=True)
            sys.exit(4)
        except StoreError:
            counts["refused"] += 1  # a full pool, a lease lost in a pause: fine, go on
print(json.dumps(counts), flush=True)
"""


TENANTS = ("", "alice", "bob")  # "": the shared namespace
TOKENS = {"": "shared-secret", "alice": "alice-secret", "bob": "bob-secret"}
ADMIN = "admin-secret"
QUOTA, RESERVED = 24 << 16, 16 << 16  # alice's 24 blocks, bob's 16, of the pool's 64


def content(i: int, tenant: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """What key ``i`` must hold for ``tenant``: 1 to 6 blocks of 64 KiB, seeded by both."""
    return random_kv(8 + (i % 6) * 40, seed=i + 1000 * TENANTS.index(tenant))


def readable(i: int, tenant: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What ``tenant`` may read under key ``i``: its own, and bob reads the shared namespace
    (alice does not)."""
    return [content(i, tenant)] + ([content(i, "")] if tenant == "bob" else [])


def tenants_file(path: Path) -> Path:
    alice, bob = hash_token(TOKENS["alice"]), hash_token(TOKENS["bob"])
    path.write_text(
        f'[tenants.alice]\ntoken_sha256 = "{alice}"\nquota = {QUOTA}\nshared = false\n'
        f'[tenants.bob]\ntoken_sha256 = "{bob}"\nreserved = {RESERVED}\nshared = true\n'
    )
    return path


def spawn(address: str, seed: int, until: float) -> subprocess.Popen[str]:
    """A worker; its seed picks its tenant (seed % 3)."""
    script = WORKER.format(
        address=address,
        seed=seed,
        until=until,
        keys=KEYS,
        tests=str(Path(__file__).parent),
        tenant=TENANTS[seed % len(TENANTS)],
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
        "--token",
        TOKENS[""],
        "--admin-token",
        ADMIN,
        "--tenants",
        str(tenants_file(tmp_path / "tenants.toml")),
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
    seed = CLIENTS * len(TENANTS)  # a respawned worker's seed + n keeps worker n's tenant
    admin = ChunkStoreClient(running.unix, token=ADMIN)
    while time.time() < until - 3:
        if rss_warm is None and time.time() >= warm:
            rss_warm = (rpcs(running), running.rss_kib())
        time.sleep(rng.uniform(0.2, 1.0))
        assert admin.stats().tenants["alice"].held_bytes <= QUOTA  # at every moment looked
        n = rng.randrange(CLIENTS)
        victim = workers[n]
        if victim.poll() is not None:
            continue
        if rng.random() < 0.4:
            victim.kill()  # mid-put, mid-read, holding leases: whatever it was doing
            victim.wait()
            kills += 1
            workers[n] = spawn(running.unix, seed + n, until)  # the same tenant: n % 3
            seed += CLIENTS * len(TENANTS)
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

    admin.close()
    with ChunkStoreClient(running.unix, token=ADMIN) as checker:

        def settled() -> bool:
            s = checker.stats()
            held = (s.active_leases, s.active_reservations, s.blocks_quarantined, s.sessions)
            spilling = s.disk.spill_queue_bytes + s.disk.spills_writing
            return held == (0, 0, 0, 1) and not spilling  # 1: the checker's own session

        wait_for(settled, timeout=30)
        for tenant in TENANTS:
            with ChunkStoreClient(running.unix, token=TOKENS[tenant]) as reader:
                for i in range(KEYS):
                    # Looked up and read at once: reading a disk entry back evicts memory
                    # ones, and one the disk lacks (its spill dropped) is then gone.
                    if reader.lookup([entry_key(i)])[0] is None:
                        continue
                    got = reader.get(entry_key(i))  # from memory, or read back from disk
                    assert got is not None, (tenant, i)
                    assert any(
                        torch.equal(got.keys, k) and torch.equal(got.values, v)
                        for k, v in readable(i, tenant)
                    ), (tenant, i)
        wait_for(settled, timeout=30)
        stats = checker.stats()
        assert stats.evictions["capacity"] + stats.evictions["watermark"] > 0  # overfilled
        assert stats.evictions["quota"] > 0 and stats.tenants["alice"].held_bytes <= QUOTA
        tenants = stats.tenants.values()  # every held block and entry is some tenant's
        assert sum(t.held_bytes for t in tenants) == stats.bytes_used
        assert sum(t.entries for t in tenants) == stats.entries
        # Bob's reserved share, after all that: a flood of shared writes leaves him at least
        # what he held, up to his share.
        bob_before = stats.tenants["bob"].held_bytes
        with ChunkStoreClient(running.unix, token=TOKENS[""]) as flood:
            for i in range(KEYS, KEYS + 30):
                flood.put(entry_key(i), *content(i), virtual_start=0)
        bob_after = checker.stats().tenants["bob"].held_bytes
        assert bob_after >= min(bob_before, RESERVED), (bob_before, bob_after)
        assert bob_before > 0  # he had something to keep
        wait_for(settled, timeout=30)  # the flood's spills written
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
