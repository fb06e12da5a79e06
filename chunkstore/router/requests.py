"""What the router reads of an OpenAI request: its prompts, as vLLM will tokenize them.

A chat request is rendered and tokenized by the instance itself (``POST /tokenize`` with the
request's messages and template settings), so the token IDs are the instance's to the last
one. A completion's text prompt is tokenized there too (special tokens added as its
completions API adds them); token IDs are taken as they are. A prompt the router cannot read
(embeddings, a shape it does not know) is passed on untouched: the instance answers it
without the router's help.
"""

from __future__ import annotations

from typing import Any

# The chat request fields that decide its token IDs (vLLM's TokenizeChatRequest).
CHAT_TOKENIZE = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class Refused(Exception):
    """A request the router does not pass on: HTTP ``status``, the reason in the body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


TOKEN_ID_LIMIT = 1 << 31  # past any vocabulary; what is not below it is the instance's to refuse


def _is_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(t) is int and 0 <= t < TOKEN_ID_LIMIT for t in value)
    )


def prompts_of(body: dict[str, Any], chat: bool) -> list[list[int] | dict[str, Any]] | None:
    """Each prompt of the request: its token IDs, or the ``/tokenize`` body that gives them;
    None if the router cannot read them (the request is passed on as it is)."""
    model = {"model": body["model"]} if "model" in body else {}
    if chat:
        if not isinstance(body.get("messages"), list):
            return None
        return [{k: body[k] for k in CHAT_TOKENIZE if k in body} | model]
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        return None
    found: list[list[int] | dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            special = body.get("add_special_tokens", True)
            found.append({"prompt": item, "add_special_tokens": special} | model)
        elif _is_ids(item):
            found.append(list(item))
        else:
            return None
    return found


def error(status: int, message: str) -> dict[str, Any]:
    """The OpenAI error body, as vLLM writes it."""
    kind = {
        400: "BadRequestError",
        408: "RequestTimeout",
        413: "RequestTooLarge",
        503: "ServiceUnavailable",
    }
    return {
        "error": {
            "message": message,
            "type": kind.get(status, "RouterError"),
            "param": None,
            "code": status,
        }
    }
