"""A summed lease vouches for an entry's bytes to context-parallel ranks that each read part
of it: its keyed sums (``keyed_digest``) under a fresh key, which only the lease's holder
sees, added up by the daemon as it grants the lease, in a pass that checks the bytes (the
shared-memory pool: against the committed xxh3; a device pool: against the daemon's own
seal, made at commit). Bytes changed in the pool so that every sum with public weights is
kept (``TensorDigest``'s, the summed checksum before keys) are refused, whenever they are
changed: before the first summed lease, while one is held, or after one was read clean.
Real daemons (the shared-memory pool, read mapped and over the stream; the fake device's
pool), two ranks' clients reading halves under the scheduler's lease."""

from __future__ import annotations

import pytest
import torch

from chunkstore.client import ChunkStoreClient, LeasedEntry
from chunkstore.device.device_ipc import TensorDigest
from chunkstore.errors import ChecksumMismatch, StoreError
from chunkstore.testing.entries import entry_key, random_kv

HEADS, DIM, TOKENS = 2, 64, 200
ROW = HEADS * DIM * 4  # a token's keys (or values) in one layer, float32


def forged(stored: torch.Tensor, forgery: str) -> torch.Tensor:
    """``stored`` changed so that its plain sum and its sum weighted by position modulo
    65521 stay: +1 at p and -1 at p + 65521 ("two bytes"); or +1, -1, -1, +1 at p, p + 1,
    q, q + 1 ("four bytes"), which keeps a sum weighted by position whatever its modulus."""
    data = stored.clone()
    if forgery == "two bytes":
        p = next(p for p in range(1000, len(data)) if data[p] < 255 and data[p + 65521] > 0)
        data[p] += 1
        data[p + 65521] -= 1
    else:
        p = next(p for p in range(1000, len(data)) if data[p] < 255 and data[p + 1] > 0)
        q = next(q for q in range(p + 5000, len(data)) if data[q] > 0 and data[q + 1] < 255)
        data[p] += 1
        data[p + 1] -= 1
        data[q] -= 1
        data[q + 1] += 1
    before, after = TensorDigest(), TensorDigest()
    before.update(stored)
    after.update(data)
    assert after.intdigest() == before.intdigest()  # what the old summed check passed
    return data


def write_into_pool(client: ChunkStoreClient, key: bytes, stored: torch.Tensor, new) -> None:
    """The bytes where ``new`` differs from ``stored`` written into the entry's blocks in
    the pool itself (shared memory or device), as a stray writer would."""
    [lease] = client.acquire([key])  # not summed: to learn the blocks
    assert lease is not None
    pool = client.device_pool if client.device_pool is not None else client.region
    assert pool is not None
    for at in (new != stored).nonzero().flatten().tolist():
        block, within = divmod(at, client.block_size)
        pool[lease.blocks[block] * client.block_size + within] = int(new[at])
    client.release([lease.lease_id])


def ranks_read_halves(address: str, transport: str, lease: LeasedEntry, session: str):
    """Two context-parallel ranks, a client each, reading every other row of the entry under
    the scheduler's lease (its key shared as the connector's metadata shares it); their
    keyed sums added up (the group's all-reduce) and checked: None where accepted."""
    rows = torch.arange(0, lease.nbytes, ROW)
    total = torch.zeros(2, dtype=torch.int64)
    verdict: StoreError | None = None
    for rank in range(2):
        with ChunkStoreClient(address, transport=transport) as reader:
            pool = reader.device_pool
            where = torch.device("cpu") if pool is None else pool.device
            starts = rows[rank::2].to(where)
            out = torch.empty(len(starts) * ROW, dtype=torch.uint8, device=where)
            total += reader.read_runs(lease, starts, ROW, out, session).cpu()
            if rank == 1:
                verdict = reader.check_sums(lease, total.tolist(), session)
    return verdict


@pytest.mark.parametrize("transport", ["shm", "stream", "ipc"])
def test_a_forgery_that_keeps_public_sums_is_refused_to_ranks_reading_halves(
    serve, transport: str
) -> None:
    flags = ("--device", "fake") if transport == "ipc" else ()
    daemon = serve(*flags, pool_bytes=32 << 20, block_size=1 << 16)
    wanted = "stream" if transport == "stream" else "auto"
    keys, values = random_kv(TOKENS, seed=50, heads=HEADS, head_dim=DIM)
    stored = torch.cat([t.flatten().view(torch.uint8) for t in (keys, values)])
    with ChunkStoreClient(daemon.unix) as client:  # the scheduler's, which acquires
        assert client.transport == ("shm" if transport == "stream" else transport)
        for n, forgery in enumerate(["two bytes", "four bytes"]):
            before, during, after = (entry_key(10 * n + i) for i in range(3))
            new = forged(stored, forgery)
            for key in (before, during, after):
                assert client.put(key, keys, values, 0)
            # Changed after commit, before any summed lease: the daemon's pass refuses it.
            write_into_pool(client, before, stored, new)
            assert client.acquire([before], summed=True) == [None], forgery
            # Changed while a summed lease is held: the ranks' keyed sums differ.
            [lease] = client.acquire([during], summed=True)
            assert lease is not None
            write_into_pool(client, during, stored, new)
            verdict = ranks_read_halves(daemon.unix, wanted, lease, client.session)
            assert isinstance(verdict, ChecksumMismatch), forgery
            client.release([lease.lease_id])
            assert client.acquire([during], summed=True) == [None]  # found so: evicted
            # Changed after a summed lease was read clean: nothing of it is kept for the next.
            [lease] = client.acquire([after], summed=True)
            assert lease is not None
            assert ranks_read_halves(daemon.unix, wanted, lease, client.session) is None
            client.release([lease.lease_id])
            write_into_pool(client, after, stored, new)
            assert client.acquire([after], summed=True) == [None], forgery
        assert client.stats().evictions["corrupt"] == 6
