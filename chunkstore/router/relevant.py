"""A request with each chunked prompt's relevant documents last (``order`` decides; the one
change the router makes to a request), a chat's messages rewritten to match, and the pieces
the instance then loads (the relevant chunks standing last are computed there)."""

from __future__ import annotations

import dataclasses
from typing import Any

from chunkstore.kv.keyspace import KeySpace, Plan
from chunkstore.kv.segments import Segment, reordered_ids
from chunkstore.policy.treatment import QualityConfig

from . import order
from .asked import Asked, Prompt, off_loop
from .instances import Instance
from .metrics import RouterMetrics
from .prompt_ids import PromptIds
from .upstream import dumps

Moved = tuple[Prompt, list[Segment], list[int]]  # a prompt as sent, its segments, its order


class RelevantLast:
    def __init__(
        self, keys: KeySpace, quality: QualityConfig, metrics: RouterMetrics, ids: PromptIds
    ) -> None:
        self.keys = keys
        self.quality = quality
        self.metrics = metrics
        self.ids = ids

    async def reorder(
        self, instance: Instance, ask: Asked, prompts: list[Prompt]
    ) -> tuple[Asked, list[Prompt]]:
        """The request with each prompt's relevant chunks last (``order``), and its prompts
        as sent; as it came where its order stays."""
        if order.keeps_order(ask.params, len(prompts)):
            return ask, prompts
        salt = str(ask.body.get("cache_salt") or "")
        found = await off_loop(ask.heavy, lambda: [self._moved(p, ask, salt) for p in prompts])
        moved = [f for f in found if f is not None]
        if not moved:
            return ask, prompts
        sent = [p if f is None else f[0] for p, f in zip(prompts, found, strict=True)]
        rewritten = await self._rewritten(instance, ask, moved, [ids for ids, _ in sent])
        if rewritten is None:
            self.metrics.order_kept.labels("chat_text").inc()
            return ask, prompts
        self.metrics.reordered.labels("chat" if ask.chat else "completion").inc()
        raw = await off_loop(ask.heavy, dumps, rewritten)
        return dataclasses.replace(ask, raw=raw, body=rewritten), sent

    def _moved(self, prompt: Prompt, ask: Asked, salt: str) -> Moved | None:
        found = order.new_order(self.keys, self.quality, prompt[0], ask.params)
        if found is None:
            return None
        ids = reordered_ids(*found)
        return (ids, self.keys.plan(ids, salt)), *found

    async def _rewritten(
        self, instance: Instance, ask: Asked, moved: list[Moved], new_ids: list[list[int]]
    ) -> dict[str, Any] | None:
        """The body that sends ``new_ids``; None for a chat whose messages cannot be
        rewritten to exactly those IDs (the instance's template decides)."""
        body = ask.body
        sent_params = body.get("kv_transfer_params")
        renamed = (
            order.reordered_params(sent_params, moved[0][2]) if len(new_ids) == 1 else sent_params
        )
        if ask.chat:
            _, segments, chunk_order = moved[0]
            messages = order.chat_messages(
                body.get("messages"), self.keys.separator_text, segments, chunk_order
            )
            rewritten = None if messages is None else body | {"messages": messages}
            if (
                rewritten is None
                or await self.ids.tokenize_chat(instance, rewritten, ask.headers) != new_ids[0]
            ):
                return None
        else:
            prompt = new_ids[0] if len(new_ids) == 1 else new_ids
            rewritten = body | {"prompt": prompt}
        if renamed is not sent_params:
            rewritten["kv_transfer_params"] = renamed
        return rewritten

    async def loaded(self, ask: Asked, prompts: list[Prompt]) -> list[Plan]:
        """The prompts' pieces the instance loads: sent in their relevant order, the
        relevant chunks standing last are computed there, not loaded (nor sent cold), but
        for the first one's tokens before its span (``hookless_from``), which load: that
        one is sent cold too, so a cold request is served as a warm one."""
        keys, quality, params = self.keys, self.quality, ask.params

        def loaded(ids: list[int], plan: Plan) -> Plan:
            # The policy again, on the prompt as sent: the connector decides on what it
            # receives, and a moved chunk can decide otherwise where it now stands (the
            # first chunk after sys is causal); a second split and BM25 is what that costs.
            end = order.computed_from(keys, quality, ids, params) if plan.chunked else None
            if end is None:
                return plan
            kept = [p for p in plan.pieces if p.segment.start < end]
            if kept and kept[-1].segment.end > end:  # loaded up to its span
                kept[-1] = dataclasses.replace(kept[-1], loads=end - kept[-1].segment.start)
            return Plan(tuple(kept), True)

        return list(await off_loop(ask.heavy, lambda: [loaded(*p) for p in prompts]))
