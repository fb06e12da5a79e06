"""The router's HTTP surface: FastAPI on uvicorn, httpx to the instances.

A completion or chat request goes: read (400 / 408 / 413 for what is not a JSON object, too
slow or too big: ``limits``) -> the instance asked whether it admits the caller (``access``:
nothing is done, and nothing said, for a caller it refuses; ``prompts.admit``) -> its
prompts' token IDs (``prompts``; ``requests``, its fields read as vLLM reads them; a
completion's text by the router's own tokenizer where the instance's is proven the same,
``tokens``; otherwise the instance's ``/tokenize``: ``prompt_ids``) -> each chunked prompt's
relevant documents last (``relevant``, by ``order``: the default's answers without the
in-band hook; the one change the router makes to a request) -> their pieces and keys
(``KeySpace.plan``) -> the daemons asked which they hold -> an instance chosen
(``instances``) -> its missing chunks stored through it (``cold``) -> the request passed on
(as the client sent it, its bytes, where its order stays), streamed back as the instance
streams it (``upstream``; prefill/decode: ``prefill_decode``). A request the instance would
refuse (sampling fields, a prompt over the model's context), or past the router's bounds, is
passed on without the router's work. An instance that is gone (it cannot be connected to, it
broke off the request before answering, or it answered 5xx and then failed a health check:
its engine died) is marked down and the request goes to the next: no byte had reached the
client, and a completion has nothing to undo. An instance's own error (a 4xx; a 5xx while it
stays healthy) is passed back as it came. Each reply to an operator (``access.Operators``)
names the instance and why in ``x-chunkstore-*`` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.cookiejar
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from chunkstore.kv.keyspace import KeySpace
from chunkstore.policy.treatment import QualityConfig

from . import disagg, fields
from .access import Gate, Operators
from .asked import HEAVY, Asked
from .cold import ColdChunks, Warmed
from .instances import Choice, Instance, Instances
from .limits import Limits, client_of, parse_body, read_body
from .metrics import RouterMetrics
from .prefill_decode import PrefillDecode
from .prompt_ids import PromptIds
from .prompts import PromptReader, admit
from .proof import Prover
from .relevant import RelevantLast
from .requests import Refused, error
from .stores import Stores
from .tokens import Tokenizer
from .upstream import GONE, Hold, Unreachable, Upstream, as_response

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
    daemon_token: str | None = None
    limits: Limits = field(default_factory=Limits)
    operator_token: str | None = None  # None: operators are callers on this host
    # Relevant documents last (``order``): the default's answers without the in-band hook.
    relevant_last: bool = True
    # The connector's quality settings, from the instances' kv_connector_extra_config
    # (``chunkstore router --connector-config``): the router orders by the same policy.
    quality: QualityConfig = field(default_factory=QualityConfig)
    # Completions' text tokenized here for instances proven to tokenize alike (``tokens``,
    # ``proof``); None: every prompt through the instance's /tokenize.
    tokenizer: Tokenizer | None = None
    metrics: RouterMetrics = field(default_factory=RouterMetrics)


@dataclass(frozen=True)
class Routed:
    """What an operator is told of a request's way (the ``x-chunkstore-*`` headers)."""

    choice: Choice
    warmed: Warmed


