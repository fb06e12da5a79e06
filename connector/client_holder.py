"""One daemon client per process, reconnected after a failure no more often than configured.
Every failure is logged once per incident and counted; callers fall back to computing. A
session the daemon lost (it restarted, or this process was paused past the lease TTL) the
client reopens by itself; the link counts those in ``sessions_reopened``."""

from __future__ import annotations

import contextlib
import logging
import time

from chunkstore.client import ChunkStoreClient
from chunkstore.connector_config import ConnectorConfig
from chunkstore.errors import ChunkStoreError, StoreError, Unauthenticated, Unavailable

from .metrics import ConnectorStats

log = logging.getLogger("chunkstore.connector")


class DaemonLink:
    def __init__(self, config: ConnectorConfig, name: str, stats: ConnectorStats) -> None:
        self.config = config
        self.name = name
        self.stats = stats
        self._client: ChunkStoreClient | None = None
        self._reopened = 0  # the current client's sessions_reopened, counted already
        self._retry_at = 0.0
        self._down = False
        self.failures = 0
        self.pin_for = ""  # the worker's device type when its cache is on a GPU / NPU
        self.populate = False  # map the pool's pages ahead of reads (the worker: populate_pool)

    def get(self) -> ChunkStoreClient | None:
        """The client, or None while the daemon is unreachable (then: compute)."""
        if self._client is not None:
            reopened = self._client.sessions_reopened
            if reopened > self._reopened:
                self.stats.add("sessions_reopened", reopened - self._reopened)
                self._reopened = reopened
            return self._client
        if time.monotonic() < self._retry_at:
            return None
        try:
            self._client = ChunkStoreClient(
                self.config.daemon_address,
                token=self.config.token or None,
                transport=self.config.transport,
                name=self.name,
                timeout=self.config.timeout_s,
                copy_threads=1,  # the load threads read beside vLLM's forward: one core each
                pin_for=self.pin_for,
                populate=self.populate,
            )
        except ChunkStoreError as err:
            self.failed(f"cannot reach chunkstore at {self.config.daemon_address}: {err}")
            return None
        self._reopened = 0
        if self._down:
            log.warning(
                "%s: chunkstore at %s is reachable again", self.name, self.config.daemon_address
            )
        self._down = False
        return self._client

    def connect_early(self) -> None:
        """Connect now, at start-up, not in the first request: the session, the pool's map
        and its populating (a background thread, ~0.3 s of a core for an 800 MiB pool) then
        cost the first requests nothing. Unreachable: warned as any failure, and the first
        request tries again."""
        if self.get() is None:
            self._retry_at = 0.0

    def failed(self, reason: str) -> None:
        """Drop the client after a failure; warn once until it works again."""
        self.failures += 1
        if not self._down:
            log.warning(
                "%s: %s; computing instead (retry in %.0f s)",
                self.name,
                reason,
                self.config.reconnect_s,
            )
        self._down = True
        self._retry_at = time.monotonic() + self.config.reconnect_s
        if self._client is not None:
            with contextlib.suppress(Exception):  # closing a broken channel may fail any way
                self._client.close()
            self._client = None

    def trouble(self, reason: str, err: ChunkStoreError) -> None:
        """An operation failed. The daemon gone (or refusing us): drop the link as ``failed``
        does. An answer about one entry (checksum, full pool, evicted): warn, keep the link."""
        if isinstance(err, Unavailable | Unauthenticated) or type(err) is StoreError:
            self.failed(f"{reason}: {err}")
        else:
            log.warning("%s: %s: %s; computing instead", self.name, reason, err)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
