"""Dense-mask SDPA, LSE-merged isolated attention and HF's masked forward agree (GQA)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AttentionInterface

from chunkstore.kv.attention import (
    KeyBlock,
    attention_after_context,
    dense_attention,
    isolated_attention,
    merge_partials,
    partial_attention,
)
from chunkstore.kv.keys import Isolation
from chunkstore.kv.masks import MaskForm, SegmentLayout, isolation_mask
from chunkstore.kv.segments import SegmentKind
from chunkstore.reference import random_llama


def random_layout(rng: random.Random) -> SegmentLayout:
    chunks = rng.randint(0, 4)
    kinds = [SegmentKind.SYS] + [SegmentKind.CHUNK] * chunks
    if rng.random() < 0.8:
        kinds.append(SegmentKind.QUESTION)
    return SegmentLayout(tuple(kinds), tuple(rng.randint(1, 9) for _ in kinds))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("isolation", list(Isolation))
def test_isolated_attention_equals_dense_sdpa(seed: int, isolation: Isolation) -> None:
    rng = random.Random(seed)
    layout = random_layout(rng)
    heads, kv_heads = rng.choice([(4, 4), (4, 2), (6, 2), (3, 1)])
    torch.manual_seed(seed)
    n = layout.num_tokens
    q, k, v = torch.randn(n, heads, 16), torch.randn(n, kv_heads, 16), torch.randn(n, kv_heads, 16)
    allowed = isolation_mask(layout, isolation, MaskForm.BOOL)
    expected = dense_attention(q, k, v, allowed)
    got = isolated_attention(q, k, v, layout, isolation)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_merge_of_split_keys_equals_attention_over_all() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 2, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    whole, whole_lse = partial_attention(q, k, v, 0.3)
    parts = [partial_attention(q, k[a:b], v[a:b], 0.3) for a, b in [(0, 3), (3, 4), (4, 12)]]
    merged, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-6)


def test_a_part_with_no_visible_key_drops_out_of_the_merge() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    blind = partial_attention(q, k, v, 1.0, causal_offset=-10)  # sees nothing
    assert torch.isinf(blind[1]).all() and not blind[0].isnan().any()
    seen = partial_attention(q, k, v, 1.0)
    merged, _ = merge_partials([blind[0], seen[0]], [blind[1], seen[1]])
    torch.testing.assert_close(merged, seen[0])


def _register(layout: SegmentLayout, isolation: Isolation) -> str:
    """An HF attention implementation driven by the compact form only (the mask is ignored)."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out = isolated_attention(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            layout,
            isolation,
            scaling,
        )
        return out[None], None

    name = f"chunkstore_isolated_{isolation.value}"
    AttentionInterface.register(name, forward)
    return name


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("isolation", list(Isolation))
def test_hf_masked_forward_equals_model_on_isolated_attention(
    seed: int, isolation: Isolation
) -> None:
    rng = random.Random(seed)
    layout = random_layout(rng)
    while SegmentKind.CHUNK not in layout.kinds:
        layout = random_layout(rng)
    model = random_llama(0, vocab_size=97, max_positions=512)
    ids = torch.tensor([[rng.randrange(97) for _ in range(layout.num_tokens)]])
    additive = isolation_mask(layout, isolation, MaskForm.ADDITIVE)[None, None]
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model(ids, attention_mask=additive).logits
        model.set_attn_implementation(_register(layout, isolation))
        ours = model(ids).logits
        model.set_attn_implementation("eager")
        causal = model(ids).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    allowed = isolation_mask(layout, isolation, MaskForm.BOOL)
    if not torch.equal(allowed, torch.ones_like(allowed).tril()):
        assert not torch.allclose(causal, reference, atol=1e-3)  # the mask mattered


@pytest.mark.parametrize(
    ("queries", "own", "context"), [(7, 7, 5), (3, 10, 5), (1, 1, 4), (6, 6, 0), (4, 9, 0)]
)
def test_attention_after_context_equals_the_dense_isolation_mask(queries, own, context) -> None:
    """A chunk's last tokens (a whole chunk, or the tail computed in a later prefill step),
    with and without a sys context, GQA: the same as SDPA under the dense mask."""
    torch.manual_seed(queries * 100 + own * 10 + context)
    q = torch.randn(queries, 6, 16)
    own_k, own_v = torch.randn(own, 2, 16), torch.randn(own, 2, 16)
    ctx_k, ctx_v = torch.randn(context, 2, 16), torch.randn(context, 2, 16)
    allowed = torch.ones(queries, context + own, dtype=torch.bool)
    rows = torch.arange(queries)[:, None] + own - queries
    allowed[:, context:] = torch.arange(own)[None, :] <= rows
    expected = dense_attention(q, torch.cat([ctx_k, own_k]), torch.cat([ctx_v, own_v]), allowed)
    got = attention_after_context(q, own_k, own_v, [KeyBlock(ctx_k, ctx_v)], 16**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_context_block_with_temperature_and_weight_is_reweighted_as_ape_defines() -> None:
    """Scores against a block divided by its temperature, its softmax weight multiplied by
    exp(log_weight): the same as a softmax over explicitly adjusted scores."""
    torch.manual_seed(7)
    q, scale = torch.randn(3, 4, 8), 8**-0.5
    sys_k, sys_v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    chunk_k, chunk_v = torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    own_k, own_v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    temperature, log_weight = 0.8, -0.7
    blocks = [KeyBlock(sys_k, sys_v), KeyBlock(chunk_k, chunk_v, temperature, log_weight)]
    got = attention_after_context(q, own_k, own_v, blocks, scale)
    keys = torch.cat([sys_k, chunk_k, own_k]).repeat_interleave(2, dim=1)
    values = torch.cat([sys_v, chunk_v, own_v]).repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores[:, :, 5:14] = scores[:, :, 5:14] / temperature + log_weight
    scores[:, :, 14:] = scores[:, :, 14:].masked_fill(~torch.ones(3, 3).bool().tril(), -1e30)
    expected = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
