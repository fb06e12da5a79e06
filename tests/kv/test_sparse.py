"""Block-sparse reads (``chunkstore.kv.sparse``): the summaries bound every score of their
blocks, in the entry's frame wherever the entry is attended (random keys and SmolLM2's own,
rotated by its RoPE); attention over the kept blocks equals a dense reference masked to them
and never reads a block it does not keep; the choice keeps what it must; a block's bytes and
digest in a stored entry."""

from __future__ import annotations

import math

import pytest
import torch
import xxhash

from chunkstore.kv import sparse
from chunkstore.kv.entry import layout_of
from chunkstore.kv.keys import Isolation
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore.reference import HFReference
from tests.kv.test_attended import prompt

ROTARY = RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0)


def scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled scores [Hq, Tq, Tk] of every query against every key (GQA expanded)."""
    group = queries.shape[1] // keys.shape[1]
    expanded = keys.float().repeat_interleave(group, dim=1)
    return torch.einsum("qhd,khd->hqk", queries.float(), expanded) / math.sqrt(keys.shape[-1])


def block_max(score: torch.Tensor, summary: sparse.Summary) -> torch.Tensor:
    """Each block's highest score [Hq, Tq, blocks]."""
    return torch.stack(
        [score[..., slice(*summary.span(b))].amax(-1) for b in range(summary.lo.shape[0])], -1
    )


