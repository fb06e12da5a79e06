"""``chunkstore proxy``: prefill/decode disaggregation in front of vLLM instances that share
chunkstore daemons (the connector's exact prefix entries carry the KV between them).

A request (``/v1/completions`` or ``/v1/chat/completions``, one prompt, not streamed) goes
first to a prefill instance (``kv_role: kv_producer``) for one token: it computes the prompt
and stores its exact prefix KV, the part block after its whole blocks included. Then to a
decode instance (``kv_role: kv_consumer``) as a completion of the prompt's token IDs and
that token: the decode instance loads every prompt token from the store, computes only the
first token's KV, and generates the rest. The client gets one reply, as one instance would
have answered it (text, token IDs, logprobs and usage joined). Instances are used in turn.

What it does not do: streamed replies, ``n`` > 1, several prompts in one request, ``echo``
(each is refused with a 400 that says so). Stop strings are applied by each instance to
its own part: one that spans the first token and the rest is not found.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("chunkstore.proxy")

PATHS = ("/v1/completions", "/v1/chat/completions")
# Chat fields that mean nothing to a completion of token IDs (the decode request).
CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "response_format",
    "max_completion_tokens",
    "top_logprobs",
    "logprobs",
    "stream_options",
    "echo",
)


class Refused(Exception):
    """The request cannot go through the proxy (HTTP 400, the reason in the body)."""


class Backend(Exception):
    """An instance answered with an error: passed on to the client as it came."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body = status, body


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as err:
        raise Backend(err.code, err.read()) from None


def _max_tokens(body: dict[str, Any], chat: bool) -> int:
    value = body.get("max_completion_tokens") if chat else None
    value = body.get("max_tokens") if value is None else value
    if value is None:
        if chat:
            raise Refused("set max_tokens: the proxy splits a request at its first token")
        return 16  # the OpenAI completions default
    return int(value)


def _check(body: dict[str, Any], chat: bool) -> None:
    if body.get("stream"):
        raise Refused("streamed replies are not supported by the proxy; send stream: false")
    if int(body.get("n") or 1) != 1 or body.get("best_of", 1) not in (1, None):
        raise Refused("n (and best_of) must be 1 through the proxy")
    if body.get("echo"):
        raise Refused("echo is not supported by the proxy")
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            raise Refused("one prompt per request through the proxy")


def _decode_body(body: dict[str, Any], chat: bool, prompt: list[int], left: int) -> dict[str, Any]:
    """The decode instance's request: a completion of ``prompt`` (the prompt's token IDs and
    the first token) for the ``left`` tokens still to generate."""
    decode = {k: v for k, v in body.items() if not (chat and k in CHAT_ONLY)}
    decode.update(prompt=prompt, max_tokens=left, stream=False, return_token_ids=True)
    if chat and body.get("logprobs"):
        decode["logprobs"] = max(int(body.get("top_logprobs") or 0), 1)
    if body.get("min_tokens"):
        decode["min_tokens"] = max(0, int(body["min_tokens"]) - 1)
    return decode


