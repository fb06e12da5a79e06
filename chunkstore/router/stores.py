"""The daemons behind the instances, asked which keys they hold (Lookup only).

One client per daemon address, opened on first use and again after a failure; its calls run
on a worker thread, one at a time per daemon (the client is synchronous gRPC). A daemon that
cannot be reached answers None: the caller goes on without it (counted by the caller). One
that failed (refused, or hung past ``timeout``) is not asked again for ``retry_after``
seconds: the lookups queued behind the failed one, and those after, answer None at once
(``Skipped``) instead of each waiting out its own timeout in turn.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from enum import Enum

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import ChunkStoreError
from chunkstore.kv.keyspace import Plan

from .metrics import RouterMetrics

log = logging.getLogger("chunkstore.router")


class Unasked(Enum):
    FAILED = "daemon_unreachable"  # asked, and it failed
    SKIPPED = "daemon_skipped"  # not asked: it failed within retry_after


class Stores:
    def __init__(
        self, token: str | None = None, timeout: float = 2.0, retry_after: float = 5.0
    ) -> None:
        self.token = token
        self.timeout = timeout
        self.retry_after = retry_after
        self._clients: dict[str, ChunkStoreClient] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._failed_at: dict[str, float] = {}

    async def lookup(self, address: str, keys: Sequence[bytes]) -> list[bool] | Unasked:
        """Whether ``address``'s daemon holds each key, or why it was not answered. A probe:
        not counted in the daemon's hit rate, the misses not fetched from peers (the
        instance's own request does both)."""
        if not keys:
            return []
        if self._resting(address):
            return Unasked.SKIPPED
        return await asyncio.to_thread(self._lookup, address, list(keys))

    async def held(
        self, daemons: list[str], plans: list[Plan], metrics: RouterMetrics
    ) -> tuple[dict[str, int], dict[str, list[list[bool]]]]:
        """Per daemon: the request's tokens it holds, and which pieces (a daemon that cannot
        be asked is absent from both, counted in ``fallbacks``)."""
        keys = [p.key for plan in plans for p in plan.pieces]
        if not keys:
            return {}, {}
        answers = await asyncio.gather(*(self.lookup(d, keys) for d in daemons))
        stored: dict[str, int] = {}
        present: dict[str, list[list[bool]]] = {}
        for daemon, found in zip(daemons, answers, strict=True):
            if isinstance(found, Unasked):
                metrics.fallbacks.labels(found.value).inc()
                continue
            flags = iter(found)
            present[daemon] = [[next(flags) for _ in plan.pieces] for plan in plans]
            pieces = [p for plan in plans for p in plan.pieces]
            stored[daemon] = sum(p.tokens for p, f in zip(pieces, found, strict=True) if f)
        return stored, present

    def _resting(self, address: str) -> bool:
        failed = self._failed_at.get(address)
        return failed is not None and time.monotonic() - failed < self.retry_after

    def _lookup(self, address: str, keys: list[bytes]) -> list[bool] | Unasked:
        lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            if self._resting(address):  # the lookup this one queued behind failed
                return Unasked.SKIPPED
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
                self._failed_at.pop(address, None)
                return found
            except (ChunkStoreError, OSError) as err:
                log.warning(
                    "chunkstore router: daemon %s cannot be asked (not again for %g s): %s",
                    address,
                    self.retry_after,
                    err,
                )
                self._failed_at[address] = time.monotonic()
                dropped = self._clients.pop(address, None)
                if dropped is not None:
                    dropped.close()
                return Unasked.FAILED

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
