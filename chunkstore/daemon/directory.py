"""The cluster directory (docs/daemon.md#cluster-directory-optional): which daemons hold which
chunks, in Redis, so
a node pulls a chunk another node computed instead of having vLLM compute it again.

Each stored key has a sorted set ``chunkstore:dir:<key hex>`` whose members are the gRPC
addresses of the daemons holding it, each scored by when its claim expires. Every daemon
republishes what it holds every ttl / 3 and withdraws what it no longer holds; a daemon that
dies stops renewing and its claims lapse. A lookup or acquire that misses locally queues the
missing keys; a background fetcher finds a peer in the directory, pulls the entry from it
(``peers.PeerSource``: the peer's gRPC stream or its transfer engine, checksum-verified) and
stores it here through the index, so the next request hits. Redis is optional, and when it
cannot be reached the daemon serves on alone (counted in ``chunkstore_directory_errors_total``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from chunkstore.daemon.index import Index
from chunkstore.daemon.peers import PeerSource
from chunkstore.daemon.workers import Workers
from chunkstore.errors import ChunkStoreError

log = logging.getLogger("chunkstore.daemon.directory")

PREFIX = "chunkstore:dir:"
QUEUE_LIMIT = 4096  # misses waiting for a fetch; more are dropped (and asked again later)


def directory_key(key: bytes) -> str:
    return PREFIX + key.hex()


class Directory:
    def __init__(
        self,
        url: str,
        advertise: str,
        peers: PeerSource,
        ttl_s: float,
        index: Index,
        metrics: Any,
    ) -> None:
        self.redis = redis.Redis.from_url(
            url, socket_timeout=1.0, socket_connect_timeout=1.0, decode_responses=True
        )
        self.advertise = advertise  # what peers dial to reach this daemon
        self.peers = peers
        self.ttl_s = ttl_s
        self.index = index
        self.metrics = metrics
        self._published: set[bytes] = set()
        # Keys missed here, with the tenant whose namespace each is in.
        self._wanted: queue.Queue[tuple[bytes, str]] = queue.Queue(QUEUE_LIMIT)
        self._queued: set[bytes] = set()
        self._lock = threading.Lock()
        self._down = False

    def start(self, workers: Workers) -> None:
        workers.start("publish", self._publish_step, interval=max(0.2, self.ttl_s / 3))
        workers.start("fetch", self._fetch_step)

    def stop(self) -> None:
        """After the workers stopped: withdraw every claim, close the connections."""
        with contextlib.suppress(redis.RedisError):
            self._withdraw(self._published)  # a clean stop withdraws at once
        self.redis.close()
        self.peers.close()

    # Publishing ------------------------------------------------------------------------

    def _publish_step(self) -> None:
        try:
            self.publish()
        except redis.RedisError as err:
            self._trouble(f"publishing to Redis failed: {err}")

    def publish(self) -> None:
        """Claim every entry held here for another ttl; withdraw the ones gone since."""
        held = self.index.held_keys()
        expires = time.time() + self.ttl_s
        pipe = self.redis.pipeline(transaction=False)
        for key in held:
            name = directory_key(key)
            pipe.zadd(name, {self.advertise: expires})
            pipe.zremrangebyscore(name, "-inf", time.time())  # lapsed claims of dead peers
            pipe.expire(name, int(self.ttl_s) + 1)
        pipe.execute()
        self._withdraw(self._published - held)
        self._published = held
        self._recovered()

    def _withdraw(self, keys: set[bytes]) -> None:
        if keys:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.zrem(directory_key(key), self.advertise)
            pipe.execute()

    def holders(self, key: bytes) -> list[str]:
        """Live peers that claim ``key`` (this daemon left out)."""
        members = self.redis.zrangebyscore(directory_key(key), time.time(), "+inf")
        return [str(m) for m in members if str(m) != self.advertise]

    # Fetching --------------------------------------------------------------------------

    def want(self, keys: Sequence[bytes], tenant: str = "") -> None:
        """Local misses of ``tenant``'s keys: pull them from a peer in the background if the
        directory knows one."""
        with self._lock:
            for key in keys:
                if key in self._queued:
                    continue
                try:
                    self._wanted.put_nowait((key, tenant))
                except queue.Full:
                    return
                self._queued.add(key)

    def _fetch_step(self) -> None:
        try:
            key, tenant = self._wanted.get(timeout=0.2)
        except queue.Empty:
            return
        result = "failed"  # unless it ends otherwise: an unexpected error is a failed fetch
        try:
            result = self._fetch(key, tenant)
        except (ChunkStoreError, redis.RedisError) as err:
            self._trouble(f"fetching {key.hex()[:12]} failed: {err}")
        finally:
            self.metrics.remote_fetches.labels(result).inc()
            with self._lock:
                self._queued.discard(key)

    def _fetch(self, key: bytes, tenant: str) -> str:
        """Pull one key from a peer that claims it: "ok", "present" (stored here meanwhile),
        "absent" (no live peer has it) or "failed" (peers had it but could not serve it)."""
        if self.index.lookup([key], tenant)[0] is not None:
            return "present"
        result = "absent"
        for peer in self.holders(key):
            try:
                pulled = self.peers.pull(peer, key, self.index, tenant)  # checksum-verified
            except ChunkStoreError as err:
                log.warning("pulling %s from %s failed: %s", key.hex()[:12], peer, err)
                result = "failed"
                self.peers.forget(peer)
                continue
            if pulled is None:
                continue  # evicted there since it last published
            if not pulled.stored:
                return "present"
            self.metrics.bytes.labels(pulled.transport, "write").inc(pulled.nbytes)
            return "ok"
        return result

    # Trouble ---------------------------------------------------------------------------

    def _trouble(self, reason: str) -> None:
        self.metrics.directory_errors.labels().inc()
        if not self._down:
            log.warning("%s; serving on alone until Redis answers", reason)
        self._down = True

    def _recovered(self) -> None:
        if self._down:
            log.warning("Redis answers again: the directory is back")
        self._down = False
