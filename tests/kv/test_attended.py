"""What a question attends (``chunkstore.kv.attended``), measured against HF's own attention
probabilities (``output_attentions``, fp32, eager) over the isolated KV chunkstore serves:
on a random tiny Llama (GQA 4:2) and on SmolLM2's real weights (GQA 9:3)."""

from __future__ import annotations

import pytest
import torch

from chunkstore.kv import attended
from chunkstore.kv.attended import Block
from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.reference import HFReference, random_llama


def prompt(lengths: list[int], question: int, vocab: int, seed: int) -> list[Segment]:
    """sys, chunks of ``lengths`` and a question of random tokens, as split."""
    g = torch.Generator().manual_seed(seed)
    segments, start = [], 0
    for index, n in enumerate([*lengths, question]):
        kind = SegmentKind.SYS if index == 0 else SegmentKind.CHUNK
        if index == len(lengths):
            kind = SegmentKind.QUESTION
        ids = tuple(torch.randint(3, vocab, (n,), generator=g).tolist())
        segments.append(Segment(kind, start, ids))
        start += n
    return segments


@pytest.fixture(scope="module", params=["random-llama", "smollm2"])
def reference(request, smollm2_dir) -> HFReference:
    if request.param == "smollm2":
        return HFReference.load(smollm2_dir)
    return HFReference(random_llama(seed=3))


def test_the_questions_attention_is_hfs_and_its_blocks_hold_it(reference) -> None:
    vocab = min(reference.config.vocab_size, 5000)
    segments = prompt([12, 40, 33, 57], 9, vocab, seed=1)
    cache = reference.assembled_cache(segments[:-1], Isolation.SYS).kv  # loaded isolated
    question = segments[-1]
    seen = reference.question_attention(question.token_ids, question.start, cache)
    spans = [(s.start, s.end) for s in segments if s.kind is SegmentKind.CHUNK]
    blocks = attended.blocks_of(spans, 16)
    assert [len(b) for b in blocks] == [16, 16, 8, 16, 16, 1, 16, 16, 16, 9]
    heads = reference.config.num_attention_heads
    for layer, (q, k, hf) in enumerate(
        zip(seen.queries, seen.keys, seen.probabilities, strict=True)
    ):
        assert q.shape == (len(question), heads, k.shape[-1])
        assert k.shape[0] == question.end
        ours = attended.probabilities(q, k)
        torch.testing.assert_close(ours, hf, atol=2e-6, rtol=1e-4, msg=f"layer {layer}")
        mass = attended.block_mass(ours, blocks)
        expected = torch.stack([hf[..., b.start : b.end].sum((-1, -2)) for b in blocks], -1)
        torch.testing.assert_close(mass, expected, atol=1e-5, rtol=1e-4)
        # Every row sums to one: what the blocks miss is sys's and the question's own.
        rest = hf[..., : spans[0][0]].sum((-1, -2)) + hf[..., question.start :].sum((-1, -2))
        torch.testing.assert_close(mass.sum(-1) + rest, torch.full((heads,), float(len(question))))
    # A GQA group's KV head keeps what any of its query heads attends.
    mass = attended.block_mass(attended.probabilities(seen.queries[0], seen.keys[0]), blocks)
    kv_heads = reference.config.num_key_value_heads
    per_kv = attended.kv_head_mass(mass, kv_heads)
    group = heads // kv_heads
    for kv in range(kv_heads):
        assert torch.equal(per_kv[kv], mass[kv * group : (kv + 1) * group].amax(0))


def test_chosen_heads_score_the_blocks_and_a_budget_takes_the_best() -> None:
    # Two layers of three heads over four chunks, three cases; head (1, 2) always puts the
    # answer first, (0, 1) in two cases of three, the others attend what is nearest (last).
    answers = [[0], [2], [1, 3]]
    cases = []
    for answer in answers:
        mass = torch.zeros(2, 3, 4)
        mass[..., 3] = 1.0  # recency
        for chunk in answer:
            mass[1, 2, chunk] = 5.0
        if answer != [2]:
            mass[0, 1, answer] = 3.0
        cases.append(mass)
    assert attended.choose_heads(cases, answers, 2) == [(1, 2), (0, 1)]
    with pytest.raises(ValueError):
        attended.choose_heads(cases, answers[:2], 2)

    blocks = [Block(0, 0, 16), Block(0, 16, 20), Block(1, 20, 36), Block(1, 36, 52)]
    layer = torch.tensor([[1.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 2.0]])  # two heads' mass
    score = attended.scores({5: layer}, [(5, 0), (5, 1)])
    torch.testing.assert_close(score, torch.tensor([0.25, 0.0, 0.75, 1.0]))
    with pytest.raises(ValueError):
        attended.scores({5: layer}, [])
    # 36 tokens: block 3 then 2 (16 + 16), block 0 no longer fits, the 4-token block does.
    assert attended.top_blocks(score, blocks, 36) == [1, 2, 3]
    # Kept first: the sink (block 0), then the best that fit.
    assert attended.top_blocks(score, blocks, 36, kept=[0]) == [0, 1, 3]
    with pytest.raises(ValueError):
        attended.blocks_of([(0, 4)], 0)
