"""``chunkstore ingest`` and the quickstart path: a real ``vllm serve`` with the connector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from openai import OpenAI
from transformers import AutoTokenizer

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.fingerprint import fingerprint_of_folder
from chunkstore.kv.keys import Isolation, segment_keys
from chunkstore.kv.segments import build_chunked_prompt
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.prompts import RagPrompts
from chunkstore.reference import HFReference, default_reference
from chunkstore.testing.cli import chunkstore, vllm_bench_serve
from chunkstore.testing.prometheus import (
    PrometheusServer,
    about_the_connector,
    concrete,
    dashboard_queries,
    rule_problem,
)
from chunkstore.testing.scenario import (
    RAG_DOCS,
    RAG_SYS,
    assert_logprobs_match,
    first_token,
)

SYS, DOCS = RAG_SYS, RAG_DOCS


def test_ingest_through_vllm_serve_then_a_rag_request_hits(tiny_model_dir, serve, tmp_path) -> None:
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    server = VllmServer(tiny_model_dir, tmp_path / "vllm", {"address": daemon.unix})
    try:
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n")

        def ingest() -> dict:
            run = chunkstore(
                "ingest", corpus, "--model", tiny_model_dir, "--server", server.url,
                "--sys", SYS, "--address", daemon.unix, timeout=600,
            )  # fmt: skip
            assert run.returncode == 0, run.stderr
            return {**json.loads(run.stdout), "progress": "ingest [" in run.stderr}

        first = ingest()
        assert first == {
            "chunks": 4,
            "tokens": first["tokens"],
            "stored": 4,
            "already_present": 0,
            "failed": 0,
            "progress": True,  # the progress bar was drawn
        }
        assert first["tokens"] > 0
        again = ingest()
        assert (again["stored"], again["already_present"], again["failed"]) == (0, 4, 0)

        # The app's request: a text prompt with the separator written in it ("auto" is ##
        # for this tokenizer), through the openai package; vLLM tokenizes it whole.
        prompts = RagPrompts.for_model(tiny_model_dir, SYS)
        assert prompts.sep_text == "##"
        question = "Which river?"
        segments = prompts.segments(DOCS[::-1], question)
        assert [s.kind for s in segments] == ["sys", *["chunk"] * 4, "question"]
        # The connector's own counters, on vLLM's /metrics: sys and the four chunks stored
        # by the first ingest (once each, however the server batched its requests: those
        # after the first to store sys load it, or race it and find it stored), no failure.
        ingested = server.wait_for_counters({"saved_segments": 5})
        assert ingested["load_failures"] == ingested["save_failures"] == 0
        assert ingested["loaded_tokens"] == ingested["hit_tokens"]
        openai = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        with ChunkStoreClient(daemon.unix) as client:
            before = client.stats().hit_tokens
            reply = openai.completions.create(
                model=server.model,
                prompt=prompts.text(DOCS[::-1], question),
                max_tokens=1,
                temperature=0.0,
                logprobs=20,
                extra_body={"return_tokens_as_token_ids": True},
            )
            # Every segment but the question was found and loaded.
            loaded = segments[-1].start
            assert client.stats().hit_tokens - before == loaded
        ref = HFReference.load(tiny_model_dir)
        reference = default_reference(ref, segments, Isolation.SYS)
        assert_logprobs_match(first_token(reply.choices[0]), reference.logits[-1])
        assert reply.usage.prompt_tokens == len(prompts.token_ids(DOCS[::-1], question))
        expected = ingested["loaded_tokens"] + loaded
        after = server.wait_for_counters({"loaded_tokens": expected, "hit_tokens": expected})
        assert after["lookups"] == ingested["lookups"] + 1
        # Segmentation, as the dashboard shows it: four ingest prompts and the request were
        # chunked; a prompt without the separator is counted apart.
        assert (after["chunked_prompts"], after["unchunked_prompts"]) == (5, 0)
        openai.completions.create(model=server.model, prompt="No separator here", max_tokens=1)
        server.wait_for_counters({"chunked_prompts": 5, "unchunked_prompts": 1})
        assert after["load_seconds"] > ingested["load_seconds"]
        check_cache_salts(server, daemon, corpus, tiny_model_dir, DOCS[::-1], question)
        rag = prompts.token_ids(DOCS[::-1], question)
        check_connector_dashboard_and_rules(tmp_path, server, daemon, rag)
        check_vllm_bench_serve_replays_the_workload(tmp_path, server, daemon)
    finally:
        server.stop()


def check_cache_salts(server, daemon, corpus, model, docs: list[str], question: str) -> None:
    """vLLM's cache_salt keys every entry: chunks ingested with --cache-salt alice are
    loaded by alice's request and by no other's: bob's finds nothing (its hits are a cold
    request's), though the same chunks are stored unsalted too, and what bob's request
    stored is bob's alone (carol finds nothing either)."""
    run = chunkstore(
        "ingest", corpus, "--model", model, "--server", server.url, "--sys", SYS,
        "--address", daemon.unix, "--cache-salt", "alice", "--quiet", timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["stored"] == len(docs)  # new keys: nothing was present
    prompts = RagPrompts.for_model(model, SYS)
    text = prompts.text(docs, question)
    context = prompts.segments(docs, question)[-1].start  # every token but the question's
    openai = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with ChunkStoreClient(daemon.unix) as client:
        for salt, hit in (("bob", 0), ("alice", context), ("carol", 0)):
            before = client.stats().hit_tokens
            openai.completions.create(
                model=server.model,
                prompt=text,
                max_tokens=1,
                temperature=0.0,
                extra_body={"cache_salt": salt},
            )
            assert client.stats().hit_tokens - before == hit, salt
        alice = RagPrompts.for_model(model, SYS, cache_salt="alice")
        assert all(n is not None for n in client.lookup(alice.doc_keys(docs)))  # type: ignore[arg-type]


def check_vllm_bench_serve_replays_the_workload(tmp_path, server, daemon) -> None:
    """The RAG trace ``chunkstore bench workload --dataset`` writes, replayed by vLLM's own
    ``vllm bench serve`` (custom dataset, raw prompts) against vLLM with the connector: every
    request answered, each one a chunked prompt, and documents that come back hit the store."""
    dataset, result = tmp_path / "trace.jsonl", tmp_path / "bench-serve"
    run = chunkstore(
        "bench", "workload", "--model", server.model, "--docs", "8", "--doc-words", "30-60",
        "--requests", "16", "--curve-only", "--curve", "1.0", "--dataset", dataset,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    before = server.counters()
    with ChunkStoreClient(daemon.unix) as client:
        hits = client.stats().hit_tokens
        replay = vllm_bench_serve(
            "--backend", "vllm", "--model", server.model, "--base-url", server.url,
            "--dataset-name", "custom", "--dataset-path", dataset, "--skip-chat-template",
            "--custom-output-len", "-1", "--disable-shuffle", "--num-prompts", "16",
            "--max-concurrency", "4", "--save-result", "--result-dir", result,
            "--result-filename", "result.json",
        )  # fmt: skip
        assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
        hits = client.stats().hit_tokens - hits
    figures = json.loads((result / "result.json").read_text())
    assert (figures["completed"], figures["failed"]) == (16, 0)
    assert figures["total_output_tokens"] == 16 * 8  # the dataset's output_tokens, kept
    after = server.wait_for_counters({"chunked_prompts": before["chunked_prompts"] + 16})
    assert hits > 0 and after["hit_tokens"] > before["hit_tokens"]


LLM_INGEST = """
import dataclasses, json, sys
from vllm import LLM
from chunkstore_vllm.ingest import ingest_with_llm

if __name__ == "__main__":
    model, address, sys_text, docs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    llm = LLM(
        model=model, dtype="float32", enforce_eager=True, max_model_len=2048,
        kv_transfer_config={
            "kv_connector": "ChunkStoreConnector",
            "kv_connector_module_path": "chunkstore_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"address": address, "virtual_gap": 100},
        },
    )
    summaries = [dataclasses.asdict(ingest_with_llm(llm, docs, sys_text)) for _ in range(2)]
    print("SUMMARIES " + json.dumps(summaries), flush=True)
"""


def test_ingest_with_an_llm_object(tiny_model_dir, serve, tmp_path) -> None:
    """The Python API: ``ingest_with_llm`` takes address, separator, model and virtual gap
    from the LLM's own connector config; what it stores is found under the keys the CLI
    computes with that gap, and under no other."""
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    script = tmp_path / "ingest_llm.py"
    script.write_text(LLM_INGEST)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    run = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), daemon.unix, SYS, json.dumps(DOCS)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    [line] = [x for x in run.stdout.splitlines() if x.startswith("SUMMARIES ")]
    first, again = json.loads(line.removeprefix("SUMMARIES "))
    assert (first["stored"], first["already_present"], first["failed"]) == (len(DOCS), 0, 0)
    assert (again["stored"], again["already_present"], again["failed"]) == (0, len(DOCS), 0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    fp = fingerprint_of_folder(tiny_model_dir, "float32")
    prompts = [build_chunked_prompt(encode, SYS, [d], None, encode("##")) for d in DOCS]

    def keys(gap: int) -> list[bytes]:  # sys, chunk for each prompt
        return [
            k
            for p in prompts
            for k in segment_keys(p.segments, fp.model_fp, fp.layout_fp, Isolation.SYS, gap)
            if k is not None
        ]

    with ChunkStoreClient(daemon.unix) as client:
        assert all(entry is not None for entry in client.lookup(keys(100)))
        # sys has one key whatever the gap; no chunk is stored under its gap-0 key.
        found = [entry is not None for entry in client.lookup(keys(0))]
        assert found == [True, False] * len(DOCS)


def check_connector_dashboard_and_rules(tmp_path, server, daemon, rag: list[int]) -> None:
    """A real Prometheus scrapes this vLLM server and the daemon with the project's config:
    the dashboard's connector panels and the connector rules return series."""
    prometheus = PrometheusServer(
        tmp_path / "prometheus",
        [daemon.ready["metrics"]],
        vllm_targets=[server.url.removeprefix("http://")],
    )
    try:
        deadline = time.monotonic() + 60
        connector_panels = [(t, e) for t, e in dashboard_queries() if about_the_connector(e)]
        assert len(connector_panels) >= 5
        while True:
            server.complete(rag)  # traffic, so rates are not empty
            empty = [t for t, e in connector_panels if not prometheus.query(concrete(e))]
            rules = [
                r
                for g in prometheus.api("rules")["groups"]
                for r in g["rules"]
                if about_the_connector(r["query"])
            ]
            problems = [p for p in (rule_problem(prometheus, r) for r in rules) if p]
            if not (empty or problems) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not empty, f"connector panels with no series: {empty}"
        assert len(rules) >= 3 and not problems, problems
        models = prometheus.api(
            "label/model_name/values", **{"match[]": "vllm:chunkstore_lookups_total"}
        )
        assert models == [str(server.model)]
    finally:
        prometheus.stop()
