"""The router tokenizes a completion's text itself once the instance's tokenizer is proven
to be its own (``chunkstore.router.proof``), and goes back to the instance's ``/tokenize``
when a sampled check finds a text tokenized otherwise, until a proof (holding that text)
passes again. The instance here is a stand-in that parses its ``/tokenize`` and
``/detokenize`` bodies with vLLM's own request models and tokenizes with the tiny model's
tokenizer, and can be told to tokenize otherwise (as a vLLM started with another
``--tokenizer`` does); a real vLLM behind real routers: tests/test_router_prompt.py."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    TokenizeCompletionRequest,
)

from chunkstore.kv.keyspace import KeySpace
from chunkstore.policy.treatment import QualityConfig
from chunkstore.prompts import RagPrompts
from chunkstore.router import app, order
from chunkstore.router.instances import Instance
from chunkstore.router.tokens import Tokenizer


class Tokenizing(BaseHTTPRequestHandler):
    tokenizer: Any = None
    otherwise = False  # one ID more than the tokenizer gives: another tokenizer
    asked: list[str] = []
    completed: list[Any] = []  # the prompts of the completions the router forwarded

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": "m", "max_model_len": 1 << 20}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":  # read as vLLM reads it
            asked = TokenizeCompletionRequest.model_validate(body)
            Tokenizing.asked.append(asked.prompt)
            found = Tokenizing.tokenizer(asked.prompt, add_special_tokens=asked.add_special_tokens)
            ids = found["input_ids"]
            self._answer({"tokens": ids + [7] if Tokenizing.otherwise else ids})
            return
        if self.path == "/detokenize":
            tokens = DetokenizeRequest.model_validate(body).tokens
            self._answer({"prompt": Tokenizing.tokenizer.decode(tokens)})
            return
        Tokenizing.completed.append(body["prompt"])
        self._answer({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})

    def _answer(self, reply: dict) -> None:
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream(tiny_model_dir) -> Iterator[str]:
    Tokenizing.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    Tokenizing.otherwise, Tokenizing.asked, Tokenizing.completed = False, [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Tokenizing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_text_is_tokenized_here_once_the_instance_is_proven_and_there_until_proven_again(
    upstream, tiny_model_dir
) -> None:
    keys = KeySpace.for_model(tiny_model_dir, "float32")
    tokenizer = Tokenizer.for_model(tiny_model_dir)
    tokenizer.check_every = 3
    instance = Instance(upstream, "unix:/nowhere")
    router = app.Router(app.RouterSettings(keys, [instance], tokenizer=tokenizer))
    metrics = router.metrics
    assert router.prover is not None

    def count(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(f"chunkstore_router_{name}_total", labels)
        return value or 0.0

    async def ask(n: int) -> None:
        transport = httpx.ASGITransport(app=router.app(), client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body = {"model": "m", "prompt": f"Question {n}: which river?", "max_tokens": 1}
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
        while router._background:  # a check beside the request: let it finish
            await asyncio.sleep(0.01)

    asyncio.run(ask(0))  # not proven: the instance tokenizes, nothing is trusted from it
    assert Tokenizing.asked == ["Question 0: which river?"]
    assert tokenizer.agrees(upstream) is None
    assert asyncio.run(router.prover.prove(instance)) == "identical"
    assert count("tokenizer_proofs", result="identical") == 1
    Tokenizing.asked.clear()
    for n in (1, 2):  # from then on here, without a round trip
        asyncio.run(ask(n))
    assert Tokenizing.asked == []
    assert count("prompts_tokenized", by="router") == 2

    Tokenizing.otherwise = True  # the instance now tokenizes otherwise (restarted so)
    asyncio.run(ask(3))  # the third since: compared beside it, found different
    assert Tokenizing.asked[-1] == "Question 3: which river?"
    assert (count("tokenizer_checks"), count("tokenizer_mismatch")) == (1, 1)
    assert tokenizer.agrees(upstream) is None  # unproven: proven again before it is trusted
    for n in (4, 5):  # every text through the instance
        asyncio.run(ask(n))
    assert Tokenizing.asked[-2:] == [f"Question {n}: which river?" for n in (4, 5)]
    assert asyncio.run(router.prover.prove(instance)) == "differs"
    assert tokenizer.agrees(upstream) is False
    assert count("prompts_tokenized", by="router") == 3
    assert count("prompts_tokenized", by="instance") == 3
    assert count("tokenizer_mismatch") == 1  # counted where found, not per request after


def test_a_text_that_differed_is_one_of_the_next_proofs_probes(upstream, tiny_model_dir) -> None:
    """A sampled text that differs makes the instance unproven; the next proof asks that
    text again beside the probe set, and fails while the instance still differs on it."""
    tokenizer = Tokenizer.for_model(tiny_model_dir)
    text = {"prompt": "Paris is the capital of France.", "add_special_tokens": True}
    tokenizer.proved(upstream, True)
    assert not tokenizer.compared(upstream, text, [1, 2], [1, 3])
    assert tokenizer.agrees(upstream) is None
    assert ("/tokenize", text, tokenizer.ids(text)) in tokenizer.probes(upstream)


def test_an_instance_whose_tokenizer_differs_tokenizes_everything(upstream, tiny_model_dir) -> None:
    Tokenizing.otherwise = True
    keys = KeySpace.for_model(tiny_model_dir, "float32")
    tokenizer = Tokenizer.for_model(tiny_model_dir)
    instance = Instance(upstream, "unix:/nowhere")
    router = app.Router(app.RouterSettings(keys, [instance], tokenizer=tokenizer))
    assert router.prover is not None
    assert asyncio.run(router.prover.prove(instance)) == "differs"
    Tokenizing.asked.clear()

    async def ask(prompt: str | list[Any]) -> None:
        transport = httpx.ASGITransport(app=router.app(), client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body = {"model": "m", "prompt": prompt, "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200

    for prompt in ("one", "two", "three"):
        asyncio.run(ask(prompt))
    assert Tokenizing.asked == ["one", "two", "three"]
    asyncio.run(ask([5, 6, 7]))  # token IDs: nobody tokenizes them
    assert len(Tokenizing.asked) == 3
    samples = router.metrics.registry.get_sample_value
    assert samples("chunkstore_router_tokenizer_proofs_total", {"result": "differs"}) == 1
    assert samples("chunkstore_router_prompts_tokenized_total", {"by": "router"}) == 0


def test_order_sent_ids_is_what_the_router_sends(upstream, tiny_model_dir) -> None:
    """``order.sent_ids``, which ``bench router`` sends straight to compare like with like,
    is the very prompt the router forwards: the client's IDs, relevant document last."""
    keys = KeySpace.for_model(tiny_model_dir, "float32")
    tokenizer = Tokenizer.for_model(tiny_model_dir)
    router = app.Router(
        app.RouterSettings(keys, [Instance(upstream, "unix:/nowhere")], tokenizer=tokenizer)
    )
    prompts = RagPrompts.for_model(tiny_model_dir, "Answer from the documents.")
    docs = [
        "The Danube flows through ten countries.",
        "Paris is the capital of France.",
        "Berlin is the capital of Germany.",
    ]
    text = prompts.text(docs, "Which river flows through ten countries?")

    async def ask() -> None:
        transport = httpx.ASGITransport(app=router.app(), client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body = {"model": "m", "prompt": text, "max_tokens": 1}
            assert (await client.post("/v1/completions", json=body)).status_code == 200

    asyncio.run(ask())
    ids = tokenizer.ids({"prompt": text, "add_special_tokens": True})
    sent = order.sent_ids(keys, QualityConfig(), ids)
    assert sent != ids  # the Danube's document moved last
    assert Tokenizing.completed == [sent]
