"""``chunkstore bench long``: its long cases, that its sparse answers attend exactly the
blocks the choice kept, on the real SmolLM2, and its vLLM engine's rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkstore.bench import qa_cases
from chunkstore.bench.long_reference import LongReference
from chunkstore.bench.quality_prompts import QUESTION_TEXT, SYS_TEXT
from chunkstore.reference import HFReference


def test_long_cases_are_seeded_needles_among_look_alikes() -> None:
    cases = qa_cases.long_cases(2, 2000, 5, seed=1)
    assert cases == qa_cases.long_cases(2, 2000, 5, seed=1)
    assert cases != qa_cases.long_cases(2, 2000, 5, seed=2)
    assert [c.kind for c in cases[:5]] == ["one", "two", "one", "two", "one"]
    documents = [c.documents[0] for c in cases]
    assert len(set(documents)) == 2 and documents[:5] == [documents[0]] * 5
    for case in cases:
        text = case.documents[0]
        assert all(answer in text for answer in case.answers)
    # A fact every ~300 tokens (~230 words), each kind a third of them: look-alike keys.
    first = cases[0].documents[0]
    assert first.count(" lives in ") >= 2 and first.count(" works as a ") >= 2
    # A document's questions ask about different facts while it has them.
    asked = [c.question for c in cases[:4]]  # six facts: 1 + 2 + 1 + 2
    assert len(set(asked)) == len(asked)
    longer = qa_cases.long_cases(1, 8000, 1, seed=1)[0].documents[0]
    assert 3.2 < len(longer.split()) / len(first.split()) < 4.8


@pytest.mark.slow
def test_sparse_answers_attend_only_the_kept_blocks(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = LongReference(HFReference.load(smollm2_dir), [tok.eos_token_id])
    try:
        case = qa_cases.long_cases(1, 700, 1, seed=3)[0]
        encode = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
        engine.store(encode(SYS_TEXT), encode(case.documents[0]), block=16)
        question = encode(QUESTION_TEXT.format(case.question))
        full = engine.answer(question, None, 6)
        # Threshold 1 keeps every block: the masked path is full attention.
        dense = engine.answer(question, 1.0, 6)
        assert dense.tokens == full.tokens and dense.density == 1.0
        torch.testing.assert_close(dense.first_logits, full.first_logits, rtol=1e-5, atol=1e-5)

        sparse = engine.answer(question, 0.3, 6)
        assert 0 < sparse.density < 0.9
        assert engine.mask is not None
        chosen = dict(engine.mask.chosen)
        # Whatever the blocks the choice left stand for, the answer is the same: overwrite
        # them with noise in the cache (the summaries, read at the choice, are kept).
        document = engine.mask.document
        noise = torch.Generator().manual_seed(0)
        for layer, kept in chosen.items():
            cached = engine.cache.layers[layer]
            for store in (cached.keys, cached.values):
                part = store[0, :, document.start : document.stop]  # [Hkv, tokens, D]
                garbage = 50 * torch.randn(part.shape, generator=noise)
                part[~kept] = garbage[~kept]
        again = engine.answer(question, 0.3, 6)
        assert all(
            torch.equal(again_kept, chosen[layer])
            for layer, again_kept in engine.mask.chosen.items()
        )
        assert again.tokens == sparse.tokens
        assert torch.equal(again.first_logits, sparse.first_logits)
        # And the noise is there: attended whole, the document now answers otherwise.
        noisy = engine.answer(question, None, 6)
        assert not torch.allclose(noisy.first_logits, full.first_logits, atol=1e-3)
    finally:
        engine.close()


@pytest.mark.slow
def test_the_vllm_engine_answers_through_the_connectors_sparse_loads(smollm2_dir: Path) -> None:
    """``--engine vllm``: the document stored once through a daemon, then each question
    loaded whole and sparse in one vLLM: every block kept answers as the whole load does and
    reads the whole entry (and its summary); a threshold reads a share of it."""
    import argparse

    from chunkstore.bench.long import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--engine=vllm",
            f"--model={smollm2_dir}",
            "--lengths=700",
            "--documents=1",
            "--questions=2",
            "--methods=bound@1,bound@0.3",
            "--max-tokens=6",
        ]
    )
    full, every, sparse = run(args)
    assert [row["method"] for row in (full, every, sparse)] == ["full", "bound@1", "bound@0.3"]
    assert all(row["engine"] == "vllm-cpu" and row["cases"] == 2 for row in (full, every, sparse))
    assert full["bytes_share"] == 1.0
    assert every["same_as_full"] == 1.0 and every["per_case"] == full["per_case"]
    assert every["bytes_share"] == round(1 + 1 / 16, 3)
    assert sparse["bytes_share"] < 1
    assert all(row["ttft_s"] > 0 for row in (full, every, sparse))
