"""The router's HTTP surface: FastAPI on uvicorn, httpx to the instances.

A completion or chat request goes: read (400 / 413 for what is not a JSON object or is too
big) -> its prompts' token IDs (``requests``; the instance's ``/tokenize``) -> their pieces
and keys (``plan``) -> the daemons asked which they hold -> an instance chosen
(``instances``) -> its missing chunks stored through it (``cold``) -> the request passed on
as the client sent it, streamed back as the instance streams it. An instance that is gone
(it cannot be connected to, it broke off the request before answering, or it answered 5xx
and then failed a health check: its engine died) is marked down and the request goes to the
next: no byte had reached the client, and a completion has nothing to undo. An instance's own
error (a 4xx; a 5xx while it stays healthy) is passed back as it came. Each reply names the
instance and why in ``x-chunkstore-*`` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from . import disagg
from .cold import ColdChunks, Warmed
from .instances import Choice, Instance, Instances
from .metrics import RouterMetrics
from .plan import KeySpace, Plan
from .requests import Refused, error, prompts_of, read_body
from .stores import Stores

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PASSED_HEADERS = ("authorization", "x-request-id")


@dataclass
class RouterSettings:
    keys: KeySpace | None  # None: no keys (no --model), so no cold chunks; routing by load
    instances: list[Instance]  # with ``decode``: the prefill instances
    decode: list[Instance] = field(default_factory=list)  # prefill/decode (``disagg``)
    cold_chunks: bool = True  # store a request's missing chunks before it (cold)
    timeout: float = 600.0  # seconds an instance may take to answer (streamed: between bytes)
    connect_timeout: float = 5.0
    max_connections: int = 256  # to the instances, all together
    health_interval: float = 5.0
    max_body_bytes: int = 32 << 20
    daemon_token: str | None = None
    metrics: RouterMetrics = field(default_factory=RouterMetrics)


# Failures of a request's connection that mean the instance went away before it answered
# (a timeout does not: the request may be long, and trying it again doubles the work).
GONE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class Unreachable(Exception):
    """An instance is gone: it could not be connected to, or it went away before answering
    (it is marked down; the request moves on to the next)."""

    def __init__(self, instance: Instance) -> None:
        super().__init__(instance.url)
        self.instance = instance


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = settings.metrics
        self.instances = Instances(settings.instances)
        self.decoders = Instances(settings.decode) if settings.decode else None
        for instance in [*settings.instances, *settings.decode]:
            self.metrics.rerouted.labels(instance.url)  # a zero, not an absence, until one
        self.stores = Stores(settings.daemon_token)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.timeout, connect=settings.connect_timeout),
            limits=httpx.Limits(max_connections=settings.max_connections),
        )
        self.cold = ColdChunks(self.http, self.stores, self.metrics)

    # -- a completion or chat request ---------------------------------------------------

    async def complete(self, request: Request, chat: bool) -> Response:
        endpoint = CHAT if chat else COMPLETIONS
        try:
            body = read_body(await request.body(), self.settings.max_body_bytes)
            reply = await self._route(request, body, endpoint, chat)
        except Refused as err:
            reply = JSONResponse(error(err.status, str(err)), status_code=err.status)
        self.metrics.requests.labels(endpoint, str(reply.status_code)).inc()
        return reply

    async def _route(
        self, request: Request, body: dict[str, Any], endpoint: str, chat: bool
    ) -> Response:
        """To the best instance; to the next if it cannot be connected to."""
        tried: list[Instance] = []
        headers = {k: v for k in PASSED_HEADERS if (v := request.headers.get(k))}
        if self.decoders is not None:
            disagg.check(body, chat)
            disagg.max_tokens(body, chat)
        # Those that answered their last health check; if none did, every one not yet
        # tried (a check can time out under load: only a refused connection rules one out).
        while candidates := self.instances.healthy(tried) or self.instances.untried(tried):
            try:
                return await self._attempt(candidates, body, endpoint, chat, headers)
            except Unreachable as err:
                err.instance.healthy = False
                tried.append(err.instance)
                self.metrics.rerouted.labels(err.instance.url).inc()
        raise Refused(503, "no instance is up (see the router's /health)")

    async def _attempt(
        self,
        candidates: list[Instance],
        body: dict[str, Any],
        endpoint: str,
        chat: bool,
        headers: dict[str, str],
    ) -> Response:
        plans = await self._plans(candidates[0], body, chat, headers)
        stored, present = await self._stored(candidates, plans)
        choice = self.instances.choose(candidates, stored)
        instance = choice.instance
        self.metrics.routed.labels(instance.url, choice.reason).inc()
        instance.in_flight += 1
        try:
            warmed = Warmed()
            if self.settings.cold_chunks and plans and instance.daemon in present:
                salt = str(body.get("cache_salt") or "")
                model = str(body.get("model") or "")
                warmed = await self.cold.warm(
                    instance, plans, present[instance.daemon], model, salt, headers
                )
        except BaseException:
            instance.in_flight -= 1
            raise
        if self.decoders is not None:
            reply = await self._disaggregated(instance, endpoint, body, headers, chat)
        else:
            reply = await self._forward(instance, endpoint, body, headers)
        _describe(reply, choice, warmed)
        return reply

    async def _plans(
        self, instance: Instance, body: dict[str, Any], chat: bool, headers: dict[str, str]
    ) -> list[Plan]:
        """The request's prompts as pieces and keys ([] where the router cannot read them,
        or the instance would not tokenize them)."""
        keys = self.settings.keys
        if keys is None:
            return []
        prompts = prompts_of(body, chat)
        if prompts is None:
            self.metrics.fallbacks.labels("unparsed").inc()
            return []
        salt = str(body.get("cache_salt") or "")
        plans = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                ids = await self._tokenize(instance, prompt, headers)
                if ids is None:
                    return []
                prompt = ids
            plans.append(keys.plan(prompt, salt))
        return plans

    async def _tokenize(
        self, instance: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """The instance's token IDs for a prompt; None if it would not give them (the
        request then goes on as it is, and the instance answers it, its error included)."""
        began = time.perf_counter()
        try:
            reply = await self.http.post(f"{instance.url}/tokenize", json=body, headers=headers)
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError:
            reply = None
        self.metrics.upstream.labels("tokenize").observe(time.perf_counter() - began)
        if reply is None or reply.status_code != 200:
            self.metrics.fallbacks.labels("tokenize_failed").inc()
            return None
        return [int(t) for t in reply.json()["tokens"]]

    async def _stored(
        self, candidates: Sequence[Instance], plans: list[Plan]
    ) -> tuple[dict[str, int], dict[str, list[list[bool]]]]:
        """Per daemon of the candidates: the request's tokens it holds, and which pieces (a
        daemon that cannot be asked is absent from both)."""
        keys = [p.key for plan in plans for p in plan.pieces]
        if not keys:
            return {}, {}
        daemons = self.instances.daemons(candidates)
        answers = await asyncio.gather(*(self.stores.lookup(d, keys) for d in daemons))
        stored: dict[str, int] = {}
        present: dict[str, list[list[bool]]] = {}
        for daemon, found in zip(daemons, answers, strict=True):
            if found is None:
                self.metrics.fallbacks.labels("daemon_unreachable").inc()
                continue
            flags = iter(found)
            present[daemon] = [[next(flags) for _ in plan.pieces] for plan in plans]
            pieces = [p for plan in plans for p in plan.pieces]
            stored[daemon] = sum(p.tokens for p, f in zip(pieces, found, strict=True) if f)
        return stored, present

    async def _forward(
        self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        """The request to ``instance`` as the client sent it; the reply back as it comes
        (streamed where it streams). ``instance.in_flight`` drops when the reply ends."""
        began = time.perf_counter()
        upstream_request = self.http.build_request(
            "POST", f"{instance.url}{path}", json=body, headers=headers
        )
        try:
            upstream = await self.http.send(upstream_request, stream=True)
        except BaseException as err:
            instance.in_flight -= 1
            if isinstance(err, GONE):
                raise Unreachable(instance) from None
            if isinstance(err, httpx.HTTPError):
                raise Refused(502, f"the instance {instance.url} did not answer: {err!r}") from None
            raise
        self.metrics.upstream.labels("request").observe(time.perf_counter() - began)
        ended = False

        async def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                instance.in_flight -= 1
                await upstream.aclose()

        if not body.get("stream") or upstream.status_code != 200:
            try:
                await upstream.aread()
            except GONE:
                raise Unreachable(instance) from None
            except httpx.HTTPError as err:
                raise Refused(502, f"the instance {instance.url} broke off: {err!r}") from None
            finally:
                await end()
            if upstream.status_code >= 500 and not await self._answers_health(instance):
                raise Unreachable(instance)
            instance.healthy = True  # it answered
            return _as_response(upstream)
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

    async def _answers_health(self, instance: Instance) -> bool:
        """Whether ``instance`` answers ``GET /health`` now (after a 5xx: a vLLM whose engine
        died answers 500 to every request until its server stops)."""
        try:
            reply = await self.http.get(f"{instance.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    # -- prefill/decode (disagg) -------------------------------------------------------

    async def _disaggregated(
        self,
        prefill: Instance,
        endpoint: str,
        body: dict[str, Any],
        headers: dict[str, str],
        chat: bool,
    ) -> Response:
        """The first token from ``prefill`` (its ``in_flight`` drops when it answers), the
        rest from the least loaded decode instance; joined, or streamed."""
        try:
            first = await self._post_json(
                prefill, endpoint, disagg.prefill_body(body, chat), headers
            )
        finally:
            prefill.in_flight -= 1
        if isinstance(first, Response):
            return first  # the prefill instance's error, as it came
        token_ids = bool(body.get("return_token_ids"))
        head = first["choices"][0]
        stream = bool(body.get("stream"))
        wanted = disagg.max_tokens(body, chat)
        if wanted <= 1 or head.get("finish_reason") == "stop":
            if stream:
                done = disagg.first_event(first, chat, head.get("finish_reason"))
                return Response(done + b"data: [DONE]\n\n", media_type="text/event-stream")
            return JSONResponse(disagg.only_first(first, token_ids))
        decode = disagg.decode_body(body, chat, disagg.prompt_ids(first), wanted - 1)
        for decoder in self._decoders():
            decoder.in_flight += 1
            try:
                if stream:
                    return await self._decode_stream(decoder, decode, headers, first, chat)
                rest = await self._post_json(decoder, COMPLETIONS, decode, headers)
            except Unreachable:
                decoder.healthy = False
                continue
            finally:
                decoder.in_flight -= 1
            if isinstance(rest, Response):
                return rest
            joined = disagg.join(first, rest, chat, token_ids)
            return JSONResponse(disagg.only_first(joined, token_ids))
        raise Refused(503, "no decode instance is up (see the router's /health)")

    def _decoders(self) -> list[Instance]:
        """Decode instances to try, least loaded first."""
        assert self.decoders is not None
        healthy = self.decoders.healthy() or self.decoders.all
        return sorted(healthy, key=lambda i: i.in_flight)

    async def _post_json(
        self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response:
        """An instance's JSON reply, or its error as a response to pass back."""
        began = time.perf_counter()
        try:
            reply = await self.http.post(f"{instance.url}{path}", json=body, headers=headers)
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError as err:
            raise Refused(502, f"the instance {instance.url} did not answer: {err!r}") from None
        self.metrics.upstream.labels("request").observe(time.perf_counter() - began)
        if reply.status_code != 200:
            return _as_response(reply)
        return dict(reply.json())

    async def _decode_stream(
        self,
        decoder: Instance,
        decode: dict[str, Any],
        headers: dict[str, str],
        first: dict[str, Any],
        chat: bool,
    ) -> Response:
        request = self.http.build_request(
            "POST", f"{decoder.url}{COMPLETIONS}", json=decode, headers=headers
        )
        try:
            upstream = await self.http.send(request, stream=True)
        except GONE:
            raise Unreachable(decoder) from None
        except httpx.HTTPError as err:
            raise Refused(502, f"the instance {decoder.url} did not answer: {err!r}") from None
        if upstream.status_code != 200:
            try:
                await upstream.aread()
            finally:
                await upstream.aclose()
            return _as_response(upstream)
        decoder.in_flight += 1  # until the stream ends (the caller's count ends on return)

        async def events() -> AsyncIterator[bytes]:
            try:
                yield disagg.first_event(first, chat, None)
                async for event in disagg.relay_events(upstream.aiter_lines(), first, chat):
                    yield event
            finally:
                decoder.in_flight -= 1
                await upstream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    # -- the rest -----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        for instance in self.instances.healthy():
            try:
                reply = await self.http.get(
                    f"{instance.url}/v1/models",
                    headers={k: v for k in PASSED_HEADERS if (v := request.headers.get(k))},
                )
            except GONE:
                instance.healthy = False
                continue
            return _as_response(reply)
        return JSONResponse(error(503, "no instance is up"), status_code=503)

    def health(self) -> Response:
        instances = [
            {"url": i.url, "daemon": i.daemon, "healthy": i.healthy, "in_flight": i.in_flight}
            for i in self.instances.all
        ]
        up = any(i.healthy for i in self.instances.all)
        return JSONResponse({"instances": instances}, status_code=200 if up else 503)

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            watch = asyncio.create_task(
                self.instances.watch(self.http, self.settings.health_interval)
            )
            try:
                yield
            finally:
                watch.cancel()
                await self.http.aclose()
                await asyncio.to_thread(self.stores.close)

        app = FastAPI(title="chunkstore router", lifespan=lifespan)

        @app.post(COMPLETIONS)
        async def completions(request: Request) -> Response:
            return await self.complete(request, chat=False)

        @app.post(CHAT)
        async def chat(request: Request) -> Response:
            return await self.complete(request, chat=True)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            return await self.models(request)

        @app.get("/health")
        async def health() -> Response:
            return self.health()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app


def _as_response(reply: httpx.Response) -> Response:
    return Response(
        reply.content,
        status_code=reply.status_code,
        media_type=reply.headers.get("content-type", "application/json"),
    )


def _describe(reply: Response, choice: Choice, warmed: Warmed) -> None:
    reply.headers["x-chunkstore-instance"] = choice.instance.url
    reply.headers["x-chunkstore-route"] = str(choice.reason)
    reply.headers["x-chunkstore-stored-tokens"] = str(choice.stored_tokens)
    reply.headers["x-chunkstore-cold-chunks"] = (
        f"sent={warmed.sent} joined={warmed.joined} failed={warmed.failed}"
    )