def _chat_logprobs(completion: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A completion's logprobs in the chat reply's form."""
    if not completion:
        return []

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    out = []
    for token, logprob, top in zip(
        completion["tokens"],
        completion["token_logprobs"],
        completion["top_logprobs"] or [],
        strict=False,
    ):
        item = entry(token, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in (top or {}).items()]
        out.append(item)
    return out


def join(
    first: dict[str, Any], rest: dict[str, Any], chat: bool, token_ids: bool
) -> dict[str, Any]:
    """The prefill instance's one-token reply and the decode instance's completion of the
    rest, as one reply (``token_ids``: the client asked for them)."""
    reply = dict(first)
    head, tail = first["choices"][0], rest["choices"][0]
    choice = dict(head)
    choice["finish_reason"] = tail.get("finish_reason")
    choice["stop_reason"] = tail.get("stop_reason")
    if token_ids:
        choice["token_ids"] = list(head.get("token_ids") or []) + list(tail.get("token_ids") or [])
    if chat:
        message = dict(head["message"])
        message["content"] = (message.get("content") or "") + tail["text"]
        choice["message"] = message
        if head.get("logprobs"):
            content = list(head["logprobs"].get("content") or [])
            choice["logprobs"] = {"content": content + _chat_logprobs(tail.get("logprobs"))}
    else:
        choice["text"] = head["text"] + tail["text"]
        if head.get("logprobs") and tail.get("logprobs"):
            a, b = head["logprobs"], tail["logprobs"]
            shift = len(head["text"])
            choice["logprobs"] = {
                "tokens": a["tokens"] + b["tokens"],
                "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
                "top_logprobs": (a["top_logprobs"] or []) + (b["top_logprobs"] or []),
                "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]],
            }
    reply["choices"] = [choice]
    usage = dict(first.get("usage") or {})
    generated = 1 + int((rest.get("usage") or {}).get("completion_tokens", 0))
    usage["completion_tokens"] = generated
    usage["total_tokens"] = int(usage.get("prompt_tokens", 0)) + generated
    reply["usage"] = usage
    return reply


class Proxy:
    """Sends each request to a prefill instance, then to a decode instance (in turn)."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self.prefill: Iterator[str] = itertools.cycle(u.rstrip("/") for u in prefill)
        self.decode: Iterator[str] = itertools.cycle(u.rstrip("/") for u in decode)
        self.decode_urls = [u.rstrip("/") for u in decode]
        self.timeout = timeout
        self._lock = threading.Lock()

    def _next(self, pool: Iterator[str]) -> str:
        with self._lock:
            return next(pool)

    def handle(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        chat = path == "/v1/chat/completions"
        _check(body, chat)
        wanted = _max_tokens(body, chat)
        token_ids = bool(body.get("return_token_ids"))
        prefill = dict(body, max_tokens=1, stream=False, return_token_ids=True)
        if chat:
            prefill.pop("max_completion_tokens", None)
        first = _post(self._next(self.prefill) + path, prefill, self.timeout)
        head = first["choices"][0]
        if wanted <= 1 or head.get("finish_reason") == "stop":
            if not token_ids:
                head.pop("token_ids", None)
                head.pop("prompt_token_ids", None)
                first.pop("prompt_token_ids", None)
            return first
        prompt_ids = first.get("prompt_token_ids") or head.get("prompt_token_ids")
        if not prompt_ids:
            raise Backend(502, b'{"error": "the prefill instance returned no prompt_token_ids"}')
        decode = _decode_body(body, chat, [*prompt_ids, *head["token_ids"]], wanted - 1)
        rest = _post(self._next(self.decode) + "/v1/completions", decode, self.timeout)
        reply = join(first, rest, chat, token_ids)
        if not token_ids:
            reply["choices"][0].pop("prompt_token_ids", None)
            reply.pop("prompt_token_ids", None)
        return reply

    def forward_get(self, path: str) -> tuple[int, bytes]:
        """GET (models, health) from a decode instance."""
        try:
            with urllib.request.urlopen(self.decode_urls[0] + path, timeout=30) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            error = {"error": {"message": message, "type": "BadRequestError", "code": status}}
            self._send(status, json.dumps(error).encode())

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._send(*proxy.forward_get(self.path))

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path not in PATHS:
                self._error(404, f"the proxy serves {' and '.join(PATHS)}, not {self.path}")
                return
            try:
                body = json.loads(raw)
                if not isinstance(body, dict):
                    raise Refused("the request body must be a JSON object")
                reply = proxy.handle(self.path, body)
            except (Refused, json.JSONDecodeError, ValueError, TypeError) as err:
                self._error(400, str(err))
            except Backend as err:
                self._send(err.status, err.body)
            except OSError as err:
                self._error(502, f"an instance could not be reached: {err}")
            else:
                self._send(200, json.dumps(reply).encode())

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug(format, *args)

    return Handler


def serve(host: str, port: int, proxy: Proxy) -> ThreadingHTTPServer:
    """A threaded HTTP server for ``proxy`` (not started: call ``serve_forever``)."""
    server = ThreadingHTTPServer((host, port), _handler(proxy))
    server.daemon_threads = True
    return server
