"""A prompt's token IDs, the instance's: its ``/tokenize``, or the router's own tokenizer
where the instance's is proven the same (``tokens``, ``proof``), checked now and then beside
the request it serves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import httpx

from .asked import HEAVY, off_loop
from .instances import Instance
from .metrics import RouterMetrics
from .requests import prompts_of
from .tokens import Tokenizer
from .upstream import GONE, Unreachable


class PromptIds:
    def __init__(
        self,
        http: httpx.AsyncClient,
        metrics: RouterMetrics,
        tokenizer: Tokenizer | None,
        background: set[asyncio.Task[None]],
    ) -> None:
        self.http = http
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.background = background  # the checks beside their requests, cancelled at exit

    async def tokenize(
        self, instance: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """A prompt's token IDs, the instance's (``tokens``: the router's own tokenizer's
        where the instance's is proven the same, ``proof``); None if the instance would not
        give them (the request then goes on as it is, and the instance answers it, its
        error included)."""
        local = self.tokenizer
        if local is not None and local.reads(body) and local.agrees(instance.url):
            ours = await off_loop(len(body["prompt"]) >= HEAVY, local.ids, body)
            self.metrics.tokenized.labels("router").inc()
            if local.due(instance.url):
                self.beside(self._compare(local, instance, body, headers, ours))
            return ours
        found = await self._instance_ids(instance, body, headers)
        self.metrics.tokenized.labels("instance").inc()
        if found is None:
            self.metrics.fallbacks.labels("tokenize_failed").inc()
        return found

    async def tokenize_chat(
        self, instance: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> list[int] | None:
        """A chat request's prompt, rendered and tokenized by the instance."""
        prompts = prompts_of(body, chat=True)
        if isinstance(prompts, str) or not prompts or not isinstance(prompts[0], dict):
            return None
        return await self.tokenize(instance, prompts[0], headers)

    def beside(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

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
            return list(await off_loop(heavy, _token_ids, reply))
        except (ValueError, KeyError, TypeError):
            return None


def _token_ids(reply: httpx.Response) -> list[int]:
    return [int(t) for t in reply.json()["tokens"]]
