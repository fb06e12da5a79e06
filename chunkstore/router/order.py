"""Relevant documents last: the connector's default answers on a back end without its in-band
hook (CUDA, Ascend), by the order of the prompt the instance is sent.

Without the hook a connector can only hand vLLM a prefix: vLLM computes the prompt from its
first token not loaded on, seeing everything before it. So the default's treatment (the
chunks most relevant to the question attended last and recomputed there, seeing the others)
is what vLLM computes when those chunks stand last and the connector loads the run before
them. The router puts them there (``relevant_order``, the policy's own picks: BM25 of the
question against each chunk, the request's ``chunk_scores`` where it gives them), and the
connector, deciding the same picks on the prompt it receives, leaves them to vLLM
(``Treatment.computed_from``). Isolated chunks do not see each other, so the order of the
loaded ones changes no KV; with the hook the connector would move them there itself, and the
KV is the same.

A completion is sent as its reordered token IDs. A chat request's message is rewritten (its
documents' text in the new order) and tokenized again by the instance: it is sent only if
that gives exactly the reordered token IDs, else as it came. An application that forbids
reordering says so in its request (``kv_transfer_params: {"keep_order": true}``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.segments import Segment, SegmentKind, chunk_places, reordered_ids
from chunkstore.policy.selection import NAMED, TransferParams
from chunkstore.policy.treatment import Policy, QualityConfig


def params_of(body: dict[str, Any]) -> TransferParams:
    """The request's ``kv_transfer_params``, parsed (once a body: ``app.Asked``)."""
    return TransferParams.parse(body.get("kv_transfer_params"))


def keeps_order(params: TransferParams, prompts: int) -> bool:
    """Whether the request's order stays: its application says so, or its kv_transfer_params
    name chunks by place for several prompts at once (one order could not serve them all)."""
    return params.keep_order or (prompts > 1 and params.names_chunks)


def policy(keys: KeySpace, quality: QualityConfig) -> Policy:
    """The connector's policy on a back end without the hook (what the router orders for),
    the isolation the keys are made with."""
    return Policy(quality, keys.isolation, keys.virtual_gap).without_hook()


def new_order(
    keys: KeySpace, quality: QualityConfig, ids: Sequence[int], params: Any = None
) -> tuple[list[Segment], list[int]] | None:
    """A chunked prompt's segments and the order (segment indices) that puts its relevant
    chunks last; None where it has no chunks, no question, or keeps its order."""
    segments = keys.segments(ids)
    if not segments or segments[0].kind is not SegmentKind.SYS:
        return None
    order = policy(keys, quality).order(segments, params)
    return None if order is None else (segments, order)


def sent_ids(
    keys: KeySpace, quality: QualityConfig, ids: Sequence[int], params: Any = None
) -> list[int]:
    """The token IDs the router sends for a completion of ``ids``: in their relevant
    order, or as they came."""
    found = new_order(keys, quality, ids, params)
    return list(ids) if found is None else reordered_ids(*found)


def reordered_params(params: Any, order: Sequence[int]) -> Any:
    """The request's kv_transfer_params (as it sent them) with the chunks they name by place
    (0: the first chunk) renamed for the new order; others as they came."""
    if not isinstance(params, dict) or not any(k in params for k in NAMED):
        return params
    places = chunk_places(order)
    was = sorted(places, key=places.__getitem__)  # the chunk each new place holds
    renamed = dict(params)
    scores = params.get("chunk_scores")
    if isinstance(scores, list) and len(scores) == len(was):
        renamed["chunk_scores"] = [scores[c] for c in was]
    named = params.get("recompute_chunks")
    if isinstance(named, list) and all(isinstance(c, int) for c in named):
        renamed["recompute_chunks"] = [places.get(c, c) for c in named]
    return renamed  # malformed ones pass on: the connector ignores them, and says so


def computed_from(
    keys: KeySpace, quality: QualityConfig, ids: Sequence[int], params: Any = None
) -> int | None:
    """Where the instance's vLLM computes a prompt sent in its relevant order (its relevant
    chunks standing last: the connector loads only the run before them); None: all loaded."""
    segments = keys.segments(ids)
    if not segments or segments[0].kind is not SegmentKind.SYS:
        return None
    return policy(keys, quality).treat(segments, params).computed_from(segments)


def chat_messages(
    messages: Any, separator: str, segments: Sequence[Segment], order: Sequence[int]
) -> list[Any] | None:
    """The messages with the documents of the one message holding every separator in the
    new order (its text split at ``separator``); None where no single message's text holds
    them all (the request keeps its order)."""
    if not separator or not isinstance(messages, list):
        return None
    separators = sum(seg.kind is not SegmentKind.QUESTION for seg in segments)
    holding = [
        i
        for i, m in enumerate(messages)
        if isinstance(m, dict) and isinstance(m.get("content"), str) and separator in m["content"]
    ]
    if len(holding) != 1:
        return None
    message = messages[holding[0]]
    parts = message["content"].split(separator)
    if len(parts) != separators + 1:
        return None
    content = separator.join([parts[0], *(parts[i] for i in order), *parts[len(order) + 1 :]])
    rewritten = list(messages)
    rewritten[holding[0]] = message | {"content": content}
    return rewritten
