"""The router's requests to its instances: a request passed on as the client sent it (its
bytes, streamed back as the instance streams it), a JSON request the router wrote, and what
counts as an instance gone (it is marked down; the request moves on to the next).

An instance that cannot be connected to, or broke off the request before answering, or
answered 5xx and then failed a health check (its engine died) is ``Unreachable``. Its own
error (a 4xx; a 5xx while it stays healthy) is passed back as it came.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from .instances import Instance
from .metrics import RouterMetrics
from .requests import Refused

log = logging.getLogger("chunkstore.router")

# Failures of a request's connection that mean the instance went away before it answered
# (a timeout does not: the request may be long, and trying it again doubles the work).
GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class Hold:
    """A request counted in ``instance.in_flight`` until ``release`` (once, whatever path
    the request ends by: every exception included)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self._held = True
        instance.in_flight += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.instance.in_flight -= 1


class Unreachable(Exception):
    """An instance is gone: it could not be connected to, or it went away before answering
    (it is marked down; the request moves on to the next)."""

    def __init__(self, instance: Instance) -> None:
        super().__init__(instance.url)
        self.instance = instance


class Upstream:
    """The instances as the router asks them (one httpx client; each request timed)."""

    def __init__(self, http: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.http = http
        self.metrics = metrics

    async def forward(self, held: Hold, path: str, raw: bytes, headers: dict[str, str]) -> Response:
        """The request to the held instance as the client sent it (its bytes: nothing the
        router read is written back); the reply back as it comes (streamed where it
        streams). ``held`` is released when the reply ends."""
        instance = held.instance
        began = time.perf_counter()
        upstream_request = self.http.build_request(
            "POST", f"{instance.url}{path}", content=raw, headers=json_headers(headers)
        )
        try:
            upstream = await self.http.send(upstream_request, stream=True)
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError as err:
            raise no_answer(instance, "did not answer", err) from None
        self.metrics.upstream.labels("request").observe(time.perf_counter() - began)

        async def end() -> None:
            held.release()
            await upstream.aclose()

        streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if not streamed or upstream.status_code != 200:
            try:
                await upstream.aread()
            except GONE:
                raise Unreachable(instance) from None
            except httpx.HTTPError as err:
                raise no_answer(instance, "broke off", err) from None
            finally:
                await end()
            if upstream.status_code >= 500 and not await self.answers_health(instance):
                raise Unreachable(instance)
            instance.healthy = True  # it answered
            return as_response(upstream)
        instance.healthy = True

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for part in upstream.aiter_raw():
                    yield part
            finally:
                await end()

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "text/event-stream"),
            background=BackgroundTask(end),
        )

    async def answers_health(self, instance: Instance) -> bool:
        """Whether ``instance`` answers ``GET /health`` now (after a 5xx: a vLLM whose engine
        died answers 500 to every request until its server stops)."""
        try:
            reply = await self.http.get(f"{instance.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def post_json(
        self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response:
        """An instance's JSON reply, or its error as a response to pass back."""
        began = time.perf_counter()
        try:
            reply = await self.http.post(
                f"{instance.url}{path}", content=dumps(body), headers=json_headers(headers)
            )
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError as err:
            raise no_answer(instance, "did not answer", err) from None
        self.metrics.upstream.labels("request").observe(time.perf_counter() - began)
        if reply.status_code != 200:
            return as_response(reply)
        try:
            return dict(reply.json())
        except ValueError as err:
            raise no_answer(instance, "answered what is not JSON", err) from None


def no_answer(instance: Instance, what: str, err: Exception) -> Refused:
    """A 502 that names the instance by its place, not its address (logged)."""
    log.warning("chunkstore router: %s (%s) %s: %r", instance.name, instance.url, what, err)
    return Refused(502, f"{instance.name} {what} (the router's log says more)")


def as_response(reply: httpx.Response) -> Response:
    return Response(
        reply.content,
        status_code=reply.status_code,
        media_type=reply.headers.get("content-type", "application/json"),
    )


def json_headers(headers: dict[str, str]) -> dict[str, str]:
    return headers | {"content-type": "application/json"}


def dumps(body: dict[str, Any]) -> bytes:
    """A body the router wrote (prefill/decode, a reordered request), as Python's json
    writes it: NaN and Infinity as the instance's own JSON reader takes them."""
    return json.dumps(body).encode()
