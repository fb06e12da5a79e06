"""Block-sparse reads of a long stored entry (docs/sparse-loads.md; issue 74): which blocks of
its tokens a question needs, chosen from summaries kept beside the entry without reading the
entry, and attention that reads only those blocks.

A summary is Quest's: per layer, block and KV head, the elementwise min and max of the
block's keys as the entry stores them. For a query ``q``, ``sum_d max(q_d lo_d, q_d hi_d)``
is at least ``q . k`` for every key ``k`` of the block, so a block whose bound is low holds
little of the query's attention whatever its keys. A question stands elsewhere than the
entry was computed: RoPE rotations compose, so its queries are rotated back by the entry's
shift (``queries_in_entry_frame``) and scored against the summary as stored.

The choice (``select``) is XAttention's threshold on cumulative attention, with the bound in
place of its antidiagonal estimate: per query head, each block's estimated share of the
question's attention (the softmax over blocks of its scaled bound plus the log of its
length, the mean over the question's rows), the highest first until ``threshold`` of it is
covered; a KV head keeps every block any of its query heads chose (GQA); the attention sink
(the first block) and the last block are always kept.

A sparse read reads only the kept blocks of each layer: it cannot check the entry's checksum
(that needs every byte), so each (layer, block) of the keys and of the values has a digest of
its own (``EntryBlocks``), stored beside the entry with the summary and checked as it is read.

Shapes are [tokens, heads, head_dim] as in ``attention``; summaries [blocks, kv heads,
head_dim] a layer. Pure, float32 inside whatever the inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from chunkstore.kv.attended import kv_head_mass
from chunkstore.kv.attention import merge_partials, partial_attention
from chunkstore.kv.entry import ITEMSIZES, EntryLayout, layout_of
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table

SCORED_ROWS = 64  # question rows scored at a time in exact shares (fits a CPU's cache)


@dataclass(frozen=True)
class Summary:
    """One layer's summary of an entry: per block of ``block`` tokens (the last one shorter
    where the entry does not divide) and KV head, the keys' elementwise min and max."""

    block: int
    tokens: int
    lo: torch.Tensor  # [blocks, kv heads, head_dim]
    hi: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens a block, [blocks]."""
        count = self.lo.shape[0]
        out = torch.full((count,), self.block, dtype=torch.float32)
        out[-1] = self.tokens - self.block * (count - 1)
        return out

    def span(self, index: int) -> tuple[int, int]:
        """Tokens [start, end) of block ``index``."""
        return index * self.block, min((index + 1) * self.block, self.tokens)


def summary_tensors(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An entry's summary as the store keeps it (an entry of its own, ``EntryKind.SUMMARY``,
    the blocks as its tokens, the min as its keys and the max as its values): the keys
    [layers, tokens, kv heads, head_dim] min and max a block, [layers, blocks, kv heads,
    head_dim] each, in the keys' dtype (a min or max is one of the keys: exact in any)."""
    if block < 1:
        raise ValueError(f"a block holds at least one token, not {block}")
    layers, tokens, *rest = keys.shape
    if tokens == 0:
        raise ValueError("an entry of no tokens has no blocks")
    count = -(-tokens // block)
    pad = count * block - tokens
    if pad:  # the last block's own min and max: pad with one of its keys
        keys = torch.cat([keys, keys[:, -1:].expand(layers, pad, *rest)], dim=1)
    blocks = keys.reshape(layers, count, block, *rest)
    return blocks.amin(2), blocks.amax(2)


def summaries(lo: torch.Tensor, hi: torch.Tensor, block: int, tokens: int) -> list[Summary]:
    """The per-layer summaries of a stored summary (``summary_tensors``) of an entry of
    ``tokens`` tokens in blocks of ``block``."""
    if lo.shape != hi.shape or lo.shape[1] != -(-tokens // block):
        raise ValueError(
            f"a summary of {tokens} tokens in blocks of {block} has {-(-tokens // block)} "
            f"blocks a layer, not {tuple(lo.shape)} / {tuple(hi.shape)}"
        )
    return [Summary(block, tokens, a.float(), b.float()) for a, b in zip(lo, hi, strict=True)]


def summarize(keys: torch.Tensor, block: int) -> Summary:
    """The summary of one layer's keys [tokens, kv heads, head_dim] in blocks of ``block``."""
    lo, hi = summary_tensors(keys[None], block)
    return summaries(lo, hi, block, keys.shape[0])[0]


def queries_in_entry_frame(queries: torch.Tensor, shift: int, rotary: RotaryConfig) -> torch.Tensor:
    """``queries`` [Tq, Hq, D] rotated back by ``shift``, the distance from where the entry
    was computed to where it is attended: ``q . R(shift) k == R(-shift) q . k``."""
    q = queries.float()
    if shift == 0:
        return q
    cos, sin = rotation_table(rotary, -shift, q.shape[0], q.device)
    return rotate_keys(q, cos, sin, rotary, out=torch.empty_like(q))


def bounds(queries: torch.Tensor, summary: Summary, scale: float | None = None) -> torch.Tensor:
    """Each query's upper bound on its scaled score against any key of each block,
    [query heads, Tq, blocks]: ``queries`` [Tq, Hq, D] in the entry's frame."""
    tq, heads, dim = queries.shape
    kv_heads = summary.lo.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    group = heads // kv_heads
    # max(q lo, q hi) is q hi where q >= 0, else q lo: two matrix products, no [Tq, Hq, B, D],
    # a KV head's summary once for its group of query heads (not repeated per query head)
    q = queries.float().reshape(tq, kv_heads, group, dim)
    top = torch.einsum("qkgd,bkd->kgqb", q.clamp(min=0), summary.hi) + torch.einsum(
        "qkgd,bkd->kgqb", q.clamp(max=0), summary.lo
    )
    return top.reshape(heads, tq, -1) * (scale or 1 / math.sqrt(dim))  # [Hq, Tq, B]


def estimated_shares(
    queries: torch.Tensor, summary: Summary, scale: float | None = None
) -> torch.Tensor:
    """Each query head's estimated share of its attention on each block [Hq, blocks]: the
    softmax over blocks of bound + log(length), the mean over the question's rows."""
    logits = bounds(queries, summary, scale) + summary.lengths.log()
    return logits.softmax(-1).mean(1)


def exact_shares(
    queries: torch.Tensor, keys: torch.Tensor, block: int, scale: float | None = None
) -> torch.Tensor:
    """Each query head's share of its attention over the entry on each block [Hq, blocks],
    from the keys themselves (the mean over the question's rows of each row's softmax over
    the entry): what ``estimated_shares`` estimates, for measuring the estimate against (it
    reads every key, so it is no way to choose what to load)."""
    tokens = keys.shape[0]
    lengths = torch.full((-(-tokens // block),), block, dtype=torch.int64)
    lengths[-1] = tokens - block * (len(lengths) - 1)
    return _shares_by_run(queries, keys, lengths, scale)


def _shares_by_run(
    queries: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Each query head's share of its attention over ``keys`` [tokens, kv heads, head_dim]
    (the mean over the question's rows of each row's softmax over them) summed over
    consecutive runs of ``lengths`` tokens, [Hq, runs]."""
    tq, heads, dim = queries.shape
    group = heads // keys.shape[1]
    q = (queries.float() * (scale or 1 / math.sqrt(dim))).permute(1, 0, 2)  # [Hq, Tq, D]
    k = keys.float().permute(1, 2, 0)  # [Hkv, D, tokens]
    summed = torch.zeros(heads, keys.shape[0])
    # a query head and up to SCORED_ROWS rows at a time: their scores stay in the CPU's
    # cache through the softmax and the sum (one thread, 4k keys: 1.7x faster than all
    # heads at once at 17 rows, 2.5x at 40)
    for head in range(heads):
        for row in range(0, tq, SCORED_ROWS):
            scores = q[head, row : row + SCORED_ROWS] @ k[head // group]
            summed[head] += scores.softmax(-1).sum(0)
    run = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return torch.zeros(heads, len(lengths)).index_add_(1, run, summed).div_(tq)


def choose(
    shares: torch.Tensor, kv_heads: int, threshold: float, kept: Sequence[int] = ()
) -> torch.Tensor:
    """The blocks each KV head keeps, [kv heads, blocks] bool, from each query head's share
    of its attention on each block ``shares`` [Hq, blocks]: per query head the blocks of
    highest share until ``threshold`` (0 to 1) of it is covered, a KV head's the union of
    its query heads', and the first block, the last and ``kept`` always; 1 keeps every
    block (dense)."""
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold is a share of the attention, 0 to 1: {threshold}")
    if threshold == 1:
        return torch.ones(kv_heads, shares.shape[-1], dtype=torch.bool)
    ranked, order = shares.sort(-1, descending=True)
    before = ranked.cumsum(-1) - ranked  # what the blocks ranked above each cover
    chosen_ranked = before < threshold
    chosen = torch.zeros_like(chosen_ranked).scatter(-1, order, chosen_ranked)
    mask = kv_head_mass(chosen.float(), kv_heads) > 0
    for index in (0, mask.shape[-1] - 1, *kept):
        mask[:, index] = True
    return mask


def select(
    queries: torch.Tensor,
    summary: Summary,
    threshold: float,
    scale: float | None = None,
    kept: Sequence[int] = (),
) -> torch.Tensor:
    """The blocks each KV head keeps, [kv heads, blocks] bool, chosen (``choose``) by the
    summary's estimated shares of the question's attention."""
    kv_heads = summary.lo.shape[1]
    if threshold == 1:
        return choose(torch.empty(0, summary.lo.shape[0]), kv_heads, threshold)
    return choose(estimated_shares(queries, summary, scale), kv_heads, threshold, kept)


def refine(
    queries: torch.Tensor,
    keys: torch.Tensor,
    candidates: Sequence[int],
    summary: Summary,
    threshold: float,
    scale: float | None = None,
) -> torch.Tensor:
    """The blocks each KV head keeps, [kv heads, blocks] bool, among ``candidates`` (block
    indices, ascending, the first and the last block among them): ``choose`` on the
    question's exact shares of its attention over the candidates' keys ``keys`` [their
    tokens in that order, kv heads, head_dim] (the entry's frame, as ``queries``), the
    blocks outside taken to hold none of it. A sparse load reads the candidates' keys only,
    then the values of what this keeps: the bound narrows, the keys decide."""
    kv_heads = keys.shape[1]
    index = torch.tensor(list(candidates), dtype=torch.int64)
    lengths = summary.lengths.index_select(0, index).long()
    if int(lengths.sum()) != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys for candidates of {int(lengths.sum())} tokens")
    picked = choose(_shares_by_run(queries, keys, lengths, scale), kv_heads, threshold)
    mask = torch.zeros(kv_heads, summary.lo.shape[0], dtype=torch.bool)
    mask[:, index] = picked
    return mask


def density(mask: torch.Tensor, summary: Summary) -> float:
    """The share of the entry's (KV head, token) pairs the mask keeps."""
    tokens = (mask.float() * summary.lengths).sum()
    return float(tokens / (summary.tokens * mask.shape[0]))


def token_mask(mask: torch.Tensor, summary: Summary) -> torch.Tensor:
    """The block mask [kv heads, blocks] per token, [kv heads, tokens]."""
    return mask.repeat_interleave(summary.block, dim=1)[:, : summary.tokens]


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    summary: Summary,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The question's attention over the entry's kept blocks only, then its own keys
    causally: ``queries`` [Tq, Hq, D], the entry's ``keys`` and ``values`` [T, Hkv, D] as
    attended (only kept blocks are read: the rest may be anything, unloaded), ``own`` the
    question's keys and values [Tq, Hkv, D]. Per KV head its blocks' partial attention, then
    the question's own, merged by log-sum-exp. Returns [Tq, Hq, D]."""
    tq, heads, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scale = scale or 1 / math.sqrt(dim)
    q = queries.float()
    rows = token_mask(mask, summary)
    out = torch.empty(tq, heads, values.shape[-1], dtype=torch.float32)
    for head in range(kv_heads):
        taken = rows[head].nonzero().squeeze(1)
        group_q = q[:, head * group : (head + 1) * group]
        k = keys.index_select(0, taken)[:, head : head + 1].float()
        v = values.index_select(0, taken)[:, head : head + 1].float()
        parts = [partial_attention(group_q, k, v, scale)]
        if own is not None:
            own_k, own_v = (x[:, head : head + 1].float() for x in own)
            parts.append(partial_attention(group_q, own_k, own_v, scale, causal_offset=0))
        merged, _ = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
        out[:, head * group : (head + 1) * group] = merged
    return out


@dataclass(frozen=True)
class EntryBlocks:
    """An entry's bytes (``kv.entry``'s layout: keys [layers, tokens, kv heads, head_dim],
    then values) by block of ``block`` tokens: per layer and block, the span of its keys and
    the span of its values, each the unit a sparse read copies and checks."""

    layers: int
    tokens: int
    row: int  # bytes of a token's keys in one layer (kv heads x head_dim x item size)
    block: int

    @classmethod
    def of(cls, layout: EntryLayout, block: int) -> EntryBlocks:
        if layout.kind != "kv" or layout.packing:
            raise ValueError(f"only token-major KV entries are read by block, not {layout}")
        if block < 1:
            raise ValueError(f"a block holds at least one token, not {block}")
        row = layout.num_kv_heads * layout.head_dim * ITEMSIZES[layout.dtype]
        return cls(layout.num_layers, layout.num_tokens, row, block)

    @property
    def count(self) -> int:
        """Blocks a layer (the last one shorter where the entry does not divide)."""
        return -(-self.tokens // self.block)

    def spans(
        self, layer: int, blocks: Sequence[int], parts: Sequence[int] = (0, 1)
    ) -> list[tuple[int, int]]:
        """The entry's byte spans [lo, hi) of ``layer``'s ``blocks``: their keys, then
        their values (``parts``: 0 keys, 1 values), in the order given."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} of an entry of {self.layers}")
        half = self.layers * self.tokens * self.row
        spans = []
        for part in (p * half for p in parts):
            for index in blocks:
                if not 0 <= index < self.count:
                    raise ValueError(f"block {index} of an entry of {self.count} a layer")
                first = layer * self.tokens + index * self.block
                last = layer * self.tokens + min((index + 1) * self.block, self.tokens)
                spans.append((part + first * self.row, part + last * self.row))
        return spans

    def digests(self, data: np.ndarray) -> torch.Tensor:
        """xxh3-64 of every unit of the entry's bytes ``data`` (uint8), [2 (keys, values),
        layers, blocks] as int64 (the unsigned digests' bits)."""
        out = np.empty((2, self.layers, self.count), dtype=np.uint64)
        for layer in range(self.layers):
            spans = self.spans(layer, range(self.count))
            for at, (lo, hi) in enumerate(spans):
                out[at // self.count, layer, at % self.count] = xxhash.xxh3_64_intdigest(
                    data[lo:hi].data
                )
        return torch.from_numpy(out.view(np.int64))

    def expected(
        self,
        digests: torch.Tensor,
        layer: int,
        blocks: Sequence[int],
        parts: Sequence[int] = (0, 1),
    ) -> list[int]:
        """What ``spans(layer, blocks, parts)`` must hash to, from the entry's ``digests``."""
        index = torch.tensor(list(blocks), dtype=torch.int64)
        picked = digests[list(parts), layer].index_select(1, index).reshape(-1)
        return [int(d) & ((1 << 64) - 1) for d in picked.tolist()]


def block_digests(keys: torch.Tensor, values: torch.Tensor, block: int) -> torch.Tensor:
    """The digests of an entry's units (``EntryBlocks.digests``) from the keys and values
    it is stored from, as the store lays their bytes out."""
    data = np.concatenate(
        [
            t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
            for t in (keys, values)
        ]
    )
    return EntryBlocks.of(layout_of(keys, values, 0), block).digests(data)


def digest_tensors(digests: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The digests [2, layers, blocks] as the store keeps them (an entry of its own,
    ``EntryKind.SUMMARY``, under ``kv.keys.digests_key``): the keys' and the values' as a KV
    pair of float32 [layers, blocks, 1, 2] holding their bits (copied, never computed on)."""
    layers, count = digests.shape[1:]
    bits = digests.contiguous().view(torch.float32).reshape(2, layers, count, 1, 2)
    return bits[0], bits[1]


def digests_of(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``digest_tensors``' inverse: the digests [2, layers, blocks] int64."""
    if keys.dtype != torch.float32 or keys.shape != values.shape or keys.shape[2:] != (1, 2):
        raise ValueError(f"block digests are float32 [layers, blocks, 1, 2], not {keys.shape}")
    both = torch.stack([keys, values]).contiguous()
    return both.view(torch.int64).reshape(2, keys.shape[0], keys.shape[1])
