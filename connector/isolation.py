"""In-band isolation (worker process): the isolation mask inside vLLM's attention, so a chunk
vLLM computes in a request is the KV the store serves for it, and the same prompt gets the
same answer whatever is stored (DESIGN.md, "In-band isolation"; seeds 000 and 001).

The hook wraps ``forward`` of each attention layer's implementation (vLLM's CPU back end;
any other is refused, loudly, and attention stays vLLM's). Each step the scheduler names the
requests whose scheduled tokens include chunk tokens (``IsolatedStep``). Per layer:

- rows of chunk tokens are computed here: each sees its own chunk causally and, in
  ``isolation: sys``, the sys keys, read from vLLM's paged cache through the block table
  (seed 004). A stored chunk was computed at virtual start ``v`` (right after sys, or
  ``virtual_gap`` past it) and is loaded with its keys rotated by ``p - v``; a chunk computed
  at ``p`` must see sys at the same distances, so the sys keys are rotated by ``+(p - v)`` for
  its scores, which is the same as rotating its queries by ``-(p - v)`` (RoPE scores depend
  on the difference). Scores inside the chunk are relative already; the keys vLLM wrote into
  its cache stay at actual positions, as a load writes them. All chunk rows of a step are one
  call of vLLM's kernel (``ChunkBatch``): each chunk a sub-request over a cache of the hook's
  own that holds what it sees, in order (its rotated sys, then its own run), causal, so no
  mask and no merge; one partial attention per chunk and part, merged by log-sum-exp
  (``chunkstore.kv.attention.attention_after_context``), is the reference it is tested
  against, and what the question rows below still use.
- with question re-weighting, the rows after the isolated chunks (question, decode) are
  computed here too: sys, then the chunks with their temperature and scale, then their own.
- with ``recompute_tokens``, the step that computes the first causal row after the chunks
  first recomputes the chunks' selected tokens (``recompute``), after the chunk rows and
  before the causal ones, so those read the blend.
- with ``relevant_last``, that same step rotates the keys of the chunks that move to their
  new positions in the cache (``moves``), after the chunk rows and before the recompute and
  the causal rows: from then on the question and what is generated read them there (a
  chunk the step loads whole was loaded rotated there: ``placed``, ``Loads.placed``). The
  tokens recomputed in such a request are recomputed where they are attended: rotated to
  their attended positions, each seeing the keys attended before it (``Reordered``: the
  cache holds the chunks in prompt order, so their KV is copied in attended order into a
  cache of the hook's own, where vLLM's kernel is causal in that order).
- a chunk recomputed whole whose rows the step computes anyway (``in_place``) is computed
  once: its rows are not chunk rows but join the recomputed tokens' attention, their
  queries rotated to where the chunk is attended (``InPlace``), and vLLM takes them through
  the rest of each layer; its KV in the cache is then the recomputed one, never isolated.
- chunks that missed inside a request's loaded run (``gaps``: vLLM counts them as loaded)
  are computed here in the request's first step, before anything reads them: their tokens
  through vLLM's modules (the recomputer), attending as chunk rows do (``Gaps``); a gap
  recomputed whole in that step (``gap_picks``) only by its recompute, once. A request
  whose gaps were not computed has their blocks reported as failed loads (vLLM computes
  them) and none of its chunks stored.
- every other row (plain requests, sys and question tokens, decode) goes to vLLM's own kernel,
  on a batch without the chunk rows, so no row pays for attention twice; a step with no chunk
  rows calls vLLM's forward untouched.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkstore.kv.attention import KeyBlock, attention_after_context
from chunkstore.kv.keys import Isolation
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table

from .common import IsolatedStep, RequestPlan
from .config import ConnectorConfig
from .cpu_layout import CpuKVLayout
from .recompute import Blend, IsolatedCopy, Recomputer

log = logging.getLogger("chunkstore.connector")


@dataclass(frozen=True)
class HookRows:
    """Rows [row, row + count) of the batch that the hook computes: the last ``count`` tokens
    of a run of positions [own_start, end) that see each other causally, in the request with
    block table ``block_ids``, and the keys they see whole before the run: sys [0, sys_end)
    (none when 0), rotated by ``sys_shift`` positions; for the tokens after isolated chunks,
    with question re-weighting, the chunks [sys_end, chunks_end) too."""

    row: int
    count: int
    block_ids: torch.Tensor
    own_start: int
    end: int
    sys_end: int
    sys_shift: int = 0
    chunks_end: int = 0


@dataclass
class KernelBatch:
    """The rows vLLM's kernel computes, as a batch of their own: each run of rows is one
    sub-request seeing its request's positions [0, seq_len)."""

    rows: torch.Tensor  # int64 row indices into the step's batch
    query_start_loc: torch.Tensor  # int32 [runs + 1]
    seq_lens: torch.Tensor  # int32 [runs]
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass(frozen=True)
class Move:
    """A chunk's keys rotated by ``shift`` positions where they stand in the cache."""

    req_id: str
    start: int
    shift: int
    slots: torch.Tensor
    rotation: tuple[torch.Tensor, torch.Tensor]


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
    rotations: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # (shift, tokens) -> the rotation table
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


