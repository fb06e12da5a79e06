"""What the router reads of an OpenAI request: its prompts, as vLLM will tokenize them.

Every field is read as vLLM reads it (``fields``: its own request models), never by Python's
truthiness. A chat request is rendered and tokenized by the instance itself (``POST
/tokenize`` with the request's messages and template settings), so the token IDs are the
instance's to the last one. A completion's text prompt is tokenized there too (special tokens
added as its completions API adds them; or here, ``tokens``); token IDs are taken as they
are. A prompt the router cannot read (embeddings, a truncated prompt, a shape it does not
know) or a body vLLM refuses is passed on untouched: the instance answers it without the
router's help.
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


def prompts_of(body: dict[str, Any], chat: bool) -> list[list[int] | dict[str, Any]] | str:
    """Each prompt of the request: its token IDs, or the ``/tokenize`` body that gives them;
    else why the router does no work for it (the request is passed on as it is):
    ``refused_fields`` (vLLM refuses the body), ``unparsed`` (the router cannot read it)."""
    # Here, not with the module: pydantic is the router's dependency, and the command line's
    # parser (the device check's machine has no pydantic) reaches this module through limits.
    from . import fields

    try:
        read = fields.read(body, chat)
    except fields.Unfit:
        return "refused_fields"
    model = {"model": body["model"]} if "model" in body else {}
    if chat:
        if not isinstance(body.get("messages"), list):
            return "unparsed"
        asked = {k: body[k] for k in CHAT_TOKENIZE if k in body}
        return [asked | {k: v for k, v in read.chat_flags.items() if k in body} | model]
    prompt = read.prompt
    if read.other_prompt:
        return "unparsed"
    if isinstance(prompt, str) or _is_ids(prompt):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        return "unparsed"
    found: list[list[int] | dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            special = read.add_special_tokens  # a bool, as vLLM read it
            found.append({"prompt": item, "add_special_tokens": special} | model)
        elif _is_ids(item):
            found.append(list(item))
        else:
            return "unparsed"
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
