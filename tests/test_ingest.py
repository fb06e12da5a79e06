"""``chunkstore ingest`` and the quickstart path: a real ``vllm serve`` with the connector."""

from __future__ import annotations

import json
import subprocess
import sys

from transformers import AutoTokenizer

from chunkstore.client import ChunkStoreClient
from chunkstore.segments import build_chunked_prompt
from chunkstore.testing.daemon import start_daemon
from chunkstore.testing.vllm_server import VllmServer

SYS = "Answer from the documents."
DOCS = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "The Danube flows through ten countries.",
]


def test_ingest_through_vllm_serve_then_a_rag_request_hits(tiny_model_dir, tmp_path) -> None:
    daemon = start_daemon(tmp_path / "daemon", pool_bytes=128 << 20, block_size=1 << 18)
    try:
        server = VllmServer(tiny_model_dir, tmp_path / "vllm", {"address": daemon.unix})
    except BaseException:
        daemon.stop()  # a server that fails to start must not leave the daemon behind
        raise
    try:
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n")

        def ingest() -> dict:
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "chunkstore.cli",
                    "ingest",
                    str(corpus),
                    "--model",
                    str(tiny_model_dir),
                    "--server",
                    server.url,
                    "--sys",
                    SYS,
                    "--address",
                    daemon.unix,
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert run.returncode == 0, run.stderr
            return {**json.loads(run.stdout), "progress": "ingest [" in run.stderr}

        first = ingest()
        assert first == {
            "chunks": 3,
            "tokens": first["tokens"],
            "stored": 3,
            "already_present": 0,
            "failed": 0,
            "progress": True,  # the progress bar was drawn
        }
        assert first["tokens"] > 0
        again = ingest()
        assert (again["stored"], again["already_present"], again["failed"]) == (0, 3, 0)

        tok = AutoTokenizer.from_pretrained(tiny_model_dir)

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

        rag = build_chunked_prompt(encode, SYS, DOCS[::-1], "Which river?", encode("##"))
        with ChunkStoreClient(daemon.unix) as client:
            before = client.stats().hit_tokens
            reply = server.complete(list(rag.token_ids))
            assert reply["choices"][0]["text"] is not None
            # Every segment but the question was found and loaded.
            assert client.stats().hit_tokens - before == rag.segments[-1].start
    finally:
        server.stop()
        daemon.stop()
