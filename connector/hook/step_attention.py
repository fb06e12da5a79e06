"""The isolation hook's attention of one layer of a split step (worker process), its phases
in the order the isolation semantics need (docs/isolation-hook.md; the hook's own
docstring in ``isolation`` says why each is where it is):

1. the chunk rows (``ChunkBatch``: one call of vLLM's kernel over the hook's cache);
2. the gaps (``Gaps``: their tokens' attention as chunk rows), as their blends reach it;
3. the moved chunks (``Move``: their keys rotated where they stand in the cache);
4. the recomputed tokens and the rows computed in place (``Recompute``);
5. every other row through vLLM's kernel (``KernelBatch``), and with question re-weighting
   the rows after the chunks (``HookRows``: partial attentions merged by log-sum-exp).

Each phase takes the layer's ``LayerCall`` (vLLM's kernel and settings for the layer);
none touches vLLM's objects itself.
"""

from __future__ import annotations

import torch

from chunkstore.kv.attention import KeyBlock, attention_after_context
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import rotation_table

from ..cpu_layout import CpuKVLayout
from ..sparse_reads import SparseReads
from .recompute import Blend, Recomputer
from .step_split import ChunkBatch, Gaps, HookRows, Recompute, Reordered, StepSplit
from .vllm_attention import QKV, KernelBatch, LayerCall


