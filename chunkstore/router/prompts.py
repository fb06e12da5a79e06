"""Admission and a request's prompts: the instance's yes to the caller (``access.Gate``),
then the request's prompts as token IDs, pieces and keys; nothing where the router does not
work for it (it cannot read them, the instance would not tokenize them or would refuse the
request, or they are past the router's bounds: each counted in ``fallbacks``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from fastapi.responses import Response

from chunkstore.kv.keyspace import KeySpace

from .access import Admission, Gate
from .asked import Asked, Prompt, off_loop
from .instances import Instance
from .limits import Limits, would_refuse
from .metrics import RouterMetrics
from .prompt_ids import PromptIds
from .requests import prompts_of
from .upstream import GONE, Unreachable, as_response

log = logging.getLogger("chunkstore.router")


async def admit(
    gate: Gate, instance: Instance, headers: dict[str, str]
) -> Admission | Response | None:
    """The instance's yes to the caller (``access.Gate``); its refusal (401 / 403) as a
    reply to pass back; None where it answers neither (the request then goes on without
    the router's work, and the instance answers it)."""
    try:
        answer = await gate.admit(instance, headers)
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
        return as_response(answer)
    return None


class PromptReader:
    def __init__(
        self, keys: KeySpace, limits: Limits, metrics: RouterMetrics, ids: PromptIds
    ) -> None:
        self.keys = keys
        self.limits = limits
        self.metrics = metrics
        self.ids = ids

    async def read(self, instance: Instance, ask: Asked, admission: Admission) -> list[Prompt]:
        """The request's prompts: their token IDs, pieces and keys; [] where the router does
        not work for it (each counted in ``fallbacks``)."""
        keys, body = self.keys, ask.body
        if not admission.serves(body.get("model")):
            return self._fallback("unknown_model")
        if would_refuse(body) is not None:
            return self._fallback("refused_fields")
        context = admission.context_of(body.get("model"))
        if context is not None and _asks_past(body, context):
            return self._fallback("too_long")
        prompts = await off_loop(ask.heavy, prompts_of, body, ask.chat)
        if isinstance(prompts, str):
            return self._fallback(prompts)  # why it does no work for it (``requests``)
        if len(prompts) > self.limits.max_prompts:
            return self._fallback("too_many_prompts")
        ids = await asyncio.gather(
            *(
                self.ids.tokenize(instance, p, ask.headers) if isinstance(p, dict) else _ready(p)
                for p in prompts
            )
        )
        if any(i is None for i in ids):
            return []
        found = [i for i in ids if i is not None]
        if context is not None and any(len(i) > context for i in found):
            return self._fallback("too_long")
        salt = str(body.get("cache_salt") or "")
        plans = await off_loop(ask.heavy, lambda: [keys.plan(i, salt) for i in found])
        if sum(len(p.pieces) for p in plans) > self.limits.max_chunks:
            return self._fallback("too_many_chunks")
        return list(zip(found, plans, strict=True))

    def _fallback(self, why: str) -> list[Any]:
        self.metrics.fallbacks.labels(why).inc()
        return []


async def _ready(ids: list[int]) -> list[int]:
    return ids


def _asks_past(body: dict[str, Any], context: int) -> bool:
    """Whether the request asks for more output tokens than the model's context holds (vLLM
    refuses it: ``max_tokens`` or ``max_completion_tokens`` > ``max_model_len``)."""
    asked = [body.get(name) for name in ("max_tokens", "max_completion_tokens")]
    return any(type(n) is int and n > context for n in asked)
