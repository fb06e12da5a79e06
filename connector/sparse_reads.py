"""Long stored chunks loaded sparse (worker process; ``sparse_threshold``,
docs/sparse-loads.md).

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

A summary is what another process stored: it steers the load only once it is checked
(``summary_of``: the entry's layers, KV heads, head_dim, dtype, blocks and frame; finite
values, each min at most its max). One that fails any check, or its checksum, or whose
scores overflow, is not used: the chunk is loaded whole, block by block (every block read
and checked by its digests, as with threshold 1), counted in ``sparse_fallbacks`` by
reason, logged once; one found unusable is remembered (its key and checksum: the store has
no call for a client to drop it) and not read again.

A read that fails (a digest that does not match, a lapsed lease, an unreachable daemon,
digests that fail their checks, anything raised in the sparse path) fails the load: vLLM
computes the chunk's blocks again, the step's result for the request is dropped, and its
rows attend the chunk whole from then on (``failed``). Nothing raised here reaches vLLM's
forward."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from chunkstore.client import LeasedEntry
from chunkstore.errors import ChunkStoreError
from chunkstore.kv.entry import EntryKind, EntryLayout, tensors_of, torch_dtype
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
KEPT_BAD_SUMMARIES = 4096  # summaries remembered as unusable (key and checksum)


class SparseReadFailed(ChunkStoreError):
    """A sparse load that cannot be served: its chunk is computed instead. ``reason``: the
    ``sparse_fallbacks`` label it is counted under."""

    def __init__(self, message: str, reason: str = "read") -> None:
        super().__init__(message)
        self.reason = reason


class UnusableSummary(ValueError):
    """A stored summary that may not steer a load (``reason``: the ``sparse_fallbacks``
    label): its chunk is loaded whole."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def summary_of(
    buffer: torch.Tensor, summary: EntryLayout, entry: EntryLayout, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored summary's min and max [layers, blocks, kv heads, head_dim] out of its
    bytes ``buffer``, once checked against the ``entry`` it summarizes in blocks of
    ``block``: what ``kv.sparse.summary_tensors`` stores of that entry's keys, or
    ``UnusableSummary``."""
    want = (
        EntryKind.SUMMARY,
        "kv",
        "",
        entry.num_layers,
        -(-entry.num_tokens // block),
        entry.num_kv_heads,
        entry.head_dim,
        entry.dtype,
    )
    have = (
        summary.entry_kind,
        summary.kind,
        summary.packing,
        summary.num_layers,
        summary.num_tokens,
        summary.num_kv_heads,
        summary.head_dim,
        summary.dtype,
    )
    if have != want:
        raise UnusableSummary(
            f"a summary of (kind, layout, packing, layers, blocks, kv heads, head_dim, "
            f"dtype) {have} for an entry that needs {want}",
            "summary_shape",
        )
    if summary.virtual_start != entry.virtual_start:
        raise UnusableSummary(
            f"a summary scored at {summary.virtual_start}, its entry's keys at "
            f"{entry.virtual_start}",
            "summary_shape",
        )
    lo, hi = tensors_of(buffer, summary)
    assert hi is not None  # a kv layout: checked above
    if not bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise UnusableSummary("a summary holding NaN or infinities", "summary_values")
    if not bool((lo <= hi).all()):
        raise UnusableSummary("a summary with a block's min above its max", "summary_values")
    return lo, hi


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
    # per layer, this rank's KV heads, until all read; None: every block read (unusable)
    summaries: list[Summary] | None = None
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
        # (key, checksum) of summaries found unusable -> why: not read again
        self._bad: OrderedDict[tuple[bytes, int], str] = OrderedDict()
        self._logged: set[tuple[str, str]] = set()  # (reason, cause) already logged

    def of(self, req_id: str) -> tuple[SparseRead, ...]:
        return tuple(self._reads.get(req_id, ()))

    def take_failed_blocks(self) -> set[int]:
        taken, self.failed_blocks = self.failed_blocks, set()
        return taken

    def add(self, plan: RequestPlan, item: LoadItem) -> None:
        """A sparse load of this step: its summary and digests read and checked now. An
        unusable summary loads the chunk whole; any other failure fails the load (vLLM
        computes the chunk). Never raises."""
        source = item.sparse
        assert source is not None
        start, end = item.actual_start, item.actual_start + item.num_tokens
        reads = [r for r in self._reads.pop(plan.req_id, []) if (r.start, r.end) != (start, end)]
        delta = start - item.entry_offset - item.lease.layout.virtual_start
        read = SparseRead(plan.req_id, start, end, delta, item, source, plan.block_ids)
        try:
            self._sources(read)
        except SparseReadFailed as err:
            self._fall_back(read, err.reason, err)
            self._fail(read)
        except Exception as err:  # a stored entry that nothing checked, or a bug
            self._fall_back(read, "error", err)
            self._fail(read)
        self._reads[plan.req_id] = [*reads, read]
        while len(self._reads) > KEPT_REQUESTS:
            self._reads.popitem(last=False)

    def _sources(self, read: SparseRead) -> None:
        """``read``'s blocks, digests and summaries (None where its summary is unusable:
        every block is read)."""
        item, source = read.item, read.source
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
        known_bad = self._bad.get(_identity(source.summary))
        leases = [source.digests] if known_bad else [source.digests, source.summary]
        outs = [torch.empty(lease.nbytes, dtype=torch.uint8) for lease in leases]
        verdicts = client.read_each(leases, outs, session=item.session)
        if verdicts[0] is not None:
            raise SparseReadFailed(f"block digests unreadable: {verdicts[0]}", "digests")
        read.digests = self._digests(outs[0], source.digests.layout, blocks)
        read.blocks = blocks
        if known_bad:  # logged when it was found
            self.stats.add("sparse_fallbacks", label="summary_known_bad")
            return
        try:
            if verdicts[1] is not None:
                raise UnusableSummary(str(verdicts[1]), "summary_unreadable")
            lo, hi = summary_of(outs[1], source.summary.layout, layout, source.block)
            heads = self.cache.heads.local_slice()
            read.summaries = summaries(
                lo[:, :, heads], hi[:, :, heads], blocks.block, blocks.tokens
            )
        except UnusableSummary as err:
            self._unusable(read, err)

    def _digests(
        self, buffer: torch.Tensor, stored: EntryLayout, blocks: EntryBlocks
    ) -> torch.Tensor:
        """The entry's block digests [2, layers, blocks] out of their bytes, checked."""
        if stored.kind != "kv" or stored.entry_kind != EntryKind.SUMMARY:
            raise SparseReadFailed(f"not block digests: {stored}", "digests")
        keys, values = tensors_of(buffer, stored)
        assert values is not None  # a kv layout: checked above
        try:
            digests = digests_of(keys, values)
        except ValueError as err:
            raise SparseReadFailed(str(err), "digests") from err
        if digests.shape != (2, blocks.layers, blocks.count):
            raise SparseReadFailed(
                f"digests of shape {tuple(digests.shape)} for {blocks}", "digests"
            )
        return digests

    def forget(self, req_ids: set[str]) -> None:
        """These requests finished: their reads go."""
        for req_id in req_ids:
            self._reads.pop(req_id, None)

    def read_layer(self, read: SparseRead, layer: int, queries: torch.Tensor, scale: float) -> None:
        """The blocks of ``layer`` that ``queries`` (the question's, this layer's, this
        rank's heads, rotated to where they stand) need, read, checked, their keys rotated
        to where the chunk stands: ``read.kept[layer]``. With ``candidates``, the bound
        keeps blocks up to it, their keys are read, and the question's exact attention over
        them keeps blocks up to ``threshold``, whose values are then read. Every block where
        the summary is unusable. Never raises (the hook runs inside vLLM's forward): a
        failure of any kind fails the load (vLLM computes the chunk)."""
        if read.failed or layer in read.kept:
            return
        try:
            self._read_layer(read, layer, queries, scale)
        except Exception as err:
            self._fall_back(read, "error", err)
            self._fail(read)

    def _read_layer(
        self, read: SparseRead, layer: int, queries: torch.Tensor, scale: float
    ) -> None:
        assert read.blocks and read.digests is not None
        both: tuple[torch.Tensor, torch.Tensor] | None = None
        if read.summaries is not None:
            began = time.perf_counter()
            summary = read.summaries[layer]
            entry_queries = queries_in_entry_frame(queries, read.delta, self.keys.rotary)
            shares = estimated_shares(entry_queries, summary, scale)
            self.stats.add("sparse_choose_seconds", time.perf_counter() - began)
            if bool(torch.isfinite(shares).all()):
                both = self._read_chosen(read, layer, summary, entry_queries, shares, scale)
            else:  # finite values, yet scores that overflow
                self._unusable(read, UnusableSummary("scores that overflow", "summary_values"))
        if read.failed:  # a read failed: vLLM computes the chunk
            return
        if read.summaries is None:  # unusable: every block, as a whole load
            every = self._read(read, layer, list(range(read.blocks.count)), (0, 1))
            both = None if every is None else _halves(every)
        if both is None:
            return
        keys, values = both
        began = time.perf_counter()
        if read.delta:
            cos, sin = rotation_table(self.keys.rotary, read.delta, keys.shape[0])
            keys = rotate_keys(keys, cos, sin, self.keys.rotary, out=torch.empty_like(keys))
        read.kept[layer] = (keys, values)
        self.stats.add("sparse_read_seconds", time.perf_counter() - began)
        self.stats.add("sparse_whole_bytes", read.item.lease.nbytes // read.blocks.layers)
        if len(read.kept) == read.blocks.layers:
            read.summaries = read.digests = None  # every layer read: the choice is kept

    def _read_chosen(
        self,
        read: SparseRead,
        layer: int,
        summary: Summary,
        entry_queries: torch.Tensor,
        shares: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values of the blocks ``shares`` choose (with ``candidates``: of
        those the exact attention over the candidates' keys keeps); None where a read
        failed."""
        source = read.source
        began = time.perf_counter()
        mask = choose(shares, summary.lo.shape[1], source.candidates or source.threshold)
        wanted = mask.any(0)  # every KV head of this rank reads what any of them chose
        chosen = wanted.nonzero().flatten().tolist()
        self.stats.add("sparse_choose_seconds", time.perf_counter() - began)
        if not source.candidates:
            both = self._read(read, layer, chosen, (0, 1))
            return None if both is None else _halves(both)
        candidates = self._read(read, layer, chosen, (0,))
        if candidates is None:
            return None
        began = time.perf_counter()
        kept = refine(entry_queries, candidates, chosen, summary, source.threshold, scale).any(0)
        self.stats.add("sparse_choose_seconds", time.perf_counter() - began)
        values = self._read(read, layer, kept.nonzero().flatten().tolist(), (1,))
        if values is None:
            return None
        rows = token_mask(kept[None], summary)[0, token_mask(wanted[None], summary)[0]]
        return candidates[rows], values

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
            self.stats.add("sparse_fallbacks", label="read")
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

    def _unusable(self, read: SparseRead, err: UnusableSummary) -> None:
        """``read``'s summary may not steer it: every block is read from now on; one whose
        bytes are those committed (not a failed checksum or lease) is not read again."""
        read.summaries = None
        self._fall_back(read, err.reason, err)
        if err.reason != "summary_unreadable":
            self._bad[_identity(read.source.summary)] = err.reason
            while len(self._bad) > KEPT_BAD_SUMMARIES:
                self._bad.popitem(last=False)

    def _fall_back(self, read: SparseRead, reason: str, err: Exception) -> None:
        """Counted under ``reason``; logged once per reason and summary (an error: and per
        kind of exception, with its traceback)."""
        self.stats.add("sparse_fallbacks", label=reason)
        key = read.source.summary.key.hex()
        cause = (reason, key if reason != "error" else f"{key} {type(err).__name__}")
        if cause in self._logged:
            return
        if len(self._logged) >= KEPT_BAD_SUMMARIES:
            self._logged.clear()
        self._logged.add(cause)
        loaded = "loading the chunk whole" if reason.startswith("summary") else "computing it"
        log.error(
            "chunkstore: request %s: sparse load of entry %s by summary %s failed over "
            "(sparse_fallbacks, %s: %s); %s",
            read.req_id,
            read.item.key.hex(),
            key,
            reason,
            err,
            loaded,
            exc_info=reason == "error",
        )


def _identity(summary: LeasedEntry) -> tuple[bytes, int]:
    """A stored summary as it was committed: a later one under its key is another."""
    return summary.key, summary.checksum


def _halves(both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values read one after the other: [2 x tokens, ...] in two."""
    keys, values = both.chunk(2)
    return keys, values