@pytest.mark.parametrize("tokens,block", [(70, 16), (64, 16), (5, 8)])
def test_a_summary_bounds_every_score_of_its_block(tokens, block) -> None:
    g = torch.Generator().manual_seed(tokens)
    keys = torch.randn(tokens, 2, 64, generator=g) * 3
    queries = torch.randn(6, 4, 64, generator=g)
    summary = sparse.summarize(keys, block)
    assert summary.lo.shape == (-(-tokens // block), 2, 64)
    assert int(summary.lengths.sum()) == tokens
    top = block_max(scores(queries, keys), summary)
    bound = sparse.bounds(queries, summary)
    assert bool((bound >= top - 1e-5).all())
    # A block of one key: the bound is its score exactly.
    single = sparse.summarize(keys[:1], block)
    torch.testing.assert_close(
        sparse.bounds(queries, single)[..., 0], scores(queries, keys[:1])[..., 0]
    )


def test_the_bound_holds_where_the_entry_is_attended_not_where_it_was_computed() -> None:
    """Stored keys rotated at positions 0.., attended ``shift`` further on: the queries
    rotated back score the stored keys as the queries score the moved ones."""
    g = torch.Generator().manual_seed(5)
    stored = torch.randn(90, 2, 64, generator=g)
    queries = torch.randn(7, 4, 64, generator=g)
    shift = 1234
    cos, sin = rotation_table(ROTARY, shift, stored.shape[0])
    moved = rotate_keys(stored, cos, sin, ROTARY, out=torch.empty_like(stored))
    back = sparse.queries_in_entry_frame(queries, shift, ROTARY)
    torch.testing.assert_close(scores(back, stored), scores(queries, moved), atol=1e-4, rtol=1e-5)
    summary = sparse.summarize(stored, 16)
    top = block_max(scores(queries, moved), summary)
    assert bool((sparse.bounds(back, summary) >= top - 1e-4).all())


def test_the_bound_holds_on_smollm2s_own_keys_and_queries(smollm2_dir) -> None:
    """Real keys and queries (SmolLM2's RoPE, GQA 9:3), the chunk computed in isolation at
    its own positions and attended where the prompt puts it."""
    reference = HFReference.load(smollm2_dir)
    segments = prompt([12, 70, 33], 9, 5000, seed=2)
    cache = reference.assembled_cache(segments[:-1], Isolation.SYS).kv
    question = segments[-1]
    seen = reference.question_attention(question.token_ids, question.start, cache)
    chunk = segments[2]
    for q, k in zip(seen.queries, seen.keys, strict=True):
        keys = k[chunk.start : chunk.end]
        summary = sparse.summarize(keys, 16)
        top = block_max(scores(q, keys), summary)
        assert bool((sparse.bounds(q, summary) >= top - 1e-4).all())


def dense_reference(queries, keys, values, kept_tokens, own) -> torch.Tensor:
    """Softmax over the kept tokens of the entry and the question's own keys (causal),
    every other entry token masked out: [Tq, Hq, D]."""
    group = queries.shape[1] // keys.shape[1]
    all_k = torch.cat([keys, own[0]]).float().repeat_interleave(group, dim=1)
    all_v = torch.cat([values, own[1]]).float().repeat_interleave(group, dim=1)
    tq, tk = queries.shape[0], keys.shape[0]
    logits = torch.einsum("qhd,khd->hqk", queries.float(), all_k) / math.sqrt(keys.shape[-1])
    seen = torch.ones(queries.shape[1], tq, tk + tq, dtype=torch.bool)
    seen[..., :tk] = kept_tokens.repeat_interleave(group, dim=0)[:, None, :]
    seen[..., tk:] &= torch.ones(tq, tq, dtype=torch.bool).tril()
    probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, all_v)


def test_attention_over_the_kept_blocks_is_a_dense_reference_masked_to_them() -> None:
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(100, 2, 64, generator=g)
    values = torch.randn(100, 2, 64, generator=g)
    queries = torch.randn(5, 6, 64, generator=g)
    own = (torch.randn(5, 2, 64, generator=g), torch.randn(5, 2, 64, generator=g))
    summary = sparse.summarize(keys, 16)
    mask = torch.rand(2, 7, generator=g) < 0.4
    mask[:, 0] = True
    out = sparse.attend(queries, keys, values, mask, summary, own)
    want = dense_reference(queries, keys, values, sparse.token_mask(mask, summary), own)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # What it does not keep, it does not read: unloaded blocks may hold anything.
    unloaded = ~sparse.token_mask(mask, summary).T[..., None].expand_as(keys)
    garbage_k = keys.masked_fill(unloaded, float("nan"))
    garbage_v = values.masked_fill(unloaded, float("inf"))
    torch.testing.assert_close(
        sparse.attend(queries, garbage_k, garbage_v, mask, summary, own), out
    )


def test_the_choice_keeps_the_sink_the_last_block_and_what_a_query_head_needs() -> None:
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(160, 2, 64, generator=g) * 0.1
    needles = torch.randn(2, 64, generator=g)
    keys[40, 0] = needles[0] * 4  # block 2 of KV head 0 holds what its query heads look for
    keys[85, 1] = needles[1] * 4  # block 5 of KV head 1 holds what one of its heads does
    queries = torch.randn(3, 4, 64, generator=g) * 0.1
    queries[:, 0] = queries[:, 1] = needles[0]
    queries[:, 3] = needles[1]  # query head 3 reads through KV head 1, head 2 at random
    summary = sparse.summarize(keys, 16)
    mask = sparse.select(queries, summary, threshold=0.05)
    assert mask.shape == (2, 10)
    assert mask[0].nonzero().squeeze(1).tolist() == [0, 2, 9]
    assert bool(mask[1, 5]) and bool(mask[1, 0]) and bool(mask[1, -1]) and not bool(mask[1, 2])
    assert sparse.density(mask, summary) < 0.5
    nothing = sparse.select(queries, summary, threshold=0.0, kept=[4])
    assert nothing.nonzero()[:, 1].unique().tolist() == [0, 4, 9]
    assert bool(sparse.select(queries, summary, threshold=1.0).all())
    with pytest.raises(ValueError, match="0 to 1"):
        sparse.select(queries, summary, threshold=1.5)
    with pytest.raises(ValueError, match="at least one token"):
        sparse.summarize(keys, 0)


def test_a_stored_summary_is_every_layers_and_reads_back_as_the_layers_own() -> None:
    # As the connector stores it beside a chunk: [layers, blocks, kv heads, head_dim] in the
    # entry's dtype (a min or a max is one of the keys: exact in bf16).
    keys = torch.randn(3, 70, 2, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    lo, hi = sparse.summary_tensors(keys, 16)
    assert lo.shape == hi.shape == (3, 5, 2, 64) and lo.dtype == torch.bfloat16
    for layer, summary in enumerate(sparse.summaries(lo, hi, 16, 70)):
        own = sparse.summarize(keys[layer], 16)
        assert torch.equal(summary.lo, own.lo) and torch.equal(summary.hi, own.hi)
        assert summary.tokens == 70 and summary.lengths.tolist() == [16.0] * 4 + [6.0]
    with pytest.raises(ValueError, match="has 4 blocks a layer"):
        sparse.summaries(lo, hi, 16, 64)  # read as another entry's


def test_exact_shares_are_the_questions_attention_summed_by_block() -> None:
    g = torch.Generator().manual_seed(5)
    queries, keys = torch.randn(3, 4, 64, generator=g), torch.randn(70, 2, 64, generator=g)
    shares = sparse.exact_shares(queries, keys, 16)
    probs = scores(queries, keys).softmax(-1).mean(1)  # [Hq, tokens]
    summary = sparse.summarize(keys, 16)
    expected = torch.stack([probs[:, slice(*summary.span(b))].sum(-1) for b in range(5)], -1)
    torch.testing.assert_close(shares, expected)
    # Kept until the threshold: the share a KV head's query heads cover is at least it.
    mask = sparse.choose(shares, 2, 0.6)
    covered = (shares * mask.repeat_interleave(2, 0)).sum(-1)
    assert (covered >= 0.6 - 1e-6).all()


def test_refine_chooses_by_the_exact_attention_over_the_candidates_keys_only() -> None:
    """Every block a candidate: ``choose`` on the exact shares. Some: the same on the
    shares over the candidates' keys alone (the rest, never read, hold none); what it
    keeps is among the candidates, the first and last block always."""
    g = torch.Generator().manual_seed(6)
    queries, keys = torch.randn(3, 4, 64, generator=g), torch.randn(150, 2, 64, generator=g)
    summary = sparse.summarize(keys, 16)  # 10 blocks, the last of 6 tokens
    every = sparse.refine(queries, keys, range(10), summary, 0.6)
    assert torch.equal(every, sparse.choose(sparse.exact_shares(queries, keys, 16), 2, 0.6))
    candidates = [0, 2, 3, 7, 9]
    rows = torch.cat([torch.arange(*summary.span(b)) for b in candidates])
    some = sparse.refine(queries, keys[rows], candidates, summary, 0.6)
    probs = scores(queries, keys[rows]).softmax(-1).mean(1)
    at = [0, 16, 32, 48, 64, 70]
    shares = torch.stack([probs[:, at[i] : at[i + 1]].sum(-1) for i in range(5)], -1)
    assert torch.equal(some[:, candidates], sparse.choose(shares, 2, 0.6))
    assert not some[:, [1, 4, 5, 6, 8]].any() and some[:, [0, 9]].all()
    with pytest.raises(ValueError, match="64 keys for candidates of 70 tokens"):
        sparse.refine(queries, keys[rows][:64], candidates, summary, 0.6)
    # The keys' and the values' spans apart, with their digests: what such a load reads.
    k, v = keys[None], torch.randn(1, 150, 2, 64, generator=g)
    blocks = sparse.EntryBlocks.of(layout_of(k, v, 0), 16)
    digests = sparse.block_digests(k, v, 16)
    both = blocks.spans(0, [2, 9])
    assert blocks.spans(0, [2, 9], (0,)) == both[:2] and blocks.spans(0, [9], (1,)) == both[3:]
    assert blocks.expected(digests, 0, [9], (1,)) == blocks.expected(digests, 0, [2, 9])[3:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_block_of_an_entry_has_its_span_and_digest(dtype) -> None:
    """A block's spans are its keys' and values' bytes in the entry as the store lays it out
    (keys, then values), and its digests are theirs: what a sparse read copies and checks.
    The digests survive the trip through an entry of float32 bits."""
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(3, 37, 2, 8, generator=g).to(dtype) for _ in range(2))
    data = torch.cat([keys.reshape(-1), values.reshape(-1)]).view(torch.uint8).numpy()
    blocks = sparse.EntryBlocks.of(layout_of(keys, values, 5), 16)
    assert blocks.count == 3
    digests = sparse.block_digests(keys, values, 16)
    assert digests.shape == (2, 3, 3)
    assert torch.equal(sparse.digests_of(*sparse.digest_tensors(digests)), digests)
    spans = blocks.spans(2, [2, 0])
    expected = blocks.expected(digests, 2, [2, 0])
    for (lo, hi), want, part in zip(spans, expected, [keys, keys, values, values], strict=True):
        rows = slice(32, 37) if (lo, hi) in (spans[0], spans[2]) else slice(0, 16)
        assert bytes(data[lo:hi]) == part[2, rows].contiguous().view(torch.uint8).numpy().tobytes()
        assert xxhash.xxh3_64_intdigest(bytes(data[lo:hi])) == want
    with pytest.raises(ValueError):
        blocks.spans(3, [0])
    with pytest.raises(ValueError):
        blocks.spans(0, [3])
