"""Reference attention under the isolation mask, two ways.

``dense_attention`` applies the dense boolean mask with torch SDPA. ``isolated_attention`` uses
only the compact form: each query segment attends to its visible key ranges one at a time, and
the partial results are merged with their log-sum-exp (the online-softmax update
context-parallel attention merges the shards of a sequence with: docs/design.md#sources). The
two must agree; the second is what a kernel without mask support does. Shapes are [tokens,
heads, head_dim]; key and value may have fewer heads than the query (GQA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkstore.kv.keys import Isolation
from chunkstore.kv.masks import KeyRange, SegmentLayout, visible_ranges


def _expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    if x.shape[1] == num_heads:
        return x
    if num_heads % x.shape[1]:
        raise ValueError(f"{num_heads} query heads cannot share {x.shape[1]} KV heads evenly")
    return x.repeat_interleave(num_heads // x.shape[1], dim=1)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key range: (output [Tq, H, Dv], log-sum-exp [Tq, H]).

    With ``causal_offset`` set, query i sees key j only if j <= i + causal_offset. A query
    that sees no key gets output 0 and lse -inf, so it drops out of a merge.
    """
    k = _expand_kv_heads(k, q.shape[1])
    v = _expand_kv_heads(v, q.shape[1])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal_offset is not None:
        qi = torch.arange(q.shape[0], device=q.device)[:, None]
        kj = torch.arange(k.shape[0], device=q.device)[None, :]
        scores = scores.masked_fill(kj > qi + causal_offset, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention outputs over disjoint key sets (online softmax):
    lse = log sum_i exp(lse_i), out = sum_i exp(lse_i - lse) * out_i."""
    stacked = torch.stack(lses)  # [P, Tq, H]
    lse = torch.logsumexp(stacked, dim=0)
    weights = torch.exp(stacked - lse).nan_to_num(0.0)
    out = sum(
        (w[..., None] * o for w, o in zip(weights, outs, strict=True)), torch.zeros_like(outs[0])
    )
    return out, lse


def _attend_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: int,
    ranges: list[KeyRange],
    scale: float,
) -> torch.Tensor:
    outs, lses = [], []
    for r in ranges:
        offset = q_start - r.start if r.causal else None
        o, lse = partial_attention(q, k[r.start : r.end], v[r.start : r.end], scale, offset)
        outs.append(o)
        lses.append(lse)
    return merge_partials(outs, lses)[0]


def isolated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SegmentLayout,
    isolation: Isolation,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a whole chunked prompt from the compact form alone."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outputs = []
    for index, (start, end) in enumerate(layout.bounds()):
        if end == start:
            continue
        ranges = visible_ranges(layout, isolation, index)
        outputs.append(_attend_ranges(q[start:end], k, v, start, ranges, scale))
    return torch.cat(outputs)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention with a dense boolean mask [Tq, Tk] (True = attend), through torch SDPA."""
    k = _expand_kv_heads(k, q.shape[1])
    v = _expand_kv_heads(v, q.shape[1])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def _fused_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` through torch's fused CPU kernel (no score matrix kept); causal is
    top-left: query i sees key j <= i. Shapes as ``partial_attention``'s."""
    tq, heads, dim = q.shape
    kv_heads = k.shape[1]
    if not causal and heads != kv_heads and heads % kv_heads == 0:
        # Every query sees every key: a KV head's query heads as one run of queries over
        # its keys, so the keys are not repeated for each (GQA without the copy).
        group = heads // kv_heads
        grouped = q.view(tq, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            grouped[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, False, scale=scale
        )
        dv = v.shape[-1]
        out = out[0].view(kv_heads, group, tq, dv).permute(2, 0, 1, 3).reshape(tq, heads, dv)
        return out, lse[0].view(kv_heads, group, tq).permute(2, 0, 1).reshape(tq, heads)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None],
        _expand_kv_heads(k, heads).transpose(0, 1)[None],
        _expand_kv_heads(v, heads).transpose(0, 1)[None],
        0.0,
        causal,
        scale=scale,
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return _fused_partial(q, k, v, scale, causal)
    return partial_attention(q, k, v, scale, 0 if causal else None)


@dataclass(frozen=True)
class KeyBlock:
    """Keys a query sees all of, as one part of its attention: their scores are divided by
    ``temperature`` and their softmax weight multiplied by ``exp(log_weight)`` (APE's
    temperature and scale on a parallel context; 1 and 0 leave attention as it is)."""

    keys: torch.Tensor
    values: torch.Tensor
    temperature: float = 1.0
    log_weight: float = 0.0


def attention_after_context(
    q: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    context: Sequence[KeyBlock],
    scale: float,
) -> torch.Tensor:
    """Attention of the last ``len(q)`` tokens of a run of tokens that see each other
    causally (``own_k`` holds the run from its first token to the last query's) and, before
    it, blocks of keys they see whole: a chunk under the isolation mask (its context: sys),
    or a question after isolated chunks (its context: sys, the chunks).

    Partial attentions merged by their log-sum-exp, none of which needs a mask:
    each context block, the own keys before the first query (all visible), and the queries'
    own keys (causal from the top-left). A dense mask would pay for every masked score.
    Rotary positions are the caller's: keys and queries as the scores must see them.
    """
    n, m = q.shape[0], own_k.shape[0]
    if n > m:
        raise ValueError(f"{n} queries but only {m} own keys")
    parts = [_partial(q, own_k[m - n :], own_v[m - n :], scale, causal=True)]
    if m > n:
        parts.append(_partial(q, own_k[: m - n], own_v[: m - n], scale, causal=False))
    for block in context:
        if block.keys.shape[0]:
            out, lse = _partial(q, block.keys, block.values, scale / block.temperature, False)
            parts.append((out, lse + block.log_weight))
    if len(parts) == 1:
        return parts[0][0]
    return merge_partials([o for o, _ in parts], [lse for _, lse in parts])[0]