class StepAttention:
    """One layer's attention of a split step, phase by phase, in the cache ``layout``, each
    layer's keys rotated with its own rotary (``rotary``); the question rows' chunks at
    ``temperature`` and ``log_scale`` (question re-weighting)."""

    def __init__(
        self,
        layout: CpuKVLayout,
        rotary: LayerRotary,
        temperature: float,
        log_scale: float,
        sparse: SparseReads | None = None,
    ) -> None:
        self.layout = layout
        self.rotary = rotary
        self.temperature = temperature
        self.log_scale = log_scale
        self.sparse = sparse  # reads the blocks of chunks loaded sparse, layer by layer

    def attend(
        self,
        split: StepSplit,
        call: LayerCall,
        qkv: QKV,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        recomputer: Recomputer | None,
        riding: int,
    ) -> None:
        """The chunk rows first (they read their chunks' isolated KV), then the gaps, then
        the moved chunks (their keys rotated), then the recomputed tokens and the rows
        computed in place (they overwrite the isolated KV, attended where it was moved), then
        the causal rows (they read the blend, the chunks where they moved). The gaps' and
        recomputed tokens of every request ride at the end of the batch (``riding`` rows,
        ``Recomputer.ride``) or go through each layer's projections and MLP in a pass of
        their own (``Recomputer.layer``)."""
        query = qkv[0]
        if split.chunks is not None:
            self.attend_chunks(split, call, query, kv_cache, output)
        recomputes = {id(r.blend): r for r in split.recomputes if r.blend is not None}
        gaps = {id(gap.blend): gap for gap in split.gaps}
        moved = False

        def attend(blend: Blend, q: torch.Tensor) -> torch.Tensor:
            gap = gaps.get(id(blend))
            if gap is not None:
                return self._attend_gap(split, gap, call, kv_cache, q)
            recompute = recomputes[id(blend)]
            return self._attend_recomputed(split, recompute, call, query, kv_cache, output, q)

        def between(blend: Blend) -> None:
            nonlocal moved
            if not moved and id(blend) not in gaps:
                self._move(split, call, kv_cache)
                moved = True

        blends = split.blends()
        if blends and riding:
            assert recomputer is not None
            q, k, v = (rows[-riding:] for rows in qkv)
            out = recomputer.attend(blends, call.index, kv_cache, (q, k, v), attend, between)
            output[-riding:] = out.to(output.dtype)
        elif blends:
            assert recomputer is not None
            recomputer.layer(blends, call.index, kv_cache, attend, between)
        if not moved:
            self._move(split, call, kv_cache)
        for recompute in split.recomputes:  # in-place rows alone, nothing recomputed
            if recompute.blend is None:
                self._attend_recomputed(split, recompute, call, query, kv_cache, output, query[:0])
        if split.kernel is not None:
            self._kernel(split.kernel, call, query, kv_cache, output)
        self.attend_rows(split, split.rows, call, query, kv_cache, output)

    def _move(self, split: StepSplit, call: LayerCall, kv_cache: torch.Tensor) -> None:
        """The moved chunks' keys rotated in the cache (after the gaps' KV is written, before
        the recomputed tokens' is)."""
        kind = self.rotary.kind(call.index)
        for move in split.moves:
            keys, values = self.layout.read(kv_cache, move.slots)
            self.layout.write_rotated(
                call.name,
                kv_cache,
                keys,
                values,
                move.slots,
                move.rotations[kind],
                self.rotary.kinds[kind],
            )

    def attend_chunks(
        self,
        split: StepSplit,
        call: LayerCall,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """The chunk rows, all in one call of vLLM's kernel over the hook's cache (written
        each layer: what each chunk sees, its sys rotated)."""
        chunks = split.chunks
        assert chunks is not None
        if split.chunk_cache is None:
            split.chunk_cache = self._zeros(kv_cache, chunks.blocks)
        sub_output = self._isolated(split, chunks, split.chunk_cache, call, query, kv_cache)
        output.index_copy_(0, chunks.batch.rows, sub_output)

    def _attend_gap(
        self,
        split: StepSplit,
        gap: Gaps,
        call: LayerCall,
        kv_cache: torch.Tensor,
        q: torch.Tensor,
    ) -> torch.Tensor:
        """The gaps' queries ``q`` (their KV written), as chunk rows."""
        if gap.cache is None:
            gap.cache = self._zeros(kv_cache, gap.chunks.blocks)
        return self._isolated(split, gap.chunks, gap.cache, call, q, kv_cache)

    @staticmethod
    def _zeros(kv_cache: torch.Tensor, blocks: int) -> torch.Tensor:
        """A cache of the hook's own. Zeros: the kernel reads whole blocks, and what lies
        past a chunk's last position must not be NaN (a masked score times garbage). Every
        layer writes the same slots, so the rest stays zero."""
        _, heads, block_size, width = kv_cache.shape
        return kv_cache.new_zeros((blocks, heads, block_size, width))

    def _isolated(
        self,
        split: StepSplit,
        chunks: ChunkBatch,
        cache: torch.Tensor,
        call: LayerCall,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``chunks``' rows of ``query`` under the isolation mask: what each
        chunk sees copied into ``cache`` (its sys rotated), then one call of vLLM's kernel."""
        keys, values = self.layout.read(kv_cache, chunks.sources)
        for start, count, shift in chunks.shifts:
            span = slice(start, start + count)
            keys[span] = self._shifted(split, call, keys[span], shift)
        self.layout.write(call.name, cache, keys, values, chunks.slots)
        return call.paged(chunks.batch, query.index_select(0, chunks.batch.rows), cache)

    def _attend_recomputed(
        self,
        split: StepSplit,
        recompute: Recompute,
        call: LayerCall,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        q: torch.Tensor,
    ) -> torch.Tensor:
        """The recomputed tokens' queries ``q`` and the in-place rows' in one causal call:
        the in-place rows' outputs go to ``output``, the recomputed tokens' are returned."""
        own = recompute.in_place
        if own is not None:
            rows = query.index_select(0, own.rows)
            for at, count, shift in own.shifts:
                rows[at : at + count] = self._shifted(split, call, rows[at : at + count], shift)
            q = torch.cat([q, rows.to(q.dtype)])
        how = recompute.how
        if isinstance(how, Reordered):
            out = self._reordered(how, call, kv_cache, q)
        else:
            out = torch.empty_like(q)
            out[how.rows] = call.paged(how, q[how.rows], kv_cache)
        if own is None:
            return out
        blended = out.shape[0] - own.rows.shape[0]
        output.index_copy_(0, own.rows, out[blended:].to(output.dtype))
        return out[:blended]

    def attend_rows(
        self,
        split: StepSplit,
        hook_rows: list[HookRows],
        call: LayerCall,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """The hook's rows as partial attentions (their sys, their chunks re-weighted, their
        own run) merged by log-sum-exp."""
        for rows in hook_rows:
            own_k, own_v = self._read(kv_cache, rows.block_ids, rows.own_start, rows.end)
            context = []
            if rows.sys_end:
                sys_k, sys_v = self._read(kv_cache, rows.block_ids, 0, rows.sys_end)
                context.append(KeyBlock(self._shifted(split, call, sys_k, rows.sys_shift), sys_v))
            span = slice(rows.row, rows.row + rows.count)
            if rows.chunks_end > rows.sys_end:
                context += [
                    KeyBlock(k, v, self.temperature, self.log_scale)
                    for k, v in self._chunks(rows, call, query[span], kv_cache)
                ]
            output[span] = attention_after_context(
                query[span], own_k, own_v, context, call.scale
            ).to(output.dtype)

    def _chunks(
        self, rows: HookRows, call: LayerCall, queries: torch.Tensor, kv_cache: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of the chunks the rows see, [sys_end, chunks_end), in parts
        (attention over a set of keys: each part a partial attention, their positions in
        their rotations): of a chunk loaded sparse only what was read for this layer (read
        now, chosen by these rows' ``queries``, where this is the first step that needs
        them)."""
        if not rows.sparse:
            return [self._read(kv_cache, rows.block_ids, rows.sys_end, rows.chunks_end)]
        parts, at = [], rows.sys_end
        for read in sorted(rows.sparse, key=lambda r: r.start):
            if self.sparse is not None:
                self.sparse.read_layer(read, call.index, queries, call.scale)
            kept = read.attended(call.index)
            if kept is None:  # attended whole: its read failed, and vLLM computes it
                continue
            if read.start > at:
                parts.append(self._read(kv_cache, rows.block_ids, at, read.start))
            parts.append(kept)
            at = read.end
        if rows.chunks_end > at:
            parts.append(self._read(kv_cache, rows.block_ids, at, rows.chunks_end))
        return parts

    def _read(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end) from vLLM's paged cache."""
        return self.layout.read(kv_cache, self.layout.slots(block_ids, start, end - start))

    def _shifted(
        self, split: StepSplit, call: LayerCall, sys_keys: torch.Tensor, shift: int
    ) -> torch.Tensor:
        """The sys keys as a chunk's queries must see them: rotated by ``p - v``, the
        distance the chunk stands from its virtual start (``virtual_gap`` past sys); or
        in-place rows' queries, rotated to where their chunk is attended. With the layer's
        own rotary (Gemma 3: base 1e4 in sliding layers, 1e6 in global ones)."""
        if shift == 0:
            return sys_keys
        kind = self.rotary.kind(call.index)
        rotary = self.rotary.kinds[kind]
        count = sys_keys.shape[0]  # requests of a step may have sys parts of other lengths
        table = split.rotations.get((kind, shift, count))
        if table is None:
            table = split.rotations[kind, shift, count] = rotation_table(
                rotary, shift, count, sys_keys.device
            )
        return rotate_keys(sys_keys, *table, rotary, out=torch.empty_like(sys_keys))

    def _kernel(
        self,
        batch: KernelBatch,
        call: LayerCall,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        sub_output = call.paged(batch, query.index_select(0, batch.rows), kv_cache)
        output.index_copy_(0, batch.rows, sub_output)

    def _reordered(
        self, order: Reordered, call: LayerCall, kv_cache: torch.Tensor, q: torch.Tensor
    ) -> torch.Tensor:
        """The recomputed tokens' attention where the chunks are attended elsewhere: the
        request's KV up to the chunks' end (the recomputed tokens' written) copied in
        attended order into a cache of its own, and vLLM's kernel over it, causally."""
        _, heads, block_size, width = kv_cache.shape
        whole = len(order.blocks)
        own = kv_cache.new_empty((len(order.batch.block_table[0]), heads, block_size, width))
        torch.index_select(kv_cache, 0, order.blocks, out=own[:whole])
        # Zeros: the kernel reads whole blocks, and what lies past the last position must
        # not be NaN (a masked score times garbage).
        own[whole:].zero_()
        start = whole * block_size
        keys, values = self.layout.read(kv_cache, order.slots[start:])
        positions = torch.arange(start, len(order.slots), dtype=torch.int64)
        self.layout.write(call.name, own, keys, values, positions)
        out = torch.empty_like(q)
        out[order.batch.rows] = call.paged(order.batch, q[order.batch.rows], own)
        return out
