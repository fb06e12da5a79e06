"""What the router takes from one client, and how much work a request may make it do.

Every bound here has a default a small deployment never reaches (docs/router.md lists them
with the error each returns). Two kinds:

- **Refusals**: a body over ``max_body_bytes`` (413, told by its Content-Length or cut off
  while it is read, never read whole first), a body not read within ``body_timeout`` (408),
  a connection that has not sent its request's headers within ``header_timeout`` (closed), a
  connection over ``max_client_connections`` (503, uvicorn's ``limit_concurrency``).
- **No help**: a request the router would only waste work on is passed on untouched, and the
  instance answers it as it would without the router: more than ``max_prompts`` prompts to
  tokenize or ``max_chunks`` pieces to look up and store, sampling fields the instance refuses,
  a prompt over the model's context. Counted in ``chunkstore_router_fallbacks_total{why}``.

Cold chunks are bounded too: at most ``max_cold_in_flight`` one-token prefills on their way
at once, all requests together (the rest wait their turn), and at most
``max_cold_per_client`` of them for one client (its API key, or its address without one);
a request past its client's share computes the rest itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .requests import Refused

if TYPE_CHECKING:  # the router's own dependencies: `chunkstore --help` runs without them
    from starlette.requests import Request


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 << 20
    body_timeout: float = 60.0  # seconds to read a request's body, once its headers are in
    header_timeout: float = 10.0  # seconds from a connection (or its last reply) to headers
    max_client_connections: int = 1024
    max_prompts: int = 64  # prompts of one request the router tokenizes and plans
    max_chunks: int = 1024  # pieces (chunks, sys, prefix blocks) of one request
    max_cold_in_flight: int = 64  # cold chunks' prefills on their way, all requests
    max_cold_per_client: int = 256  # of those, and waiting for their turn, per client
    auth_ttl: float = 60.0  # seconds an instance's yes to an API key is remembered
    daemon_retry: float = 5.0  # seconds a daemon that failed a lookup is not asked again

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"the router's {name.replace('_', '-')} must be > 0, not {value}")


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request's body, refused (413) as soon as it is known to be too big: from its
    Content-Length before a byte is read, else while it streams in."""
    from starlette.requests import ClientDisconnect

    limit = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"the request body is {declared} bytes; the router takes {limit}")
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise Refused(
                        413, f"the request body is over {limit} bytes, the router's limit"
                    )
                parts.append(part)
    except TimeoutError:
        raise Refused(408, f"the request body took over {limits.body_timeout:g} s") from None
    except ClientDisconnect:
        raise Refused(400, "the client went away before its body ended") from None
    return b"".join(parts)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object (400 for anything else, nesting too deep included)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Refused(400, f"the request body is not JSON: {err}") from None
    except RecursionError:
        raise Refused(
            400, "the request body is not JSON the router reads: nested too deeply"
        ) from None
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object")
    return body


def client_of(request: Request) -> str:
    """Who a request is from, for its share of cold chunks: its API key, else its address."""
    key = request.headers.get("authorization")
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return "addr:" + (request.client.host if request.client else "?")


# Sampling fields the instance checks (vLLM's SamplingParams._verify_args), each: what it must be.
_COUNTS = ("n", "best_of", "max_tokens", "max_completion_tokens", "min_tokens", "logprobs")


def would_refuse(body: dict[str, Any]) -> str | None:
    """Why the instance would refuse this request's sampling fields (None: it may not).
    Stricter than the instance is harmless: such a request is passed on untouched and the
    instance answers it; only the router's work for it is saved."""
    for name in _COUNTS:
        value = body.get(name)
        if value is None or (name == "logprobs" and isinstance(value, bool)):
            continue
        least = 0 if name in ("min_tokens", "logprobs") else 1
        if type(value) is not int or value < least:
            return f"{name} must be an integer >= {least}"
    for name, low, high in (("temperature", 0.0, math.inf), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if type(value) not in (int, float) or not low <= value <= high or math.isnan(value):
            return f"{name} must be a number in [{low:g}, {high:g}]"
    if "stream" in body and body["stream"] is not None and type(body["stream"]) is not bool:
        return "stream must be true or false"
    return None
