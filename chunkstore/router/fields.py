"""A request's fields as vLLM's OpenAI server reads them.

vLLM validates a request's body with pydantic models (``CompletionRequest``,
``ChatCompletionRequest``) in pydantic's lax mode: ``"false"``, ``0``, ``"off"`` and ``0.0``
are false, ``2`` or ``"maybe"`` a 400. The router reads the fields that decide the token IDs
from the same validated object where vLLM is installed (an instance's environment has it),
and without vLLM (``pip install chunkstore[router]``) from a model of those fields with
vLLM 0.32's types, which pydantic coerces by the same rules. Python's truthiness read
``"false"`` as true: the router tokenized with BOS a prompt the instance would have run
without it.

A body vLLM refuses (``Unfit``) is passed on untouched, and the instance answers it with
its own 400; the router never rewrites it.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


class Unfit(Exception):
    """A body vLLM's request model refuses (vLLM answers it 400)."""


class _Completion(BaseModel):
    """vLLM 0.32's ``CompletionRequest``, for the fields the router reads."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | None
    ) = None
    prompt_embeds: bytes | list[bytes] | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None


class _Chat(BaseModel):
    """vLLM 0.32's ``ChatCompletionRequest``, for the fields the router reads (its messages
    are the instance's to render: ``/tokenize`` parses them as its chat requests do)."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False


@functools.cache
def request_models() -> tuple[type[BaseModel], type[BaseModel]]:
    """The completion and chat request models: vLLM's own where vLLM is installed, else the
    stand-ins above. Imported at the first request, not with the module: vLLM's import
    brings torch (seconds), and the command line's parser reaches this module."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    except ImportError:
        return _Completion, _Chat
    return CompletionRequest, ChatCompletionRequest


# A chat request's flags that decide its token IDs, as /tokenize is sent them.
CHAT_FLAGS = ("add_generation_prompt", "continue_final_message", "add_special_tokens")


@dataclass(frozen=True)
class Fields:
    """What vLLM reads of a request's prompt."""

    prompt: Any  # a completion's (str, list[str], list[int], list[list[int]]); None: chat
    add_special_tokens: bool
    chat_flags: dict[str, bool]  # a chat's CHAT_FLAGS, as vLLM reads them
    other_prompt: bool  # vLLM runs something else than the prompt's tokens (embeddings,
    # a truncated prompt): the router does no work for it


def read(body: dict[str, Any], chat: bool) -> Fields:
    """``body``'s prompt fields, validated as vLLM validates them (``Unfit`` if it refuses
    them). ``body`` itself is left as it is (vLLM's validators edit what they are given)."""
    try:
        if chat:
            messages = copy.deepcopy(body.get("messages"))  # strings shared, not copied
            request: Any = request_models()[1].model_validate(dict(body, messages=messages))
            flags = {name: bool(getattr(request, name)) for name in CHAT_FLAGS}
            return Fields(None, flags["add_special_tokens"], flags, False)
        request = request_models()[0].model_validate(dict(body))
    except (ValueError, TypeError) as err:  # pydantic's ValidationError is a ValueError
        raise Unfit(str(err)) from None
    other = request.prompt_embeds is not None or request.truncate_prompt_tokens is not None
    return Fields(request.prompt, bool(request.add_special_tokens), {}, other)