class Router:
    """The router's parts, wired once, and the path of a request through them."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics = settings.metrics
        self.instances = Instances(settings.instances)
        self.decoders = Instances(settings.decode, "decode instance") if settings.decode else None
        for instance in [*settings.instances, *settings.decode]:
            self.metrics.rerouted.labels(instance.url)  # a zero, not an absence, until one
        self.limits = settings.limits
        self.stores = Stores(settings.daemon_token, retry_after=self.limits.daemon_retry)
        # No cookie jar: an instance's (or a proxy's) cookies are its client's, never sent
        # with another client's requests.
        no_cookies = http.cookiejar.CookieJar(
            http.cookiejar.DefaultCookiePolicy(allowed_domains=[])
        )
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.timeout, connect=settings.connect_timeout),
            limits=httpx.Limits(max_connections=settings.max_connections),
            cookies=no_cookies,
        )
        self.gate = Gate(self.http, self.limits.auth_ttl)
        self.operators = Operators(settings.operator_token)
        self.cold = ColdChunks(self.http, self.stores, self.metrics, self.limits)
        self._background: set[asyncio.Task[None]] = set()  # tokenizer checks (``tokens``)
        tokenizer = settings.tokenizer
        self.prover = None if tokenizer is None else Prover(self.http, tokenizer, self.metrics)
        self.upstream = Upstream(self.http, self.metrics)
        self.ids = PromptIds(self.http, self.metrics, tokenizer, self._background)
        keys = settings.keys
        self.reader = (
            None if keys is None else PromptReader(keys, self.limits, self.metrics, self.ids)
        )
        self.relevant = (
            RelevantLast(keys, settings.quality, self.metrics, self.ids)
            if keys is not None and settings.relevant_last
            else None
        )
        self.split = None if self.decoders is None else PrefillDecode(self.upstream, self.decoders)

    # -- a completion or chat request ---------------------------------------------------

    async def complete(self, request: Request, chat: bool) -> Response:
        endpoint = CHAT if chat else COMPLETIONS
        try:
            raw = await read_body(request, self.limits)
            body = parse_body(raw) if len(raw) < HEAVY else await asyncio.to_thread(parse_body, raw)
            reply = await self._route(request, raw, body, endpoint, chat)
        except Refused as err:
            reply = JSONResponse(error(err.status, str(err)), status_code=err.status)
        self.metrics.requests.labels(endpoint, str(reply.status_code)).inc()
        return reply

    async def _route(
        self, request: Request, raw: bytes, body: dict[str, Any], endpoint: str, chat: bool
    ) -> Response:
        """To the best instance; to the next if it cannot be connected to."""
        tried: list[Instance] = []
        headers = {k: v for k in PASSED_HEADERS if (v := request.headers.get(k))}
        if self.decoders is not None:
            disagg.check(body, chat)
            disagg.max_tokens(body, chat)
        ask = Asked(raw, body, endpoint, chat, headers, client_of(request), len(raw) >= HEAVY)
        # Those that answered their last health check; if none did, every one not yet
        # tried (a check can time out under load: only a refused connection rules one out).
        while candidates := self.instances.healthy(tried) or self.instances.untried(tried):
            try:
                reply, routed = await self._attempt(candidates, ask)
            except Unreachable as err:
                err.instance.healthy = False
                tried.append(err.instance)
                self.metrics.rerouted.labels(err.instance.url).inc()
                continue
            if routed is not None and self.operators.allows(request):
                _describe(reply, routed)
            return reply
        raise Refused(503, "no instance is up (see the router's /health)")

    async def _attempt(
        self, candidates: list[Instance], ask: Asked
    ) -> tuple[Response, Routed | None]:
        first = candidates[0]
        admission = await admit(self.gate, first, ask.headers)
        if isinstance(admission, Response):
            return admission, None  # the instance refuses the caller: nothing done, said
        reader = self.reader
        prompts = await reader.read(first, ask, admission) if admission and reader else []
        plans = [plan for _, plan in prompts]
        if prompts and self.relevant is not None:
            ask, prompts = await self.relevant.reorder(first, ask, prompts)
            plans = await self.relevant.loaded(ask, prompts)
        daemons = self.instances.daemons(candidates)
        stored, present = await self.stores.held(daemons, plans, self.metrics)
        choice = self.instances.choose(candidates, stored)
        instance = choice.instance
        self.metrics.routed.labels(instance.url, choice.reason).inc()
        held = Hold(instance)
        try:
            warmed = Warmed()
            if self.settings.cold_chunks and plans and instance.daemon in present:
                salt = str(ask.body.get("cache_salt") or "")
                model = str(ask.body.get("model") or "")
                warmed = await self.cold.warm(
                    instance, plans, present[instance.daemon], model, salt, ask.headers, ask.client
                )
            if self.split is not None:
                reply = await self.split.answer(held, ask.endpoint, ask.body, ask.chat, ask.headers)
            else:
                reply = await self.upstream.forward(held, ask.endpoint, ask.raw, ask.headers)
        except BaseException:
            held.release()
            raise
        return reply, Routed(choice, warmed)

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
            return as_response(reply)
        return JSONResponse(error(503, "no instance is up"), status_code=503)

    def health(self, request: Request) -> Response:
        """200 while an instance is up; to an operator, each instance's state too."""
        up = sum(i.healthy for i in self.instances.all)
        status = 200 if up else 503
        if not self.operators.allows(request, bearer=True):
            summary = {"status": "ok" if up else "no instance is up", "up": up}
            return JSONResponse(summary | {"of": len(self.instances.all)}, status_code=status)
        instances = [
            {"url": i.url, "daemon": i.daemon, "healthy": i.healthy, "in_flight": i.in_flight}
            for i in self.instances.all
        ]
        return JSONResponse({"instances": instances}, status_code=status)

    def operator_metrics(self, request: Request) -> Response:
        if not self.operators.allows(request, bearer=True):
            why = (
                "the router's metrics are its operator's: Authorization: Bearer <--operator-token>"
            )
            return JSONResponse(error(403, why), status_code=403)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            interval = self.settings.health_interval
            await asyncio.to_thread(fields.request_models)  # vLLM's, before the first request
            watch = asyncio.create_task(self.instances.watch(self.http, interval))
            if self.prover is not None:
                self.ids.beside(self.prover.keep(self.instances, interval))
            try:
                yield
            finally:
                watch.cancel()
                for task in list(self._background):
                    task.cancel()
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
        async def health(request: Request) -> Response:
            return self.health(request)

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            return self.operator_metrics(request)

        return app


def _describe(reply: Response, routed: Routed) -> None:
    choice, warmed = routed.choice, routed.warmed
    reply.headers["x-chunkstore-instance"] = choice.instance.url
    reply.headers["x-chunkstore-route"] = str(choice.reason)
    reply.headers["x-chunkstore-stored-tokens"] = str(choice.stored_tokens)
    reply.headers["x-chunkstore-cold-chunks"] = (
        f"sent={warmed.sent} joined={warmed.joined} failed={warmed.failed}"
    )
