"""What tests store in a daemon, and how they wait on it: distinct entry keys, seeded random
KV tensors, an entry gone bad in the pool, and polling until a background effect (a lease
expiring, a pull landing) shows."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def entry_key(i: int) -> bytes:
    """A distinct 16-byte key for test entries."""
    return i.to_bytes(16, "little")


def random_kv(
    tokens: int, seed: int = 0, dtype: Any = None, heads: int = 3, head_dim: int = 64
) -> tuple[Any, Any]:
    """Seeded random keys and values [2 layers, tokens, heads, head_dim] (fp32 by default)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (2, tokens, heads, head_dim)
    keys, values = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return (keys.to(dtype), values.to(dtype)) if dtype is not None else (keys, values)


def corrupt_entry(daemon: Any, key: bytes) -> None:
    """Flip one byte (the eighth) of a stored entry in the pool itself, shared-memory or
    device (a daemon started by the tests' ``serve``): its next read fails its checksum."""
    from chunkstore.client import ChunkStoreClient
    from chunkstore.protocol.shm import map_shared_pool

    with ChunkStoreClient(daemon.unix) as client:
        [entry] = client.acquire([key])
        assert entry is not None, "no entry under that key"
        at = entry.blocks[0] * client.block_size + 7
        if client.device_pool is not None:
            client.device_pool[at] ^= 0xFF
        else:
            region = map_shared_pool(daemon.ready["shm_path"], client.stats().bytes_capacity)
            region[at] ^= 0xFF
        client.release([entry.lease_id])


def wait_for(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
