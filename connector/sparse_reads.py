"""Long stored chunks loaded sparse (worker process; ``sparse_threshold``, seed 002).

A chunk loaded sparse is not loaded with the step's other loads: its summary and its
blocks' digests are (``kv.sparse``, small). In the step that computes the rows after the
chunks (the question), each layer's attention chooses, from that layer's summary and the
question's queries there, the blocks covering ``threshold`` of its estimated attention
(every KV head of this rank keeps the blocks any of its query heads chose), reads only
those blocks' keys and values of that layer out of the pool, each checked against its
digest, and rotates the keys to where the chunk stands. The rows after the chunks (the
question, then every generated token) attend those, kept here for the request's life (a
few per cent of the chunk's KV a layer), through the hook (``StepAttention.attend_rows``):
nothing is written into vLLM's cache, whose slots for the chunk hold whatever was there, so
nothing else may read them (vLLM's kernel never sees these rows, and the scheduler keeps
the chunk's blocks out of vLLM's prefix cache). The worker forgets a request's reads when
vLLM says it finished (``forget``).

A read that fails (a digest that does not match, a lapsed lease, an unreachable daemon)
fails the load: vLLM computes the chunk's blocks again, the step's result for the request
is dropped, and its rows attend the chunk whole from then on (``failed``)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from chunkstore.errors import ChunkStoreError
from chunkstore.kv.entry import EntryKind, tensors_of, torch_dtype
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import rotation_table
from chunkstore.kv.sparse import (
    EntryBlocks,
    Summary,
    choose,
    digests_of,
    estimated_shares,
    queries_in_entry_frame,
    refine,
    summaries,
    token_mask,
)

from .client_holder import DaemonLink
from .common import LoadItem, RequestPlan, SparseSource
from .keys import ModelKeys
from .metrics import ConnectorStats
from .registered_cache import RegisteredCache

log = logging.getLogger("chunkstore.connector")

KEPT_REQUESTS = 256  # requests whose reads are kept, should vLLM not say they finished


class SparseReadFailed(ChunkStoreError):
    """A sparse load that cannot be served: its chunk is computed instead."""


@dataclass
class SparseRead:
    """One chunk of a request loaded sparse: positions [start, end) of the request, from
    an entry whose keys stand ``delta`` positions before them."""

    req_id: str
    start: int
    end: int
    delta: int
    item: LoadItem
    source: SparseSource
    block_ids: list[int]  # the request's block table as far as the chunk
    blocks: EntryBlocks | None = None  # None: refused (``failed``)
    summaries: list[Summary] | None = None  # per layer, this rank's KV heads, until all read
    digests: torch.Tensor | None = None
    # layer -> the keys (rotated to where they stand) and values read, [tokens, heads, dim]
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    failed: bool = False

    def attended(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values of the chunk read for ``layer``; None where the chunk is
        attended whole from vLLM's cache (its read failed: vLLM computes it)."""
        return None if self.failed else self.kept.get(layer)


