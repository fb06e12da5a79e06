"""Cold chunks: a request's missing chunks sent to its instance as their own prefill
requests (``plan.Piece.alone``, one output token each), all in flight together, before the
request itself.

Single flight: a chunk already being sent to the same daemon's instance by another request
is waited for, not sent again. Only callers the instance admitted open or join a flight
(``access.Gate``), for a model it serves, so no caller's request is made to fail by an
unauthenticated one holding its chunks' flights open. After a warm-up the daemon is asked
again: a chunk sent and not stored (the router's settings differ from the connector's, the
pool is full, the save failed) is counted and reported, and the request computes it itself,
as it would have without the router. Nothing is ever served that the connector did not
store.

Held until read: each prompt asks the connector (``kv_transfer_params`` ``hold_s``) to commit
what it stores with a hold, so the daemon does not evict it before the request it was sent
for loads it (the first read ends the hold; at most ``HOLD_S``, or the daemon's lease TTL).
Without it the worth policy ranks a chunk read once lowest, and at a quarter of the working
set the saves of the same engine steps evicted 66 of 285 (docs/benchmarks.md).

Bounded (``limits.Limits``): at most ``max_cold_in_flight`` prefills on their way at once,
all requests together (the rest wait their turn), and at most ``max_cold_per_client`` chunks
sent or waited for by one client at a time; a request past its client's share computes the
rest itself (``cold_chunks_failed_total{why="client_share"}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from chunkstore.kv.keyspace import Plan

from .instances import Instance
from .limits import Limits
from .metrics import RouterMetrics
from .stores import Stores, Unasked

log = logging.getLogger("chunkstore.router")

# Seconds a cold chunk is held in the daemon for its request (the daemon caps it at its
# lease TTL, 30 s by default): its request is sent once every cold prefill answered, and
# waits its turn in vLLM's queue behind the ones before it.
HOLD_S = 30.0


@dataclass
class Warmed:
    sent: int = 0  # prompts this request sent
    joined: int = 0  # prompts it waited for that another request was sending
    failed: int = 0  # of both: not stored


class ColdChunks:
    def __init__(
        self,
        http: httpx.AsyncClient,
        stores: Stores,
        metrics: RouterMetrics,
        limits: Limits | None = None,
    ) -> None:
        self.http = http
        self.stores = stores
        self.metrics = metrics
        self.limits = limits or Limits()
        self._flying: dict[tuple[str, bytes], asyncio.Future[bool]] = {}
        self._prefills = asyncio.Semaphore(self.limits.max_cold_in_flight)
        self._per_client: dict[str, int] = {}
        self._warned = False

    async def warm(
        self,
        instance: Instance,
        plans: Sequence[Plan],
        present: Sequence[Sequence[bool]],
        model: str,
        salt: str,
        headers: dict[str, str] | None = None,
        client: str = "",
    ) -> Warmed:
        """Store what ``plans`` miss (``present``: each piece held, as the instance's daemon
        answered) through ``instance``, for ``model`` ("": the instance's) with the request's
        ``cache_salt`` and headers (its API key), within ``client``'s share."""
        missing: dict[bytes, tuple[int, ...]] = {}
        for plan, found in zip(plans, present, strict=True):
            for piece, held in zip(plan.pieces, found, strict=True):
                if not held and piece.alone is not None:
                    missing.setdefault(piece.key, piece.alone)
        share = self.limits.max_cold_per_client - self._per_client.get(client, 0)
        if len(missing) > share:
            self.metrics.cold_failed.labels("client_share").inc(len(missing) - max(share, 0))
            missing = dict(list(missing.items())[: max(share, 0)])
        if not missing:
            return Warmed()
        self._per_client[client] = self._per_client.get(client, 0) + len(missing)
        try:
            return await self._warm(instance, missing, model, salt, headers or {})
        finally:
            left = self._per_client.pop(client) - len(missing)
            if left:
                self._per_client[client] = left

    async def _warm(
        self,
        instance: Instance,
        missing: dict[bytes, tuple[int, ...]],
        model: str,
        salt: str,
        headers: dict[str, str],
    ) -> Warmed:
        began = time.perf_counter()
        mine: dict[bytes, tuple[int, ...]] = {}
        theirs: list[asyncio.Future[bool]] = []
        loop = asyncio.get_running_loop()
        for key, prompt in missing.items():
            flight = self._flying.get((instance.daemon, key))
            if flight is None:
                self._flying[(instance.daemon, key)] = loop.create_future()
                mine[key] = prompt
            else:
                theirs.append(flight)
        stored = await self._send(instance, mine, model, salt, headers) if mine else {}
        # Shielded: a waiter that goes away (its client hung up) leaves the flight alone.
        joined = await asyncio.gather(*(asyncio.shield(f) for f in theirs))
        self.metrics.upstream.labels("warm").observe(time.perf_counter() - began)
        self.metrics.cold_sent.inc(len(mine))
        self.metrics.cold_joined.inc(len(theirs))
        failed = sum(not ok for ok in stored.values()) + sum(not ok for ok in joined)
        return Warmed(len(mine), len(theirs), failed)

    async def _send(
        self,
        instance: Instance,
        prompts: dict[bytes, tuple[int, ...]],
        model: str,
        salt: str,
        headers: dict[str, str],
    ) -> dict[bytes, bool]:
        """Each prompt as its own request, side by side; then which were stored. Every
        flight this request opened is closed, whatever happens."""
        stored = dict.fromkeys(prompts, False)
        try:
            sent = await asyncio.gather(
                *(self._prefill(instance, p, model, salt, headers) for p in prompts.values())
            )
            asked = [k for k, ok in zip(prompts, sent, strict=True) if ok]
            found = await self.stores.lookup(instance.daemon, asked)
            if isinstance(found, Unasked):
                found = [False] * len(asked)
            for key, held in zip(asked, found, strict=True):
                stored[key] = held
            lost = len(asked) - sum(stored.values())
            if lost:
                self.metrics.cold_failed.labels("not_stored").inc(lost)
                self._warn_not_stored(instance, lost, len(asked))
        finally:
            for key, ok in stored.items():
                flight = self._flying.pop((instance.daemon, key))
                if not flight.done():
                    flight.set_result(ok)
        return stored

    async def _prefill(
        self,
        instance: Instance,
        prompt: tuple[int, ...],
        model: str,
        salt: str,
        headers: dict[str, str],
    ) -> bool:
        body: dict[str, object] = {"prompt": list(prompt), "max_tokens": 1, "temperature": 0.0}
        body["kv_transfer_params"] = {"hold_s": HOLD_S}
        if model:
            body["model"] = model
        if salt:
            body["cache_salt"] = salt
        try:
            async with self._prefills:
                reply = await self.http.post(
                    f"{instance.url}/v1/completions", json=body, headers=headers
                )
        except httpx.HTTPError as err:
            log.warning("chunkstore router: a cold chunk's prefill on %s: %s", instance.url, err)
            self.metrics.cold_failed.labels("prefill_error").inc()
            return False
        if reply.status_code != 200:
            log.warning(
                "chunkstore router: a cold chunk's prefill on %s: HTTP %d %s",
                instance.url,
                reply.status_code,
                reply.text[:300],
            )
            self.metrics.cold_failed.labels("prefill_error").inc()
            return False
        return True

    def _warn_not_stored(self, instance: Instance, lost: int, sent: int) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning(
            "chunkstore router: %d of %d cold chunks sent to %s were not stored under the keys "
            "the router computed: its --model and --dtype must be the instance's, its "
            "--connector-config the instance's kv_connector_extra_config, and the instance "
            "must use the daemon at %s (or its pool is full). Requests compute these chunks "
            "themselves.",
            lost,
            sent,
            instance.url,
            instance.daemon,
        )
