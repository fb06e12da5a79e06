"""Prefill/decode through the router (``chunkstore router --prefill URL --decode URL``;
``chunkstore proxy`` is this mode).

A request (completions or chat, one prompt) goes first to a prefill instance (``kv_role:
kv_producer``) for one token: it computes the prompt and stores its exact prefix KV, the
part block after its whole blocks included. Then to a decode instance (``kv_role:
kv_consumer``) as a completion of the prompt's token IDs and that token: the decode instance
loads every prompt token from the store, computes only the first token's KV, and generates
the rest. The client gets one reply as one instance would have given it: joined (text, token
IDs, logprobs, usage), or streamed (the first token as the first event, then the decode
instance's events, in the chat format for a chat request).

Refused with a 400 that says why: ``n`` > 1, several prompts in one request, ``echo``, a chat
without ``max_tokens``. Stop strings are applied by each instance to its own part: one that
spans the first token and the rest is not found.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from .requests import Refused

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


def max_tokens(body: dict[str, Any], chat: bool) -> int:
    name = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    value = body.get(name)
    if value is None:
        if chat:
            raise Refused(400, "set max_tokens: prefill/decode splits a request at its first token")
        return 16  # the OpenAI completions default
    if type(value) is not int or value < 1:
        raise Refused(400, f"{name} must be an integer >= 1, not {value!r:.40}")
    return value


def check(body: dict[str, Any], chat: bool) -> None:
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and (type(value) is not int or value != 1):
            raise Refused(400, f"{name} must be 1 with prefill/decode, not {value!r:.40}")
    if body.get("echo"):
        raise Refused(400, "echo is not supported with prefill/decode")
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            raise Refused(400, "one prompt per request with prefill/decode")


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill instance's request: the client's, for one token, not streamed."""
    prefill = dict(body, max_tokens=1, stream=False, return_token_ids=True)
    prefill.pop("stream_options", None)
    if chat:
        prefill.pop("max_completion_tokens", None)
    return prefill


def decode_body(body: dict[str, Any], chat: bool, prompt: list[int], left: int) -> dict[str, Any]:
    """The decode instance's request: a completion of ``prompt`` (the prompt's token IDs and
    the first token) for the ``left`` tokens still to generate."""
    decode = {k: v for k, v in body.items() if not (chat and k in CHAT_ONLY)}
    decode.update(
        prompt=prompt, max_tokens=left, return_token_ids=bool(body.get("return_token_ids"))
    )
    if chat and body.get("logprobs"):
        decode["logprobs"] = max(int(body.get("top_logprobs") or 0), 1)
    if chat and body.get("stream"):
        decode["stream_options"] = body.get("stream_options") or {}
    least = body.get("min_tokens")
    if type(least) is int and least > 0:
        decode["min_tokens"] = least - 1
    return decode


def chat_logprobs(completion: dict[str, Any] | None) -> list[dict[str, Any]]:
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
            choice["logprobs"] = {"content": content + chat_logprobs(tail.get("logprobs"))}
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
    reply["usage"] = _usage(first, rest)
    return reply


def _usage(first: dict[str, Any], rest: dict[str, Any] | None) -> dict[str, Any]:
    usage = dict(first.get("usage") or {})
    generated = 1 + int(((rest or {}).get("usage") or {}).get("completion_tokens", 0))
    usage["completion_tokens"] = generated
    usage["total_tokens"] = int(usage.get("prompt_tokens", 0)) + generated
    return usage


def only_first(first: dict[str, Any], token_ids: bool) -> dict[str, Any]:
    """The prefill's reply alone (one token was asked for, or it was the last)."""
    if not token_ids:
        head = first["choices"][0]
        head.pop("token_ids", None)
        head.pop("prompt_token_ids", None)
        first.pop("prompt_token_ids", None)
    return first


def prompt_ids(first: dict[str, Any]) -> list[int]:
    head = first["choices"][0]
    ids = first.get("prompt_token_ids") or head.get("prompt_token_ids")
    if not ids:
        raise Refused(502, "the prefill instance returned no prompt_token_ids")
    return [*ids, *head["token_ids"]]


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def first_event(first: dict[str, Any], chat: bool, finish: str | None) -> bytes:
    """The prefill's token as the stream's first event, in the client's format."""
    head = first["choices"][0]
    common = {"id": first.get("id", ""), "created": first.get("created", int(time.time()))}
    common["model"] = first.get("model", "")
    if chat:
        delta = {"role": "assistant", "content": head["message"].get("content") or ""}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if head.get("logprobs"):
            choice["logprobs"] = head["logprobs"]
        return _event({**common, "object": "chat.completion.chunk", "choices": [choice]})
    choice = {"index": 0, "text": head["text"], "finish_reason": finish}
    choice["logprobs"] = head.get("logprobs")
    return _event({**common, "object": "text_completion", "choices": [choice]})


async def relay_events(
    lines: AsyncIterator[str], first: dict[str, Any], chat: bool
) -> AsyncIterator[bytes]:
    """The decode instance's completion events as the client's stream goes on: its id and
    model, chat chunks for a chat request, the whole request's usage."""
    async for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield b"data: [DONE]\n\n"
            return
        event = json.loads(line.removeprefix("data: "))
        event.update(id=first.get("id", event.get("id")), model=first.get("model"))
        event.pop("prompt_token_ids", None)  # the decode's prompt: the client's and a token
        if event.get("usage"):
            event["usage"] = _usage(first, {"usage": event["usage"]})
        if chat:
            event["object"] = "chat.completion.chunk"
            event["choices"] = [_chat_choice(c) for c in event.get("choices") or []]
        yield _event(event)


def _chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    out = {
        "index": choice.get("index", 0),
        "delta": {"content": choice.get("text", "")},
        "finish_reason": choice.get("finish_reason"),
    }
    if choice.get("logprobs"):
        out["logprobs"] = {"content": chat_logprobs(choice["logprobs"])}
    return out