class SparseReads:
    """The worker's sparse loads, by request: registered with the step's loads (their
    summaries and digests read then), read layer by layer in the hook."""

    def __init__(
        self,
        cache: RegisteredCache,
        keys: ModelKeys,
        link: DaemonLink,
        stats: ConnectorStats,
    ) -> None:
        self.cache = cache
        self.keys = keys
        self.link = link
        self.stats = stats
        self._reads: OrderedDict[str, list[SparseRead]] = OrderedDict()
        self.failed_blocks: set[int] = set()

    def of(self, req_id: str) -> tuple[SparseRead, ...]:
        return tuple(self._reads.get(req_id, ()))

    def take_failed_blocks(self) -> set[int]:
        taken, self.failed_blocks = self.failed_blocks, set()
        return taken

    def add(self, plan: RequestPlan, item: LoadItem) -> None:
        """A sparse load of this step: its summary and digests read now; a failure fails
        the load (vLLM computes the chunk)."""
        source = item.sparse
        assert source is not None
        start, end = item.actual_start, item.actual_start + item.num_tokens
        reads = [r for r in self._reads.pop(plan.req_id, []) if (r.start, r.end) != (start, end)]
        delta = start - item.entry_offset - item.lease.layout.virtual_start
        read = SparseRead(plan.req_id, start, end, delta, item, source, plan.block_ids)
        try:
            read.blocks, read.summaries, read.digests = self._sources(item, source)
        except ChunkStoreError as err:
            log.warning("chunkstore: request %s: sparse load refused: %s", plan.req_id, err)
            self._fail(read)
        self._reads[plan.req_id] = [*reads, read]
        while len(self._reads) > KEPT_REQUESTS:
            self._reads.popitem(last=False)

    def _sources(
        self, item: LoadItem, source: SparseSource
    ) -> tuple[EntryBlocks, list[Summary], torch.Tensor]:
        layout, want = item.lease.layout, self.keys.layout
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
            want.num_layers,
            want.num_kv_heads,
            want.head_dim,
            self.keys.kv_dtype,
        ):
            raise SparseReadFailed(f"entry layout {layout} does not match the model's")
        if item.entry_offset or item.num_tokens != layout.num_tokens:
            raise SparseReadFailed("only a whole entry is loaded sparse")
        blocks = EntryBlocks.of(layout, source.block)
        client = self.link.get()
        if client is None:
            raise SparseReadFailed("daemon unreachable")
        leases = [source.summary, source.digests]
        outs = [torch.empty(lease.nbytes, dtype=torch.uint8) for lease in leases]
        for verdict in client.read_each(leases, outs, session=item.session):
            if verdict is not None:
                raise verdict
        summary, digests_layout = source.summary.layout, source.digests.layout
        if summary.entry_kind != EntryKind.SUMMARY or summary.kind != "kv":
            raise SparseReadFailed(f"not a summary: {summary}")
        if summary.virtual_start != layout.virtual_start:  # scored in another frame
            raise SparseReadFailed("the summary's keys stand elsewhere than the entry's")
        if digests_layout.kind != "kv":
            raise SparseReadFailed(f"not block digests: {digests_layout}")
        lo, hi = tensors_of(outs[0], summary)
        keys, values = tensors_of(outs[1], digests_layout)
        assert hi is not None and values is not None  # kv entries: checked above
        heads = self.cache.heads.local_slice()
        try:
            layers = summaries(lo[:, :, heads], hi[:, :, heads], blocks.block, blocks.tokens)
            digests = digests_of(keys, values)
        except ValueError as err:
            raise SparseReadFailed(str(err)) from err
        if digests.shape != (2, blocks.layers, blocks.count):
            raise SparseReadFailed(f"digests of shape {tuple(digests.shape)} for {blocks}")
        return blocks, layers, digests

    def forget(self, req_ids: set[str]) -> None:
        """These requests finished: their reads go."""
        for req_id in req_ids:
            self._reads.pop(req_id, None)

    def read_layer(self, read: SparseRead, layer: int, queries: torch.Tensor, scale: float) -> None:
        """The blocks of ``layer`` that ``queries`` (the question's, this layer's, this
        rank's heads, rotated to where they stand) need, read, checked, their keys rotated
        to where the chunk stands: ``read.kept[layer]``. With ``candidates``, the bound
        keeps blocks up to it, their keys are read, and the question's exact attention over
        them keeps blocks up to ``threshold``, whose values are then read."""
        if read.failed or layer in read.kept:
            return
        assert read.blocks and read.summaries is not None and read.digests is not None
        began = time.perf_counter()
        summary, source = read.summaries[layer], read.source
        entry_queries = queries_in_entry_frame(queries, read.delta, self.keys.rotary)
        mask = choose(
            estimated_shares(entry_queries, summary, scale),
            summary.lo.shape[1],
            source.candidates or source.threshold,
        )
        wanted = mask.any(0)  # every KV head of this rank reads what any of them chose
        chosen = wanted.nonzero().flatten().tolist()
        self.stats.add("sparse_choose_seconds", time.perf_counter() - began)
        if not source.candidates:
            both = self._read(read, layer, chosen, (0, 1))
            if both is None:
                return
            keys, values = both.chunk(2)
        else:
            candidates = self._read(read, layer, chosen, (0,))
            if candidates is None:
                return
            began = time.perf_counter()
            kept = refine(entry_queries, candidates, chosen, summary, source.threshold, scale)
            kept = kept.any(0)
            self.stats.add("sparse_choose_seconds", time.perf_counter() - began)
            read_values = self._read(read, layer, kept.nonzero().flatten().tolist(), (1,))
            if read_values is None:
                return
            rows = token_mask(kept[None], summary)[0, token_mask(wanted[None], summary)[0]]
            keys, values = candidates[rows], read_values
        began = time.perf_counter()
        if read.delta:
            cos, sin = rotation_table(self.keys.rotary, read.delta, keys.shape[0])
            keys = rotate_keys(keys, cos, sin, self.keys.rotary, out=torch.empty_like(keys))
        read.kept[layer] = (keys, values)
        self.stats.add("sparse_read_seconds", time.perf_counter() - began)
        self.stats.add("sparse_whole_bytes", read.item.lease.nbytes // read.blocks.layers)
        if len(read.kept) == read.blocks.layers:
            read.summaries = read.digests = None  # every layer read: the choice is kept

    def _read(
        self, read: SparseRead, layer: int, blocks: list[int], parts: tuple[int, ...]
    ) -> torch.Tensor | None:
        """``parts`` (0 keys, 1 values) of ``layer``'s ``blocks`` out of the pool, checked by
        their digests, this rank's heads: [parts x tokens, heads, head_dim]; None where the
        read failed (the load fails: vLLM computes the chunk)."""
        assert read.blocks is not None and read.digests is not None
        began = time.perf_counter()
        spans = read.blocks.spans(layer, blocks, parts)
        expected = read.blocks.expected(read.digests, layer, blocks, parts)
        out = torch.empty(sum(hi - lo for lo, hi in spans), dtype=torch.uint8)
        client = self.link.get()
        failure: ChunkStoreError | None = SparseReadFailed("daemon unreachable")
        if client is not None:
            try:
                failure = client.read_spans(
                    read.item.lease, spans, expected, out, read.item.session
                )
            except ChunkStoreError as err:
                failure = err
        if failure is not None:
            log.warning(
                "chunkstore: request %s: sparse read of layer %d failed: %s; computing the chunk",
                read.req_id,
                layer,
                failure,
            )
            self._fail(read)
            return None
        self.stats.add("sparse_read_bytes", out.numel())
        layout = read.item.lease.layout
        shape = (-1, layout.num_kv_heads, layout.head_dim)
        heads = self.cache.heads.local_slice()
        local = out.view(torch_dtype(layout.dtype)).view(shape)[:, heads].contiguous()
        self.stats.add("sparse_read_seconds", time.perf_counter() - began)
        return local

    def missed(self, req_id: str) -> None:
        """The hook did not find the request in a step's batch: vLLM's kernel attended its
        rows, unread slots included; its chunks loaded sparse fail (vLLM computes them, and
        the step's result for the request is dropped)."""
        for read in self._reads.get(req_id, ()):
            if not read.failed:
                log.error(
                    "chunkstore: request %s: not found in a batch while a chunk of it is "
                    "loaded sparse; computing the chunk",
                    req_id,
                )
                self._fail(read)

    def _fail(self, read: SparseRead) -> None:
        """The chunk's blocks failed to load: vLLM computes them, and its rows are
        attended whole from then on."""
        read.failed = True
        read.summaries = read.digests = None
        size, ids = self.cache.block_size, read.block_ids
        self.failed_blocks |= {ids[p // size] for p in range(read.start, read.end, size)}
        self.failed_blocks.add(ids[(read.end - 1) // size])
        self.stats.add("load_failures")
