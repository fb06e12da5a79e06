"""The daemons behind the instances, asked which keys they hold (Lookup only).

One client per daemon address, opened on first use and again after a failure; its calls run
on a worker thread, one at a time per daemon (the client is synchronous gRPC). A daemon that
cannot be reached answers None: the caller goes on without it (counted by the caller).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import ChunkStoreError

log = logging.getLogger("chunkstore.router")


class Stores:
    def __init__(self, token: str | None = None, timeout: float = 2.0) -> None:
        self.token = token
        self.timeout = timeout
        self._clients: dict[str, ChunkStoreClient] = {}
        self._locks: dict[str, threading.Lock] = {}

    async def lookup(self, address: str, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether ``address``'s daemon holds each key; None if it cannot be asked. A probe:
        not counted in the daemon's hit rate, the misses not fetched from peers (the
        instance's own request does both)."""
        if not keys:
            return []
        return await asyncio.to_thread(self._lookup, address, list(keys))

    def _lookup(self, address: str, keys: list[bytes]) -> list[bool] | None:
        lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            try:
                client = self._clients.get(address)
                if client is None:
                    client = ChunkStoreClient(
                        address, token=self.token, transport="stream", timeout=self.timeout
                    )
                    self._clients[address] = client
                found: list[bool] = []
                for start in range(0, len(keys), 4096):
                    found += [
                        n is not None for n in client.lookup(keys[start : start + 4096], probe=True)
                    ]
                return found
            except (ChunkStoreError, OSError) as err:
                log.warning("chunkstore router: daemon %s cannot be asked: %s", address, err)
                dropped = self._clients.pop(address, None)
                if dropped is not None:
                    dropped.close()
                return None

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
