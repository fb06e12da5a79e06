"""Which rows of a step are which, for the isolation hook (worker process): the step's
``StepSplit``, built once per step from vLLM's attention metadata and the step's plans
(``IsolatedStep``), and read by every layer's attention (``step_attention``).

Per planned request: the chunk rows (``HookRows``, all of a step's as one ``ChunkBatch``),
the rows after the chunks the hook computes with question re-weighting, the chunks that
move (``Move``), the recomputed tokens and the chunks computed in place (``Recompute``,
``InPlace``, ``Reordered`` where chunks are attended elsewhere), the gaps (``Gaps``); every
other row goes to vLLM's kernel as a batch of its own (``KernelBatch``). Nothing here
touches the cache: the only thing of vLLM's it calls is the kernel's plan for a batch
(``LayerCall.batch``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from chunkstore.kv.layer_rotary import LayerRotary

from ..common import IsolatedStep, RequestPlan
from ..cpu_layout import CpuKVLayout
from ..sparse_reads import SparseRead
from .recompute import Blend, Recomputer
from .vllm_attention import KernelBatch, LayerCall, StepMetadata


@dataclass(frozen=True)
class HookRows:
    """Rows [row, row + count) of the batch that the hook computes: the last ``count`` tokens
    of a run of positions [own_start, end) that see each other causally, in the request with
    block table ``block_ids``, and the keys they see whole before the run: sys [0, sys_end)
    (none when 0), rotated by ``sys_shift`` positions; for the tokens after isolated chunks,
    with question re-weighting or chunks loaded sparse, the chunks [sys_end, chunks_end)
    too (of a chunk in ``sparse``, the positions it read)."""

    row: int
    count: int
    block_ids: torch.Tensor
    own_start: int
    end: int
    sys_end: int
    sys_shift: int = 0
    chunks_end: int = 0
    # Chunks among [sys_end, chunks_end) loaded sparse: of those, only what was read.
    sparse: tuple[SparseRead, ...] = ()


@dataclass(frozen=True)
class Move:
    """A chunk's keys rotated by ``shift`` positions where they stand in the cache (each
    layer with its own rotary: ``rotations`` holds one table per kind, ``LayerRotary``)."""

    req_id: str
    start: int
    shift: int
    slots: torch.Tensor
    rotations: tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class Reordered:
    """How a request's recomputed tokens attend where its chunks are attended elsewhere
    (``relevant_last``): each sees the keys of the positions [0, chunks' end) attended at or
    before its own (the order the chunks are attended in, not the order they stand in).
    The cache holds them in prompt order, so each layer copies them, in attended order, into
    a cache of the hook's own (``slots``: the request's cache slots in that order), where
    ``batch`` (the recomputed tokens as runs of consecutive attended positions) is causal
    attention for vLLM's kernel. The whole blocks before the first moved position stand where
    they are attended: those (``blocks``, the request's) are copied as blocks."""

    slots: torch.Tensor
    batch: KernelBatch
    blocks: torch.Tensor

    @staticmethod
    def attended(step: IsolatedStep) -> torch.Tensor:
        """Each position's attended position, [0, chunks' end): a permutation."""
        attended = torch.arange(step.chunks[-1][1], dtype=torch.int64)
        for start, stop, shift in step.moves:
            attended[start:stop] += shift
        return attended


@dataclass(frozen=True)
class InPlace:
    """A request's chunk rows computed once, where they are attended (``in_place``):
    ``rows`` of the step's batch, whose queries (rotated by vLLM where they stand) are rotated
    by each (offset in ``rows``, count, shift) in ``shifts`` to their attended positions and
    attend with the recomputed tokens, after them in the query order."""

    rows: torch.Tensor
    shifts: list[tuple[int, int, int]]


@dataclass(frozen=True)
class Recompute:
    """One request's recomputed tokens (``blend``, None when all are ``in_place`` rows)
    and in-place rows (None when none) in one step, and how their queries attend."""

    blend: Blend | None
    in_place: InPlace | None
    how: KernelBatch | Reordered


@dataclass(frozen=True)
class ChunkBatch:
    """A step's chunk rows as one batch for vLLM's kernel, over a cache of the hook's own
    (``blocks`` blocks): each chunk one sub-request whose positions hold, in order, the sys
    keys it sees (rotated by its shift) and its own run; its queries are the run's last, so
    causal attention there is the isolation mask. Each layer copies ``sources`` (slots in
    vLLM's cache: per chunk its sys, then its run) to ``slots`` (in the hook's cache),
    rotating the sys keys of each (start, count, shift) in ``shifts`` on the way."""

    sources: torch.Tensor
    slots: torch.Tensor
    shifts: list[tuple[int, int, int]]
    blocks: int
    batch: KernelBatch


@dataclass
class Gaps:
    """A request's chunks computed here, isolated (``IsolatedStep.gaps``): their tokens
    through vLLM's modules (``blend``), attending as chunk rows (``chunks``, whose rows are
    the blend's queries) over a cache of their own (``cache``, made on the first layer)."""

    blend: Blend
    chunks: ChunkBatch
    cache: torch.Tensor | None = None


@dataclass
class StepSplit:
    rows: list[HookRows]  # the hook's rows after the chunks (question re-weighting)
    kernel: KernelBatch | None
    recomputes: list[Recompute] = field(default_factory=list)
    rotations: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # (rotary kind, shift, tokens) -> the rotation table
    moves: list[Move] = field(default_factory=list)
    chunks: ChunkBatch | None = None
    chunk_cache: torch.Tensor | None = None  # the hook's cache for ``chunks``, for every layer
    gaps: list[Gaps] = field(default_factory=list)

    def blends(self) -> list[Blend]:
        """The tokens the step takes through the layers for the hook, in their order: the
        gaps', then the recomputed ones."""
        return [gap.blend for gap in self.gaps] + [
            r.blend for r in self.recomputes if r.blend is not None
        ]

    def isolated_tokens(self) -> int:
        """The chunk tokens the step serves isolated: its chunk rows and its gaps'."""
        chunk_rows = 0 if self.chunks is None else int(self.chunks.batch.rows.shape[0])
        return chunk_rows + sum(len(gap.blend.positions) for gap in self.gaps)


class StepSplitter:
    """Builds a step's ``StepSplit`` from vLLM's attention metadata and the step's plans,
    with the connector's isolation settings."""

    def __init__(
        self,
        layout: CpuKVLayout,
        rotary: LayerRotary,
        isolate_from_sys: bool,
        virtual_gap: int,
        reweight: bool,
        on_miss: Callable[[str], None],
        placed: Callable[[str], dict[int, int] | None],
        sparse_of: Callable[[str], tuple[SparseRead, ...]] = lambda req_id: (),
    ) -> None:
        self.layout = layout
        self.rotary = rotary
        self.isolate_from_sys = isolate_from_sys
        self.virtual_gap = virtual_gap  # chunks see sys from this far past its end
        self.reweight = reweight
        self.on_miss = on_miss  # a planned request not found in the batch (computed causally)
        # A request's chunks its loads put where they are attended (None: a load failed,
        # so nothing of it moves in this step, which vLLM computes again)
        self.placed = placed
        self.sparse_of = sparse_of  # a request's chunks loaded sparse

    def split(
        self,
        metadata: StepMetadata,
        plans: list[RequestPlan],
        call: LayerCall,
        recomputer: Recomputer | None,
    ) -> StepSplit | None:
        """Which rows of this step's batch are chunk rows, and the batch vLLM's kernel gets
        for the rest; None where no planned request is in the batch."""
        planned = self._locate(metadata, plans)
        if not planned:
            return None
        starts, seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
        hook_rows: list[HookRows] = []
        recomputes: list[Recompute] = []
        gaps: list[Gaps] = []
        moves: list[Move] = []
        runs: list[tuple[int, int, int, int]] = []  # (request, first row, rows, seq_len)
        for r, seq_len in enumerate(seq_lens):
            first, count = starts[r], starts[r + 1] - starts[r]
            plan = planned.get(r)
            if plan is None:
                if count:
                    runs.append((r, first, count, seq_len))
                continue
            step = plan.isolation
            assert step is not None
            table = metadata.block_table[r].long()
            sparse = self.sparse_of(plan.req_id) if step.sparse else ()
            rows, kernel_runs, in_place = self._partition(step, first, table, recomputer, sparse)
            hook_rows += rows
            runs += [(r, *run) for run in kernel_runs]
            if step.gaps and recomputer is not None:
                gaps.append(
                    self._gaps(recomputer, plan.req_id, step, table, metadata.block_table[r], call)
                )
            if (step.recompute or in_place) and recomputer is not None:
                recomputes.append(
                    self._recompute(
                        recomputer, plan.req_id, step, in_place, metadata.block_table[r], call
                    )
                )
            placed = self.placed(plan.req_id)
            moves += [
                Move(
                    plan.req_id,
                    start,
                    shift,
                    self.layout.slots(table, start, end - start),
                    self.rotary.tables(shift, end - start),
                )
                for start, end, shift in step.moves
                if placed is not None and start not in placed
            ]
        chunk_rows = [rows for rows in hook_rows if rows.chunks_end == 0]
        after_rows = [rows for rows in hook_rows if rows.chunks_end != 0]
        kernel = self._kernel_batch(runs, metadata, call)
        chunks = self.chunk_batch(chunk_rows, call)
        return StepSplit(after_rows, kernel, recomputes, moves=moves, chunks=chunks, gaps=gaps)

    def _gaps(
        self,
        recomputer: Recomputer,
        req_id: str,
        step: IsolatedStep,
        table: torch.Tensor,
        block_table: torch.Tensor,
        call: LayerCall,
    ) -> Gaps:
        """The request's gaps: their tokens as a blend, each chunk's as chunk rows."""
        blend = recomputer.start(req_id, block_table, step.gaps)
        sys_end = step.sys_end if self.isolate_from_sys else 0
        rows: list[HookRows] = []
        at = 0  # the chunk's first query among the blend's
        for start, end in step.chunks:
            count = int(((blend.positions >= start) & (blend.positions < end)).sum())
            if count:
                if count != end - start:
                    raise ValueError(f"gap [{start}, {end}) is not a whole chunk")
                shift = start - (step.sys_end + self.virtual_gap)
                rows.append(HookRows(at, count, table, start, end, sys_end, shift))
                at += count
        chunks = self.chunk_batch(rows, call)
        assert chunks is not None
        return Gaps(blend, chunks)

    def chunk_batch(self, chunk_rows: list[HookRows], call: LayerCall) -> ChunkBatch | None:
        """The chunk rows as sub-requests over a cache of the hook's own (``ChunkBatch``)."""
        if not chunk_rows:
            return None
        block_size = self.layout.block_size
        sources, slots, shifts, tables, seq_lens = [], [], [], [], []
        at = 0  # where the next chunk's keys start in ``sources``
        blocks = 0
        for rows in chunk_rows:
            seen = rows.sys_end + rows.end - rows.own_start
            own_blocks = -(-seen // block_size)
            table = torch.arange(blocks, blocks + own_blocks, dtype=torch.int32)
            if rows.sys_end:
                sources.append(self.layout.slots(rows.block_ids, 0, rows.sys_end))
                if rows.sys_shift:
                    shifts.append((at, rows.sys_end, rows.sys_shift))
            sources.append(
                self.layout.slots(rows.block_ids, rows.own_start, rows.end - rows.own_start)
            )
            slots.append(self.layout.slots(table, 0, seen))
            tables.append(table)
            seq_lens.append(seen)
            at += seen
            blocks += own_blocks
        counts = torch.tensor([rows.count for rows in chunk_rows], dtype=torch.int32)
        query_start_loc = torch.zeros(len(chunk_rows) + 1, dtype=torch.int32)
        torch.cumsum(counts, 0, out=query_start_loc[1:])
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        widest = max(len(t) for t in tables)
        block_table = torch.zeros(len(tables), widest, dtype=torch.int32)
        for r, table in enumerate(tables):
            block_table[r, : len(table)] = table
        batch = call.batch(
            torch.cat([torch.arange(rows.row, rows.row + rows.count) for rows in chunk_rows]),
            query_start_loc,
            lens,
            block_table,
        )
        return ChunkBatch(torch.cat(sources), torch.cat(slots), shifts, blocks, batch)

    def _partition(
        self,
        step: IsolatedStep,
        first: int,
        block_ids: torch.Tensor,
        recomputer: Recomputer | None,
        sparse: tuple[SparseRead, ...] = (),
    ) -> tuple[list[HookRows], list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """A planned request's rows (``first`` is the row of position ``step.start``): the
        hook's (chunk tokens; with question re-weighting, the tokens after the chunks), the
        kernel's runs (first row, rows, seq_len): sys tokens, the tokens after, and the
        chunks computed in place (first row, rows, position), where the hook recomputes.
        The tokens after the chunks are the hook's too where a chunk was loaded sparse
        (``sparse``): vLLM's kernel would read the slots it did not read."""

        def row(position: int) -> int:
            return first + position - step.start

        hook: list[HookRows] = []
        kernel: list[tuple[int, int, int]] = []
        in_place: list[tuple[int, int, int]] = []
        once = set(step.in_place) if recomputer is not None else set()
        sys_rows_end = min(step.end, step.sys_end)
        if sys_rows_end > step.start:
            kernel.append((row(step.start), sys_rows_end - step.start, sys_rows_end))
        sys_end = step.sys_end if self.isolate_from_sys else 0
        for chunk_start, chunk_end in step.chunks:
            lo, hi = max(chunk_start, step.start), min(chunk_end, step.end)
            if (chunk_start, chunk_end) in once and (lo, hi) == (chunk_start, chunk_end):
                in_place.append((row(chunk_start), chunk_end - chunk_start, chunk_start))
            elif hi > lo:
                shift = chunk_start - (step.sys_end + self.virtual_gap)
                hook.append(HookRows(row(lo), hi - lo, block_ids, chunk_start, hi, sys_end, shift))
        after = step.chunks[-1][1]  # the causal tokens after the isolated chunks
        lo = max(step.start, after)
        if step.end > lo:
            if self.reweight or step.sparse:
                hook.append(
                    HookRows(
                        row(lo),
                        step.end - lo,
                        block_ids,
                        after,
                        step.end,
                        step.sys_end,
                        0,
                        after,
                        sparse,
                    )
                )
            else:
                kernel.append((row(lo), step.end - lo, step.end))
        return hook, kernel, in_place

    def _locate(self, metadata: StepMetadata, plans: list[RequestPlan]) -> dict[int, RequestPlan]:
        """Each planned request's row in the batch: the one whose last token this step goes
        to the slot the request's block table gives its last position (a slot is written by
        one token of one request). A planned request not found is reported (``on_miss``)."""
        starts, seq_lens = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
        by_last_slot = {
            int(metadata.slot_mapping[starts[r + 1] - 1]): r
            for r in range(len(seq_lens))
            if starts[r + 1] > starts[r]
        }
        planned: dict[int, RequestPlan] = {}
        for plan in plans:
            step = plan.isolation
            assert step is not None
            table = torch.tensor(plan.block_ids, dtype=torch.int64)
            r = by_last_slot.get(int(self.layout.slots(table, step.end - 1, 1)[0]))
            if r is None or seq_lens[r] != step.end or starts[r + 1] - starts[r] != step.count:
                self.on_miss(plan.req_id)
                continue
            planned[r] = plan
        return planned

    def _kernel_batch(
        self, runs: list[tuple[int, int, int, int]], metadata: StepMetadata, call: LayerCall
    ) -> KernelBatch | None:
        if not runs:
            return None
        rows = torch.cat([torch.arange(first, first + count) for _, first, count, _ in runs])
        lengths = torch.tensor([count for _, _, count, _ in runs], dtype=torch.int32)
        query_start_loc = torch.zeros(len(runs) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=query_start_loc[1:])
        seq_lens = torch.tensor([seq_len for *_, seq_len in runs], dtype=torch.int32)
        block_table = metadata.block_table[torch.tensor([r for r, *_ in runs])]
        return call.batch(rows, query_start_loc, seq_lens, block_table)

    def _recompute(
        self,
        recomputer: Recomputer,
        req_id: str,
        step: IsolatedStep,
        in_place: list[tuple[int, int, int]],
        block_table: torch.Tensor,
        call: LayerCall,
    ) -> Recompute:
        """A request's recomputed tokens and in-place rows, and how they attend: in the
        request's cache where every position is attended where it stands (no moves), else
        in attended order in a cache of the hook's own."""
        attended = Reordered.attended(step) if step.moves else None
        blend = None
        if step.recompute:
            blend = recomputer.start(req_id, block_table, step.recompute, attended)
        # Each query's attended position: the recomputed tokens', then the in-place rows'.
        positions = [blend.attended] if blend is not None else []
        own = None
        if in_place:
            shifts, at = [], 0
            for _, count, start in in_place:
                here = torch.arange(start, start + count)
                there = here if attended is None else attended[here]
                positions.append(there)
                if int(there[0]) != start:
                    shifts.append((at, count, int(there[0]) - start))
                at += count
            rows = torch.cat([torch.arange(row, row + count) for row, count, _ in in_place])
            own = InPlace(rows, shifts)
        where = torch.cat(positions)
        rows = torch.argsort(where)
        if attended is None:
            how: KernelBatch | Reordered = self._runs(where[rows], rows, block_table, call)
        else:
            end = len(attended)
            slots = self.layout.slots(block_table.long(), 0, end)[torch.argsort(attended)]
            blocks = torch.arange(-(-end // self.layout.block_size), dtype=torch.int32)
            moved = torch.nonzero(attended != torch.arange(end)).flatten()
            whole = (int(moved[0]) if len(moved) else end) // self.layout.block_size
            how = Reordered(
                slots,
                self._runs(where[rows], rows, blocks, call),
                block_table[:whole].long(),
            )
        return Recompute(blend, own, how)

    def _runs(
        self,
        positions: torch.Tensor,
        rows: torch.Tensor,
        block_table: torch.Tensor,
        call: LayerCall,
    ) -> KernelBatch:
        """Queries ``rows`` at ``positions`` (ascending) as a batch for vLLM's kernel: each
        run of consecutive positions (a chunk recomputed whole, a chunk's first tokens) one
        sub-request over the cache ``block_table`` maps, up to its last position, causally
        (where the run's recomputed KV already stands)."""
        breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
        bounds = [0, *breaks, positions.shape[0]]
        query_start_loc = torch.tensor(bounds, dtype=torch.int32)
        seq_lens = (positions[torch.tensor(bounds[1:]) - 1] + 1).to(torch.int32)
        table = block_table[None].expand(len(bounds) - 1, -1).contiguous()
        return call.batch(rows, query_start_loc, seq_lens, table)
