"""Who may make the router work, and who may see how it works.

**Callers.** The instance decides who may use it (``vllm serve --api-key``); the router must
not do a request's work, nor say anything about the store, before the instance has said
yes. vLLM guards every path under ``/v1`` and nothing else (its ``/tokenize`` is open), so
before a request's first tokenize, lookup or cold chunk the router asks the instance
``GET /v1/models`` with the caller's own headers: a 200 admits the caller (remembered for
``auth_ttl`` seconds per instance and API key, hashed), anything else is the instance's
answer, passed back as it came with nothing done. The same answer says which models the
instance serves and their context length, which the router checks a request against before
it works for it.

**Operators.** The instance URLs, the daemons' addresses, requests in flight, the store's
content (``x-chunkstore-*`` reply headers: tokens stored, chunks sent) and ``/metrics`` are the
operator's. With ``--operator-token`` they go to a caller presenting it (``Authorization:
Bearer TOKEN`` on ``/metrics`` and ``/health``, ``x-chunkstore-operator: TOKEN`` on a completion);
without one, to callers on the router's own host (loopback), as Redis's protected mode does.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx
from starlette.requests import Request

from .instances import Instance

REMEMBERED = 4096  # admissions kept (instance, API key); the oldest forgotten first


@dataclass(frozen=True)
class Admission:
    """An instance's yes to a caller: the models it serves, each with its context length
    (None where it does not say)."""

    models: dict[str, int | None]

    def context_of(self, model: object) -> int | None:
        if model is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        return self.models.get(str(model)) if model is not None else None

    def serves(self, model: object) -> bool:
        return model is None or str(model) in self.models


class Gate:
    def __init__(self, http: httpx.AsyncClient, ttl: float) -> None:
        self.http = http
        self.ttl = ttl
        self._admitted: OrderedDict[tuple[str, bytes], tuple[float, Admission]] = OrderedDict()

    async def admit(
        self, instance: Instance, headers: dict[str, str]
    ) -> Admission | httpx.Response:
        """The instance's yes (an ``Admission``), or its answer otherwise (its 401, as sent).
        Raises ``httpx`` errors for an instance that cannot be asked."""
        who = (instance.url, hashlib.sha256(headers.get("authorization", "").encode()).digest())
        now = time.monotonic()
        remembered = self._admitted.get(who)
        if remembered is not None and now - remembered[0] < self.ttl:
            return remembered[1]
        reply = await self.http.get(f"{instance.url}/v1/models", headers=headers, timeout=10.0)
        await reply.aread()
        if reply.status_code != 200:
            self._admitted.pop(who, None)
            return reply
        try:
            listed = reply.json()["data"]
            models = {str(m["id"]): _context(m) for m in listed}
        except (ValueError, KeyError, TypeError):
            models = {}  # an instance that lists nothing the router reads: no model checks
        admission = Admission(models)
        self._admitted[who] = (now, admission)
        self._admitted.move_to_end(who)
        while len(self._admitted) > REMEMBERED:
            self._admitted.popitem(last=False)
        return admission


def _context(model: dict[str, object]) -> int | None:
    value = model.get("max_model_len")
    return value if type(value) is int and value > 0 else None


class Operators:
    def __init__(self, token: str | None) -> None:
        if token is not None and not token.strip():
            raise ValueError("an empty operator token would make every caller the operator")
        self.token = token

    def allows(self, request: Request, bearer: bool = False) -> bool:
        """Whether ``request`` is the operator's: it carries the token (``x-chunkstore-operator``;
        with ``bearer``, ``Authorization: Bearer`` too, as Prometheus sends it), or no token is
        set and it comes from this host. A completion's Authorization is the instance's API
        key, never the operator's."""
        if self.token is None:
            host = request.client.host if request.client else ""
            try:
                return ipaddress.ip_address(host).is_loopback
            except ValueError:
                return False
        given = request.headers.get("x-chunkstore-operator", "")
        authorization = request.headers.get("authorization", "")
        if bearer and not given and authorization.lower().startswith("bearer "):
            given = authorization[len("bearer ") :]
        return bool(given) and hmac.compare_digest(given.encode(), self.token.encode())
