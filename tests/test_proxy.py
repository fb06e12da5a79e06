"""Prefill/decode through the router (``chunkstore proxy``) without vLLM: how two replies are
joined into one or streamed as one, and the requests it refuses (with real vLLM instances
behind it: tests/connector/test_prefix.py)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from chunkstore.processes.router import RunningRouter
from chunkstore.router import disagg


def completion(text: list[str], ids: list[int], offset: int, **choice: object) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "".join(text),
                "token_ids": ids,
                "finish_reason": "length",
                "logprobs": {
                    "tokens": text,
                    "token_logprobs": [-0.5] * len(text),
                    "top_logprobs": [{t: -0.5} for t in text],
                    "text_offset": [offset + sum(map(len, text[:i])) for i in range(len(text))],
                },
                **choice,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": len(ids), "total_tokens": 7 + len(ids)},
    }


def test_a_completion_is_joined_as_one_instance_would_have_answered() -> None:
    first = completion([" The"], [10], 20, prompt_token_ids=[1, 2, 3])
    rest = completion([" cat", " sat"], [11, 12], 24)
    rest["usage"]["prompt_tokens"] = 8  # the prompt and the first token
    joined = disagg.join(first, rest, chat=False, token_ids=True)
    choice = joined["choices"][0]
    assert choice["text"] == " The cat sat"
    assert choice["token_ids"] == [10, 11, 12]
    assert choice["logprobs"]["tokens"] == [" The", " cat", " sat"]
    # Offsets count from the reply's text: the rest's move by the first token's text.
    assert choice["logprobs"]["text_offset"] == [20, 28, 32]
    assert joined["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert disagg.join(first, rest, chat=False, token_ids=False)["choices"][0]["text"] == (
        " The cat sat"
    )


def test_a_chat_reply_takes_the_rest_as_its_content_and_logprobs() -> None:
    first = {
        "object": "chat.completion",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi"},
                "token_ids": [5],
                "finish_reason": "length",
                "logprobs": {"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": []}]},
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
    rest = completion([" there", "!"], [6, 7], 2)
    rest["choices"][0]["finish_reason"] = "stop"
    joined = disagg.join(first, rest, chat=True, token_ids=False)
    choice = joined["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi there!"}
    assert choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["Hi", " there", "!"]
    assert choice["logprobs"]["content"][1]["top_logprobs"] == [
        {"token": " there", "logprob": -0.5, "bytes": list(b" there")}
    ]
    assert joined["usage"]["completion_tokens"] == 3


def test_the_decode_request_completes_the_prompt_and_the_first_token() -> None:
    body = {"model": "m", "messages": [], "max_tokens": 9, "logprobs": True, "top_logprobs": 3}
    decode = disagg.decode_body(body, True, [1, 2, 3, 10], 8)
    assert decode == {
        "model": "m",
        "prompt": [1, 2, 3, 10],
        "max_tokens": 8,
        "return_token_ids": False,
        "logprobs": 3,
    }


def test_a_streamed_chat_goes_on_from_the_first_token_in_chat_chunks() -> None:
    first = {
        "id": "chatcmpl-1",
        "model": "m",
        "created": 5,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    }
    head = json.loads(disagg.first_event(first, True, None).removeprefix(b"data: "))
    assert head["object"] == "chat.completion.chunk" and head["id"] == "chatcmpl-1"
    assert head["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    lines = [
        'data: {"id": "cmpl-9", "model": "m", "prompt_token_ids": [1, 2, 7], '
        '"choices": [{"index": 0, "text": " there", "finish_reason": null}]}',
        "",
        'data: {"id": "cmpl-9", "choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}',
        'data: {"id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 3, '
        '"completion_tokens": 2, "total_tokens": 5}}',
        "data: [DONE]",
        'data: {"after": "done"}',
    ]

    async def events() -> list[bytes]:
        async def source():  # the decode instance's lines
            for line in lines:
                yield line

        return [e async for e in disagg.relay_events(source(), first, chat=True)]

    out = asyncio.run(events())
    assert out[-1] == b"data: [DONE]\n\n" and len(out) == 4  # nothing after [DONE]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in out[:-1]]
    assert all(c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert "prompt_token_ids" not in chunks[0]
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:2]] == [" there", "!"]
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    # The whole request's usage: the client's prompt, and the first token counted.
    assert chunks[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


@pytest.fixture(scope="module")
def running(tmp_path_factory) -> Iterator[str]:
    """``chunkstore proxy`` in front of instances that do not exist (nothing here reaches
    them)."""
    router = RunningRouter(
        tmp_path_factory.mktemp("proxy"),
        "--prefill",
        "http://127.0.0.1:9",
        "--decode",
        "http://127.0.0.1:9",
        command="proxy",
    )
    yield router.url
    assert router.stop() == 0


def post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/completions", {"prompt": "a", "n": 2}, 400, "n must be 1"),
        # Wrong types are the client's error (400), not the router's (500).
        ("/v1/completions", {"prompt": "a", "n": "x"}, 400, "n must be 1"),
        ("/v1/completions", {"prompt": "a", "best_of": [2]}, 400, "best_of must be 1"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "y"}, 400, "max_tokens must be"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 1.5}, 400, "max_tokens must be"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens must be"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": {}}, 400, "max_tokens must be"),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "one prompt"),
        ("/v1/completions", {"prompt": "a", "echo": True}, 400, "echo"),
        ("/v1/chat/completions", {"messages": []}, 400, "max_tokens"),
        ("/v1/completions", [1, 2], 400, "JSON object"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 4}, 503, "no instance is up"),
    ],
)
def test_what_the_proxy_cannot_do_is_refused_with_the_reason(
    running, path, body, status, says
) -> None:
    code, reply = post(running + path, body)
    assert code == status
    assert says in reply["error"]["message"]