def unsupported(impl: Any, layer: Any) -> str | None:
    """Why the hook cannot serve this attention layer, or None."""
    try:
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:
        return "vLLM's CPU attention back end is not available"
    if type(impl) is not CPUAttentionBackendImpl:
        return f"attention back end {type(impl).__name__} is not one the hook knows"
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type} is not decoder self-attention"
    features = {
        "sliding window": impl.sliding_window not in (-1, None),
        "ALiBi": impl.alibi_slopes is not None,
        "logit soft-capping": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        f"KV cache dtype {impl.kv_cache_dtype}": impl.kv_cache_dtype != "auto",
    }
    found = [name for name, present in features.items() if present]
    return f"{', '.join(found)} not supported" if found else None


class IsolationHook:
    def __init__(
        self,
        layout: CpuKVLayout,
        rotary: RotaryConfig,
        config: ConnectorConfig,
        on_miss: Callable[[str], None],
        placed: Callable[[str], dict[int, int] | None] = lambda req_id: {},
    ) -> None:
        self.layout = layout
        self.rotary = rotary
        self.isolate_from_sys = config.isolation_mode is Isolation.SYS
        self.virtual_gap = config.virtual_gap  # chunks see sys from this far past its end
        self.reweight = config.quality.reweights_questions
        self.temperature = config.quality.question_temperature
        self.log_scale = math.log(config.quality.question_scale)
        self.on_miss = on_miss  # a planned request not found in the batch (computed causally)
        # A request's chunks its loads put where they are attended (None: a load failed,
        # so nothing of it moves in this step, which vLLM computes again)
        self.placed = placed
        self.recomputes = bool(config.quality.recompute_tokens or config.quality.recompute_chunks)
        self.rides = config.recompute_in_vllm_batch
        self.recomputer: Recomputer | None = None
        self._plans: list[RequestPlan] = []
        self._splits: dict[int, tuple[Any, StepSplit | None]] = {}
        self.isolated_tokens = 0  # chunk tokens served, since take_isolated_tokens
        self.failed_blocks: set[int] = set()  # blocks of gaps not computed, since taken
        self._layer_names: list[str] = []
        self._first: Any = None  # the first attention layer (its metadata builds the split)
        self._riding = 0  # the step's recomputed rows after vLLM's in its batch (``ride``)

    # Installation ---------------------------------------------------------------------------

    def install(self, vllm_config: Any, layer_names: list[str]) -> str | None:
        """Wrap every attention layer's forward; or, if any layer is not one the hook can
        serve, none of them, and return why."""
        context = vllm_config.compilation_config.static_forward_context
        layers = [context[name] for name in layer_names]
        for name, layer in zip(layer_names, layers, strict=True):
            why = unsupported(layer.impl, layer)
            if why:
                return f"{name}: {why}"
        found = Recomputer.find(vllm_config, self.layout, layer_names)
        if isinstance(found, str):
            # Chunks then stay isolated: the answer the semantics give without recovery.
            report = log.error if self.recomputes else log.info
            report("chunkstore: no chunk or token is recomputed for answer quality: %s", found)
        else:
            self.recomputer = found
            why = found.ride(vllm_config, self._riders) if self.rides else "configured"
            if why:
                log.info("chunkstore: recomputed tokens take a pass of their own: %s", why)
        self._layer_names = list(layer_names)
        self._first = layers[0]
        for index, layer in enumerate(layers):
            layer.impl.forward = self._wrap(layer.impl.forward, layer.impl, index)
            layer.impl.do_kv_cache_update = self._trimmed(layer.impl.do_kv_cache_update)
        return None

    def _riders(self) -> list[Blend]:
        """The blends of the step vLLM's forward is about to run, which ride in its batch
        (``Recomputer.ride``): built from the first layer's attention metadata, before it."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        self._riding = 0
        if not self._plans or not is_forward_context_available():
            return []
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):
            return []
        name = self._layer_names[0]
        split = self._split(metadata.get(name), self._first.impl, self._first)
        blends = split.blends() if split is not None else []
        self._riding = sum(blend.positions.shape[0] for blend in blends)
        return blends

    def _trimmed(self, original: Callable[..., None]) -> Callable[..., None]:
        """vLLM's cache write of a layer's keys and values, without the rows riding in the
        batch (the hook writes those, in their order among the step's attention)."""

        def update(layer: Any, key: torch.Tensor, value: torch.Tensor, *args: Any) -> None:
            if self._riding:
                key, value = key[: -self._riding], value[: -self._riding]
            original(layer, key, value, *args)

        return update

    def _wrap(
        self, original: Callable[..., torch.Tensor], impl: Any, index: int
    ) -> Callable[..., Any]:
        def forward(
            layer: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata: Any,
            output: torch.Tensor,
            *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:
            split = self._split(attn_metadata, impl, layer) if self._plans else None
            if split is None:
                if self._riding:
                    raise RuntimeError("recomputed rows rode in a batch the hook did not split")
                return original(
                    layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
                )
            self._attend(split, impl, layer, index, (query, key, value), kv_cache, output)
            return output

        return forward

    # Steps --------------------------------------------------------------------------------

    def begin_step(self, plans: list[RequestPlan]) -> None:
        self._plans = [plan for plan in plans if plan.isolation is not None]
        self._splits.clear()
        self._riding = 0

    def end_step(self) -> tuple[dict[str, IsolatedCopy], dict[str, dict[int, int]]]:
        """End the step; return, per request whose selected tokens were recomputed in it,
        the isolated KV they replaced (what saves of this step must store), and per request
        whose chunks moved in it, each moved chunk's start and shift (saves of this step
        read its keys rotated)."""
        copies: dict[str, IsolatedCopy] = {}
        shifts: dict[str, dict[int, int]] = {}
        layers = len(self._layer_names)
        splits = [split for _, split in self._splits.values() if split is not None]
        filled = {
            gap.blend.req_id for s in splits for gap in s.gaps if gap.blend.next_layer == layers
        }
        blended = {
            r.blend.req_id
            for s in splits
            for r in s.recomputes
            if r.blend is not None and r.blend.next_layer == layers
        }
        for plan in self._plans:
            step = plan.isolation
            if step is not None and (
                (step.gaps and plan.req_id not in filled)
                or (step.gap_picks and plan.req_id not in blended)
            ):
                self._gaps_failed(plan)
        for _, split in self._splits.values():
            if split is None:
                continue
            for recompute in split.recomputes:
                blend = recompute.blend
                if blend is None or self.recomputer is None:
                    continue
                copy = self.recomputer.isolated_copy(blend)
                if copy is not None:
                    copies[blend.req_id] = copy
            for move in split.moves:
                shifts.setdefault(move.req_id, {})[move.start] = move.shift
        self._plans = []
        self._splits.clear()
        self._riding = 0
        return copies, shifts

    def _gaps_failed(self, plan: RequestPlan) -> None:
        """A request's gaps were not computed: vLLM computes their blocks (a failed load)
        and none of the request's chunks is stored."""
        step = plan.isolation
        assert step is not None
        size = self.layout.block_size
        positions = [p for p, _ in step.gaps] + [
            p for lo, hi in step.gap_picks for p in range(lo, hi)
        ]
        self.failed_blocks |= {plan.block_ids[position // size] for position in positions}
        log.error(
            "chunkstore: request %s: the chunks that missed inside its loaded run were not "
            "computed; vLLM computes them (a failed load)",
            plan.req_id,
        )
        self.on_miss(plan.req_id)

    def take_failed_blocks(self) -> set[int]:
        taken, self.failed_blocks = self.failed_blocks, set()
        return taken

    def take_isolated_tokens(self) -> int:
        taken, self.isolated_tokens = self.isolated_tokens, 0
        return taken

    def _split(self, metadata: Any, impl: Any, layer: Any) -> StepSplit | None:
        """Which rows of this step's batch are chunk rows, and the batch vLLM's kernel gets
        for the rest: built once per step (every layer shares the metadata object)."""
        if metadata is None:
            return None
        cached = self._splits.get(id(metadata))
        if cached is not None and cached[0] is metadata:
            return cached[1]
        split = self._build_split(metadata, impl, layer)
        self._splits[id(metadata)] = (metadata, split)
        return split

    def _build_split(self, metadata: Any, impl: Any, layer: Any) -> StepSplit | None:
        planned = self._locate(metadata)
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
            rows, kernel_runs, in_place = self._partition(step, first, table)
            hook_rows += rows
            runs += [(r, *run) for run in kernel_runs]
            if step.gaps and self.recomputer is not None:
                gaps.append(
                    self._gaps(plan.req_id, step, table, metadata.block_table[r], impl, layer)
                )
            if (step.recompute or in_place) and self.recomputer is not None:
                recomputes.append(
                    self._recompute(
                        plan.req_id, step, in_place, metadata.block_table[r], impl, layer
                    )
                )
            placed = self.placed(plan.req_id)
            moves += [
                Move(
                    plan.req_id,
                    start,
                    shift,
                    self.layout.slots(table, start, end - start),
                    rotation_table(self.rotary, shift, end - start),
                )
                for start, end, shift in step.moves
                if placed is not None and start not in placed
            ]
        chunk_rows = [rows for rows in hook_rows if rows.chunks_end == 0]
        self.isolated_tokens += sum(rows.count for rows in chunk_rows)
        after_rows = [rows for rows in hook_rows if rows.chunks_end != 0]
        kernel = self._kernel_batch(runs, metadata, impl, layer)
        chunks = self._chunk_batch(chunk_rows, impl, layer)
        self.isolated_tokens += sum(len(gap.blend.positions) for gap in gaps)
        return StepSplit(after_rows, kernel, recomputes, moves=moves, chunks=chunks, gaps=gaps)

    def _gaps(
        self,
        req_id: str,
        step: IsolatedStep,
        table: torch.Tensor,
        block_table: torch.Tensor,
        impl: Any,
        layer: Any,
    ) -> Gaps:
        """The request's gaps: their tokens as a blend, each chunk's as chunk rows."""
        assert self.recomputer is not None
        blend = self.recomputer.start(req_id, block_table, step.gaps)
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
        chunks = self._chunk_batch(rows, impl, layer)
        assert chunks is not None
        return Gaps(blend, chunks)

    def _chunk_batch(self, chunk_rows: list[HookRows], impl: Any, layer: Any) -> ChunkBatch | None:
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
        batch = KernelBatch(
            torch.cat([torch.arange(rows.row, rows.row + rows.count) for rows in chunk_rows]),
            query_start_loc,
            lens,
            block_table,
            self._scheduler_metadata(query_start_loc, lens, impl, layer),
        )
        return ChunkBatch(torch.cat(sources), torch.cat(slots), shifts, blocks, batch)

    def _partition(
        self, step: IsolatedStep, first: int, block_ids: torch.Tensor
    ) -> tuple[list[HookRows], list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """A planned request's rows (``first`` is the row of position ``step.start``): the
        hook's (chunk tokens; with question re-weighting, the tokens after the chunks), the
        kernel's runs (first row, rows, seq_len): sys tokens, the tokens after, and the
        chunks computed in place (first row, rows, position), where the hook recomputes."""

        def row(position: int) -> int:
            return first + position - step.start

        hook: list[HookRows] = []
        kernel: list[tuple[int, int, int]] = []
        in_place: list[tuple[int, int, int]] = []
        once = set(step.in_place) if self.recomputer is not None else set()
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
            if self.reweight:
                hook.append(
                    HookRows(
                        row(lo), step.end - lo, block_ids, after, step.end, step.sys_end, 0, after
                    )
                )
            else:
                kernel.append((row(lo), step.end - lo, step.end))
        return hook, kernel, in_place

    def _locate(self, metadata: Any) -> dict[int, RequestPlan]:
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
        for plan in self._plans:
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
        self, runs: list[tuple[int, int, int, int]], metadata: Any, impl: Any, layer: Any
    ) -> KernelBatch | None:
        if not runs:
            return None
        rows = torch.cat([torch.arange(first, first + count) for _, first, count, _ in runs])
        lengths = torch.tensor([count for _, _, count, _ in runs], dtype=torch.int32)
        query_start_loc = torch.zeros(len(runs) + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=query_start_loc[1:])
        seq_lens = torch.tensor([seq_len for *_, seq_len in runs], dtype=torch.int32)
        block_table = metadata.block_table[torch.tensor([r for r, *_ in runs])]
        return KernelBatch(
            rows,
            query_start_loc,
            seq_lens,
            block_table,
            self._scheduler_metadata(query_start_loc, seq_lens, impl, layer),
        )

    def _scheduler_metadata(
        self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, impl: Any, layer: Any
    ) -> torch.Tensor:
        from vllm import _custom_ops as ops
        from vllm import envs

        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens),
            num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size,
            seq_lens=seq_lens,
            dtype=self.layout.vllm_config.model_config.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=impl.kv_cache_dtype,
        )

    # Attention ------------------------------------------------------------------------------

    def _attend(
        self,
        split: StepSplit,
        impl: Any,
        layer: Any,
        index: int,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        """The chunk rows first (they read their chunks' isolated KV), then the gaps, then
        the moved chunks (their keys rotated), then the recomputed tokens and the rows
        computed in place (they overwrite the isolated KV, attended where it was moved), then
        the causal rows (they read the blend, the chunks where they moved). The gaps' and
        recomputed tokens of every request ride at the end of the batch (``self._riding``
        rows, ``Recomputer.ride``) or go through each layer's projections and MLP in a pass
        of their own (``Recomputer.layer``)."""
        query = qkv[0]
        if split.chunks is not None:
            self._attend_chunks(split, impl, layer, index, query, kv_cache, output)
        recomputes = {id(r.blend): r for r in split.recomputes if r.blend is not None}
        gaps = {id(gap.blend): gap for gap in split.gaps}
        moved = False

        def attend(blend: Blend, q: torch.Tensor) -> torch.Tensor:
            gap = gaps.get(id(blend))
            if gap is not None:
                return self._attend_gap(split, gap, impl, layer, index, kv_cache, q)
            recompute = recomputes[id(blend)]
            return self._attend_recomputed(
                split, recompute, impl, layer, index, query, kv_cache, output, q
            )

        def between(blend: Blend) -> None:
            nonlocal moved
            if not moved and id(blend) not in gaps:
                self._move(split, index, kv_cache)
                moved = True

        blends = split.blends()
        if blends and self._riding:
            assert self.recomputer is not None
            q, k, v = (rows[-self._riding :] for rows in qkv)
            out = self.recomputer.attend(blends, index, kv_cache, (q, k, v), attend, between)
            output[-self._riding :] = out.to(output.dtype)
        elif blends:
            assert self.recomputer is not None
            self.recomputer.layer(blends, index, kv_cache, attend, between)
        if not moved:
            self._move(split, index, kv_cache)
        for recompute in split.recomputes:  # in-place rows alone, nothing recomputed
            if recompute.blend is None:
                self._attend_recomputed(
                    split, recompute, impl, layer, index, query, kv_cache, output, query[:0]
                )
        if split.kernel is not None:
            self._kernel(split.kernel, impl, layer, query, kv_cache, output)
        self._attend_rows(split, split.rows, impl, query, kv_cache, output)

    def _move(self, split: StepSplit, index: int, kv_cache: torch.Tensor) -> None:
        """The moved chunks' keys rotated in the cache (after the gaps' KV is written, before
        the recomputed tokens' is)."""
        for move in split.moves:
            keys, values = self.layout.read(kv_cache, move.slots)
            self.layout.write_rotated(
                self._layer_names[index],
                kv_cache,
                keys,
                values,
                move.slots,
                move.rotation,
                self.rotary,
            )

    def _attend_chunks(
        self,
        split: StepSplit,
        impl: Any,
        layer: Any,
        index: int,
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
        sub_output = self._isolated(
            split, chunks, split.chunk_cache, impl, layer, index, query, kv_cache
        )
        output.index_copy_(0, chunks.batch.rows, sub_output)

    def _attend_gap(
        self,
        split: StepSplit,
        gap: Gaps,
        impl: Any,
        layer: Any,
        index: int,
        kv_cache: torch.Tensor,
        q: torch.Tensor,
    ) -> torch.Tensor:
        """The gaps' queries ``q`` (their KV written), as chunk rows."""
        if gap.cache is None:
            gap.cache = self._zeros(kv_cache, gap.chunks.blocks)
        return self._isolated(split, gap.chunks, gap.cache, impl, layer, index, q, kv_cache)

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
        impl: Any,
        layer: Any,
        index: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``chunks``' rows of ``query`` under the isolation mask: what each
        chunk sees copied into ``cache`` (its sys rotated), then one call of vLLM's kernel."""
        keys, values = self.layout.read(kv_cache, chunks.sources)
        for start, count, shift in chunks.shifts:
            keys[start : start + count] = self._shifted(split, keys[start : start + count], shift)
        self.layout.write(self._layer_names[index], cache, keys, values, chunks.slots)
        return self._paged(
            chunks.batch, impl, layer, query.index_select(0, chunks.batch.rows), cache
        )

    def _attend_recomputed(
        self,
        split: StepSplit,
        recompute: Recompute,
        impl: Any,
        layer: Any,
        index: int,
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
                rows[at : at + count] = self._shifted(split, rows[at : at + count], shift)
            q = torch.cat([q, rows.to(q.dtype)])
        how = recompute.how
        if isinstance(how, Reordered):
            out = self._reordered(how, impl, layer, index, kv_cache, q)
        else:
            out = torch.empty_like(q)
            out[how.rows] = self._paged(how, impl, layer, q[how.rows], kv_cache)
        if own is None:
            return out
        blended = out.shape[0] - own.rows.shape[0]
        output.index_copy_(0, own.rows, out[blended:].to(output.dtype))
        return out[:blended]

    def _attend_rows(
        self,
        split: StepSplit,
        hook_rows: list[HookRows],
        impl: Any,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        for rows in hook_rows:
            own_k, own_v = self._read(kv_cache, rows.block_ids, rows.own_start, rows.end)
            context = []
            if rows.sys_end:
                sys_k, sys_v = self._read(kv_cache, rows.block_ids, 0, rows.sys_end)
                context.append(KeyBlock(self._shifted(split, sys_k, rows.sys_shift), sys_v))
            if rows.chunks_end > rows.sys_end:
                chunk_k, chunk_v = self._read(
                    kv_cache, rows.block_ids, rows.sys_end, rows.chunks_end
                )
                context.append(KeyBlock(chunk_k, chunk_v, self.temperature, self.log_scale))
            span = slice(rows.row, rows.row + rows.count)
            output[span] = attention_after_context(
                query[span], own_k, own_v, context, impl.scale
            ).to(output.dtype)

    def _read(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end) from vLLM's paged cache."""
        return self.layout.read(kv_cache, self.layout.slots(block_ids, start, end - start))

    def _shifted(self, split: StepSplit, sys_keys: torch.Tensor, shift: int) -> torch.Tensor:
        """The sys keys as a chunk's queries must see them: rotated by ``p - v``, the
        distance the chunk stands from its virtual start (``virtual_gap`` past sys); or
        in-place rows' queries, rotated to where their chunk is attended."""
        if shift == 0:
            return sys_keys
        count = sys_keys.shape[0]  # requests of a step may have sys parts of other lengths
        table = split.rotations.get((shift, count))
        if table is None:
            table = split.rotations[shift, count] = rotation_table(
                self.rotary, shift, count, sys_keys.device
            )
        return rotate_keys(sys_keys, *table, self.rotary, out=torch.empty_like(sys_keys))

    def _kernel(
        self,
        batch: KernelBatch,
        impl: Any,
        layer: Any,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
    ) -> None:
        sub_output = self._paged(batch, impl, layer, query.index_select(0, batch.rows), kv_cache)
        output.index_copy_(0, batch.rows, sub_output)

    def _paged(
        self, batch: KernelBatch, impl: Any, layer: Any, sub_query: torch.Tensor, kv_cache: Any
    ) -> torch.Tensor:
        """vLLM's kernel over ``batch``: each run of queries attends causally to its
        request's cache up to its ``seq_len``."""
        from vllm import _custom_ops as ops

        blocks, heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        sub_output = torch.empty_like(sub_query)
        ops.cpu_attention_with_kv_cache(
            query=sub_query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=sub_output,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=impl.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=batch.block_table,
            softcap=0,
            scheduler_metadata=batch.scheduler_metadata,
            s_aux=None,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=impl.kv_cache_dtype,
        )
        return sub_output

    def _reordered(
        self,
        order: Reordered,
        impl: Any,
        layer: Any,
        index: int,
        kv_cache: torch.Tensor,
        q: torch.Tensor,
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
        self.layout.write(self._layer_names[index], own, keys, values, positions)
        out = torch.empty_like(q)
        out[order.batch.rows] = self._paged(order.batch, impl, layer, q[order.batch.rows], own)
        return out

    def _recompute(
        self,
        req_id: str,
        step: IsolatedStep,
        in_place: list[tuple[int, int, int]],
        block_table: torch.Tensor,
        impl: Any,
        layer: Any,
    ) -> Recompute:
        """A request's recomputed tokens and in-place rows, and how they attend: in the
        request's cache where every position is attended where it stands (no moves), else
        in attended order in a cache of the hook's own."""
        assert self.recomputer is not None
        attended = Reordered.attended(step) if step.moves else None
        blend = None
        if step.recompute:
            blend = self.recomputer.start(req_id, block_table, step.recompute, attended)
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
            how: KernelBatch | Reordered = self._runs(where[rows], rows, block_table, impl, layer)
        else:
            end = len(attended)
            slots = self.layout.slots(block_table.long(), 0, end)[torch.argsort(attended)]
            blocks = torch.arange(-(-end // self.layout.block_size), dtype=torch.int32)
            moved = torch.nonzero(attended != torch.arange(end)).flatten()
            whole = (int(moved[0]) if len(moved) else end) // self.layout.block_size
            how = Reordered(
                slots,
                self._runs(where[rows], rows, blocks, impl, layer),
                block_table[:whole].long(),
            )
        return Recompute(blend, own, how)

    def _runs(
        self,
        positions: torch.Tensor,
        rows: torch.Tensor,
        block_table: torch.Tensor,
        impl: Any,
        layer: Any,
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
        metadata = self._scheduler_metadata(query_start_loc, seq_lens, impl, layer)
        return KernelBatch(rows, query_start_loc, seq_lens, table, metadata)
