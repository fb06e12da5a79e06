"""A request's way through prefill/decode instances (``disagg`` writes their bodies): the
first token from the prefill instance, the rest from the least loaded decode instance;
joined, or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from . import disagg
from .instances import Instance, Instances
from .requests import Refused
from .upstream import GONE, Hold, Unreachable, Upstream, as_response, dumps, json_headers, no_answer

COMPLETIONS = "/v1/completions"


class PrefillDecode:
    def __init__(self, upstream: Upstream, decoders: Instances) -> None:
        self.upstream = upstream
        self.decoders = decoders

    async def answer(
        self, held: Hold, endpoint: str, body: dict[str, Any], chat: bool, headers: dict[str, str]
    ) -> Response:
        """The first token from the held prefill instance (released when it answers), the
        rest from the least loaded decode instance; joined, or streamed."""
        try:
            first = await self.upstream.post_json(
                held.instance, endpoint, disagg.prefill_body(body, chat), headers
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
                rest = await self.upstream.post_json(decoder, COMPLETIONS, decode, headers)
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
        healthy = self.decoders.healthy() or self.decoders.all
        return sorted(healthy, key=lambda i: i.in_flight)

    async def _decode_stream(
        self,
        decoder: Instance,
        decode: dict[str, Any],
        headers: dict[str, str],
        first: dict[str, Any],
        chat: bool,
    ) -> Response:
        http = self.upstream.http
        request = http.build_request(
            "POST",
            f"{decoder.url}{COMPLETIONS}",
            content=dumps(decode),
            headers=json_headers(headers),
        )
        try:
            upstream = await http.send(request, stream=True)
        except GONE:
            raise Unreachable(decoder) from None
        except httpx.HTTPError as err:
            raise no_answer(decoder, "did not answer", err) from None
        if upstream.status_code != 200:
            try:
                await upstream.aread()
            finally:
                await upstream.aclose()
            return as_response(upstream)
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
