"""The router's HTTP surface: FastAPI on uvicorn, httpx to the instances.

A completion or chat request goes: read (400 / 408 / 413 for what is not a JSON object, too
slow or too big: ``limits``) -> the instance asked whether it admits the caller (``access``:
nothing is done, and nothing said, for a caller it refuses) -> its prompts' token IDs
(``requests``, its fields read as vLLM reads them; a completion's text by the router's own
tokenizer where the instance's is proven the same, ``tokens``; otherwise the instance's
``/tokenize``) -> each chunked prompt's relevant documents last (``order``: the default's
answers without the in-band hook; the one change the router makes to a request) -> their
pieces and keys (``KeySpace.plan``) -> the daemons asked which they hold -> an instance
chosen (``instances``) -> its missing chunks stored through it (``cold``) -> the request
passed on (as the client sent it, its bytes, where its order stays), streamed back as the
instance streams it. A request the instance would refuse (sampling fields, a prompt over the
model's context), or past the router's bounds, is passed on without the router's work. An
instance that is gone (it cannot be connected to, it broke off the request before answering,
or it answered 5xx and then failed a health check: its engine died) is marked down and the
request goes to the next: no byte had reached the client, and a completion has nothing to
undo. An instance's own error (a 4xx; a 5xx while it stays healthy) is passed back as it
came. Each reply to an operator (``access.Operators``) names the instance and why in
``x-chunkstore-*`` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.cookiejar
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask

from chunkstore.kv.keyspace import KeySpace, Plan
from chunkstore.kv.segments import Segment, reordered_ids
from chunkstore.policy.selection import TransferParams
from chunkstore.policy.treatment import QualityConfig

from . import disagg, fields, order
from .access import Admission, Gate, Operators
from .cold import ColdChunks, Warmed
from .instances import Choice, Instance, Instances
from .limits import Limits, client_of, parse_body, read_body, would_refuse
from .metrics import RouterMetrics
from .proof import Prover
from .requests import Refused, error, prompts_of
from .stores import Stores, Unasked
from .tokens import Tokenizer

log = logging.getLogger("chunkstore.router")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PASSED_HEADERS = ("authorization", "x-request-id")
HEAVY = 1 << 16  # bytes of a body past which its parsing and planning leave the event loop


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


@dataclass(frozen=True)
class Routed:
    """What an operator is told of a request's way (the ``x-chunkstore-*`` headers)."""

    choice: Choice
    warmed: Warmed


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
        admission = await self._admit(first, ask.headers)
        if isinstance(admission, Response):
            return admission, None  # the instance refuses the caller: nothing done, said
        prompts = await self._prompts(first, ask, admission) if admission else []
        if prompts and self.settings.relevant_last:
            ask, prompts = await self._relevant_last(first, ask, prompts)
        plans = await self._loaded(ask, prompts)
        stored, present = await self._stored(candidates, plans)
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
            if self.decoders is not None:
                reply = await self._disaggregated(held, ask)
            else:
                reply = await self._forward(held, ask.endpoint, ask.raw, ask.headers)
        except BaseException:
            held.release()
            raise
        return reply, Routed(choice, warmed)

    async def _admit(
        self, instance: Instance, headers: dict[str, str]
    ) -> Admission | Response | None:
        """The instance's yes to the caller (``access.Gate``); its refusal (401 / 403) as a
        reply to pass back; None where it answers neither (the request then goes on without
        the router's work, and the instance answers it)."""
        try:
            answer = await self.gate.admit(instance, headers)
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError as err:
            log.warning(
                "chunkstore router: %s (%s) did not answer: %r", instance.name, instance.url, err
            )
            return None
        if isinstance(answer, Admission):
            return answer
        if answer.status_code in (401, 403):
            return _as_response(answer)
        return None

    async def _prompts(self, instance: Instance, ask: Asked, admission: Admission) -> list[Prompt]:
        """The request's prompts: their token IDs, pieces and keys; [] where the router does
        not work for it: it cannot read them, the instance would not tokenize them or would
        refuse the request, or they are past the router's bounds (each counted in
        ``fallbacks``)."""
        keys = self.settings.keys
        if keys is None:
            return []
        body = ask.body
        if not admission.serves(body.get("model")):
            return self._fallback("unknown_model")
        if would_refuse(body) is not None:
            return self._fallback("refused_fields")
        context = admission.context_of(body.get("model"))
        if context is not None and _asks_past(body, context):
            return self._fallback("too_long")
        prompts = await self._cpu(ask.heavy, prompts_of, body, ask.chat)
        if isinstance(prompts, str):
            return self._fallback(prompts)  # why it does no work for it (``requests``)
        if len(prompts) > self.limits.max_prompts:
            return self._fallback("too_many_prompts")
        ids = await asyncio.gather(
            *(
                self._tokenize(instance, p, ask.headers) if isinstance(p, dict) else _ready(p)
                for p in prompts
            )
        )
        if any(i is None for i in ids):
            return []
        found = [i for i in ids if i is not None]
        if context is not None and any(len(i) > context for i in found):
            return self._fallback("too_long")
        salt = str(body.get("cache_salt") or "")
        plans = await self._cpu(ask.heavy, lambda: [keys.plan(i, salt) for i in found])
        if sum(len(p.pieces) for p in plans) > self.limits.max_chunks:
            return self._fallback("too_many_chunks")
        return list(zip(found, plans, strict=True))

    def _fallback(self, why: str) -> list[Any]:
        self.metrics.fallbacks.labels(why).inc()
        return []

    async def _loaded(self, ask: Asked, prompts: list[Prompt]) -> list[Plan]:
        """The prompts' pieces the instance loads: sent in their relevant order, the
        relevant chunks standing last are computed there, not loaded (nor sent cold)."""
        keys = self.settings.keys
        if keys is None or not prompts or not self.settings.relevant_last:
            return [plan for _, plan in prompts]
        params = ask.params
        quality = self.settings.quality

        def loaded(ids: list[int], plan: Plan) -> Plan:
            # The policy again, on the prompt as sent: the connector decides on what it
            # receives, and a moved chunk can decide otherwise where it now stands (the
            # first chunk after sys is causal); a second split and BM25 is what that costs.
            end = order.computed_from(keys, quality, ids, params) if plan.chunked else None
            if end is None:
                return plan
            return Plan(tuple(p for p in plan.pieces if p.segment.end <= end), True)

        return list(await self._cpu(ask.heavy, lambda: [loaded(*p) for p in prompts]))

    async def _relevant_last(
        self, instance: Instance, ask: Asked, prompts: list[Prompt]
    ) -> tuple[Asked, list[Prompt]]:
        """The request with each prompt's relevant chunks last (``order``), and its prompts
        as sent; as it came where its order stays."""
        keys, body = self.settings.keys, ask.body
        if keys is None or order.keeps_order(ask.params, len(prompts)):
            return ask, prompts
        params = ask.params
        quality = self.settings.quality
        salt = str(body.get("cache_salt") or "")

        def reorder(prompt: Prompt) -> tuple[Prompt, list[Segment], list[int]] | None:
            found = order.new_order(keys, quality, prompt[0], params)
            if found is None:
                return None
            ids = reordered_ids(*found)
            return (ids, keys.plan(ids, salt)), *found

        found = await self._cpu(ask.heavy, lambda: [reorder(p) for p in prompts])
        moved = [f for f in found if f is not None]
        if not moved:
            return ask, prompts
        sent = [p if f is None else f[0] for p, f in zip(prompts, found, strict=True)]
        new_ids = [ids for ids, _ in sent]
        sent_params = body.get("kv_transfer_params")
        renamed = (
            order.reordered_params(sent_params, moved[0][2]) if len(sent) == 1 else sent_params
        )
        if ask.chat:
            _, segments, chunk_order = moved[0]
            messages = order.chat_messages(
                body.get("messages"), keys.separator_text, segments, chunk_order
            )
            rewritten = None if messages is None else body | {"messages": messages}
            if (
                rewritten is None
                or await self._tokenize_chat(instance, rewritten, ask) != new_ids[0]
            ):
                self.metrics.order_kept.labels("chat_text").inc()
                return ask, prompts
        else:
            prompt = new_ids[0] if len(new_ids) == 1 else new_ids
            rewritten = body | {"prompt": prompt}
        if renamed is not sent_params:
            rewritten["kv_transfer_params"] = renamed
        self.metrics.reordered.labels("chat" if ask.chat else "completion").inc()
        raw = await self._cpu(ask.heavy, _dumps, rewritten)
        return dataclasses.replace(ask, raw=raw, body=rewritten), sent

    async def _tokenize_chat(
        self, instance: Instance, body: dict[str, Any], ask: Asked
    ) -> list[int] | None:
        prompts = prompts_of(body, chat=True)
        if isinstance(prompts, str) or not prompts or not isinstance(prompts[0], dict):
            return None
        return await self._tokenize(instance, prompts[0], ask.headers)

    @staticmethod
    async def _cpu(heavy: bool, work: Any, *args: Any) -> Any:
        """``work(*args)``, off the event loop where the body is big enough to matter."""
        return await asyncio.to_thread(work, *args) if heavy else work(*args)

    async def _tokenize(
        self, instance: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """A prompt's token IDs, the instance's (``tokens``: the router's own tokenizer's
        where the instance's is proven the same, ``proof``); None if the instance would not
        give them (the request then goes on as it is, and the instance answers it, its
        error included)."""
        local = self.settings.tokenizer
        if local is not None and local.reads(body) and local.agrees(instance.url):
            ours = await self._cpu(len(body["prompt"]) >= HEAVY, local.ids, body)
            self.metrics.tokenized.labels("router").inc()
            if local.due(instance.url):
                self._beside(self._compare(local, instance, body, headers, ours))
            return ours
        found = await self._instance_ids(instance, body, headers)
        self.metrics.tokenized.labels("instance").inc()
        if found is None:
            self.metrics.fallbacks.labels("tokenize_failed").inc()
        return found

    async def _compare(
        self,
        local: Tokenizer,
        instance: Instance,
        body: dict[str, Any],
        headers: dict[str, str],
        ours: list[int],
    ) -> None:
        """The instance's IDs for a text the router tokenized, compared (beside its request)."""
        try:
            theirs = await self._instance_ids(instance, body, headers)
        except Unreachable:
            return
        if theirs is not None:
            self.metrics.tokenizer_checks.inc()
            if not local.compared(instance.url, body, ours, theirs):
                self.metrics.tokenizer_mismatch.inc()

    def _beside(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _instance_ids(
        self, instance: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """The instance's ``/tokenize`` answer; None where it gives none."""
        began = time.perf_counter()
        try:
            reply = await self.http.post(f"{instance.url}/tokenize", json=body, headers=headers)
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError:
            reply = None
        self.metrics.upstream.labels("tokenize").observe(time.perf_counter() - began)
        try:
            if reply is None or reply.status_code != 200:
                raise ValueError(reply.status_code if reply is not None else "no answer")
            heavy = len(reply.content) >= HEAVY  # a long prompt's IDs: parsed off the loop
            return list(await self._cpu(heavy, _token_ids, reply))
        except (ValueError, KeyError, TypeError):
            return None

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
            if isinstance(found, Unasked):
                self.metrics.fallbacks.labels(found.value).inc()
                continue
            flags = iter(found)
            present[daemon] = [[next(flags) for _ in plan.pieces] for plan in plans]
            pieces = [p for plan in plans for p in plan.pieces]
            stored[daemon] = sum(p.tokens for p, f in zip(pieces, found, strict=True) if f)
        return stored, present

    async def _forward(
        self, held: Hold, path: str, raw: bytes, headers: dict[str, str]
    ) -> Response:
        """The request to the held instance as the client sent it (its bytes: nothing the
        router read is written back); the reply back as it comes (streamed where it
        streams). ``held`` is released when the reply ends."""
        instance = held.instance
        began = time.perf_counter()
        upstream_request = self.http.build_request(
            "POST", f"{instance.url}{path}", content=raw, headers=_json(headers)
        )
        try:
            upstream = await self.http.send(upstream_request, stream=True)
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError as err:
            raise self._no_answer(instance, "did not answer", err) from None
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
                raise self._no_answer(instance, "broke off", err) from None
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

    @staticmethod
    def _no_answer(instance: Instance, what: str, err: Exception) -> Refused:
        """A 502 that names the instance by its place, not its address (logged)."""
        log.warning("chunkstore router: %s (%s) %s: %r", instance.name, instance.url, what, err)
        return Refused(502, f"{instance.name} {what} (the router's log says more)")

    async def _answers_health(self, instance: Instance) -> bool:
        """Whether ``instance`` answers ``GET /health`` now (after a 5xx: a vLLM whose engine
        died answers 500 to every request until its server stops)."""
        try:
            reply = await self.http.get(f"{instance.url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    # -- prefill/decode (disagg) -------------------------------------------------------

    async def _disaggregated(self, held: Hold, ask: Asked) -> Response:
        """The first token from the held prefill instance (released when it answers), the
        rest from the least loaded decode instance; joined, or streamed."""
        body, chat, headers = ask.body, ask.chat, ask.headers
        try:
            first = await self._post_json(
                held.instance, ask.endpoint, disagg.prefill_body(body, chat), headers
            )
        finally:
            held.release()
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
            counted = Hold(decoder)
            try:
                if stream:
                    return await self._decode_stream(decoder, decode, headers, first, chat)
                rest = await self._post_json(decoder, COMPLETIONS, decode, headers)
            except Unreachable:
                decoder.healthy = False
                continue
            finally:
                counted.release()
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
            reply = await self.http.post(
                f"{instance.url}{path}", content=_dumps(body), headers=_json(headers)
            )
        except GONE:
            raise Unreachable(instance) from None
        except httpx.HTTPError as err:
            raise self._no_answer(instance, "did not answer", err) from None
        self.metrics.upstream.labels("request").observe(time.perf_counter() - began)
        if reply.status_code != 200:
            return _as_response(reply)
        try:
            return dict(reply.json())
        except ValueError as err:
            raise self._no_answer(instance, "answered what is not JSON", err) from None

    async def _decode_stream(
        self,
        decoder: Instance,
        decode: dict[str, Any],
        headers: dict[str, str],
        first: dict[str, Any],
        chat: bool,
    ) -> Response:
        request = self.http.build_request(
            "POST", f"{decoder.url}{COMPLETIONS}", content=_dumps(decode), headers=_json(headers)
        )
        try:
            upstream = await self.http.send(request, stream=True)
        except GONE:
            raise Unreachable(decoder) from None
        except httpx.HTTPError as err:
            raise self._no_answer(decoder, "did not answer", err) from None
        if upstream.status_code != 200:
            try:
                await upstream.aread()
            finally:
                await upstream.aclose()
            return _as_response(upstream)
        streaming = Hold(decoder)  # until the stream ends (the caller's count ends on return)

        async def end() -> None:
            streaming.release()
            await upstream.aclose()

        async def events() -> AsyncIterator[bytes]:
            try:
                yield disagg.first_event(first, chat, None)
                async for event in disagg.relay_events(upstream.aiter_lines(), first, chat):
                    yield event
            finally:
                await end()

        return StreamingResponse(
            events(), media_type="text/event-stream", background=BackgroundTask(end)
        )

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
                self._beside(self.prover.keep(self.instances, interval))
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


def _as_response(reply: httpx.Response) -> Response:
    return Response(
        reply.content,
        status_code=reply.status_code,
        media_type=reply.headers.get("content-type", "application/json"),
    )


@dataclass(frozen=True)
class Asked:
    """A request as read: its bytes, its body, and who sent it."""

    raw: bytes
    body: dict[str, Any]
    endpoint: str
    chat: bool
    headers: dict[str, str]  # those passed on (the API key)
    client: str  # its share of cold chunks (``limits.client_of``)
    heavy: bool  # big enough that reading it leaves the event loop
    params: TransferParams = field(init=False)  # its kv_transfer_params, parsed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", order.params_of(self.body))


Prompt = tuple[list[int], Plan]  # a prompt's token IDs, and its pieces and keys


async def _ready(ids: list[int]) -> list[int]:
    return ids


def _json(headers: dict[str, str]) -> dict[str, str]:
    return headers | {"content-type": "application/json"}


def _token_ids(reply: httpx.Response) -> list[int]:
    return [int(t) for t in reply.json()["tokens"]]


def _asks_past(body: dict[str, Any], context: int) -> bool:
    """Whether the request asks for more output tokens than the model's context holds (vLLM
    refuses it: ``max_tokens`` or ``max_completion_tokens`` > ``max_model_len``)."""
    asked = [body.get(name) for name in ("max_tokens", "max_completion_tokens")]
    return any(type(n) is int and n > context for n in asked)


def _dumps(body: dict[str, Any]) -> bytes:
    """A body the router wrote (prefill/decode), as Python's json writes it: NaN and
    Infinity as the instance's own JSON reader takes them."""
    return json.dumps(body).encode()


def _describe(reply: Response, routed: Routed) -> None:
    choice, warmed = routed.choice, routed.warmed
    reply.headers["x-chunkstore-instance"] = choice.instance.url
    reply.headers["x-chunkstore-route"] = str(choice.reason)
    reply.headers["x-chunkstore-stored-tokens"] = str(choice.stored_tokens)
    reply.headers["x-chunkstore-cold-chunks"] = (
        f"sent={warmed.sent} joined={warmed.joined} failed={warmed.failed}"
    )
