"""Loads (worker process): hit entries copied out of the pool into vLLM's paged KV cache at
the slots of their actual positions, keys re-rotated by p - v.

Staged: an entry is read into a staging buffer kept from step to step and checked, then
written into the cache layer by layer on a background thread while the model computes
(``LayerLoads``), or all at once before the forward. Packed: an exact prefix entry stored
as this cache's own blocks is read straight into them, and is done. Any doubt on a load: it
fails, vLLM is told which blocks, and it computes them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from chunkstore.client import Pieces
from chunkstore.connector_config import ConnectorConfig, load_cpus
from chunkstore.errors import ChunkStoreError
from chunkstore.kv.entry import tensors_of
from chunkstore.kv.paging import PAD_SLOT

from .client_holder import DaemonLink
from .common import ChunkStoreMetadata, LoadItem, LoadsEnded, RequestPlan
from .held_parts import HeldPart, held_rows, row_bytes, row_starts
from .keys import ModelKeys
from .layer_loads import LayerLoads, place_thread
from .metrics import ConnectorStats
from .registered_cache import RegisteredCache
from .sparse_reads import SparseReads

log = logging.getLogger("chunkstore.connector")

PlannedLoad = tuple[RequestPlan, LoadItem]


class LoadFailed(ChunkStoreError):
    """This load cannot be done; the tokens are computed instead."""


class DaemonDown(LoadFailed):
    """The link is down (it warned when it went down)."""


@dataclass
class Fetched:
    """One load, read out of the pool and checked, ready to be written layer by layer."""

    plan: RequestPlan
    item: LoadItem
    keys: torch.Tensor  # [layers, tokens, local heads, head_dim], at the entry's positions
    values: torch.Tensor | None  # None: an MLA latent (keys)
    # cos, sin of actual - virtual position (plus the chunk's shift where it is ``placed``),
    # one table per rotary kind (``LayerRotary.kinds``: Gemma 3's local and global bases)
    rotations: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None
    slots: torch.Tensor
    # Under vLLM's hybrid KV-cache manager: each KV-cache group's slots and the tokens they
    # take (``RegisteredCache.group_slots``); a layer writes its group's (empty: ``slots``)
    groups: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] = ()


def _aligned(nbytes: int) -> int:
    """Room an entry takes in the staging buffer: each starts on a 64-byte boundary, so any
    dtype can view it whatever the entries before it held."""
    return -(-nbytes // 64) * 64


class Loads:
    """Each step's loads, from the scheduler's leases to vLLM's cache; what failed (blocks
    vLLM computes) and which requests' loads ended (leases the scheduler releases)."""

    def __init__(
        self,
        cache: RegisteredCache,
        keys: ModelKeys,
        config: ConnectorConfig,
        link: DaemonLink,
        stats: ConnectorStats,
    ) -> None:
        self.cache = cache
        self.keys = keys
        self.config = config
        self.link = link
        self.stats = stats
        self.cpus = load_cpus(config.load_cpus)  # again once vLLM bound its threads
        self.threads = config.load_threads
        self._layer_loads: LayerLoads | None = None
        self._failed_blocks: set[int] = set()
        self._ended = LoadsEnded()
        # Asynchronous loads (``RequestPlan.receiving``): the requests whose loads this step
        # carries, and those of them that failed (reported by request, not by block)
        self._receiving: set[str] = set()
        self._failed_requests: set[str] = set()
        self._overlap = config.overlap_layers  # this step's: none after the forward
        # Where loads are read to, kept from step to step: a fresh buffer each step would
        # fault in every page of it first (~2 GB/s, slower than the copy itself).
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._writers: ThreadPoolExecutor | None = None
        # This step's chunks loaded where they are attended, per request (start -> shift;
        # ``RequestPlan.placed``): those of requests whose every load read back; None for a
        # request one of whose loads failed (``moved_by_load``).
        self.placed: dict[str, dict[int, int] | None] = {}
        self.sparse: SparseReads | None = None  # where sparse loads go (the hook's)

    def place_threads(self) -> None:
        """Where the load threads run: vLLM has bound this thread to its compute cores by
        now, so "spare" is the rest."""
        self.cpus = load_cpus(self.config.load_cpus)
        if self.cpus is not None:  # more writers than cores only contend
            self.threads = max(1, min(self.config.load_threads, len(self.cpus)))
        log.info(
            "chunkstore: %d load thread(s) on CPUs %s (vLLM computes on %s)",
            self.threads,
            "vLLM's" if self.cpus is None else sorted(self.cpus),
            sorted(os.sched_getaffinity(0)),
        )

    # A step ---------------------------------------------------------------------------------

    def start(self, metadata: ChunkStoreMetadata, place: bool = False) -> None:
        """Read and check every entry now, all at once over two threads (the model waits
        for this step's loads: its cores are idle). An exact prefix entry stored as this
        cache's own blocks is read straight into them, and is done; every other entry is
        read into a staging buffer, then written into the cache layer by layer on a
        background thread (``LayerLoads``) while the model computes, or all at once.
        ``place``: the isolation hook moves chunks (``placed``)."""
        self.finish()  # a previous step's, should vLLM not have asked for its results
        receiving = {plan.req_id for plan in metadata.requests if plan.receiving}
        self._receiving |= receiving
        # vLLM's asynchronous loads start after the forward: no layer waits for them.
        self._overlap = self.config.overlap_layers and not receiving
        loads = self._read_now(metadata)
        if not loads:
            return
        began = time.perf_counter()
        failures, pieces = self._packed_targets(loads)
        self._start_writers()
        buffers: dict[int, torch.Tensor | HeldPart]
        if self.cache.cp_group is not None:  # context parallelism: nothing is packed
            buffers, via_shm = self._read_held(loads, failures)
        else:
            staged = [i for i, fail in enumerate(failures) if fail is None and i not in pieces]
            staging = dict(zip(staged, self._buffers([loads[i][1] for i in staged]), strict=True))
            if pieces and not staging and self._overlap:
                whole = all(loads[i][1].num_tokens % self.cache.block_size == 0 for i in pieces)
                if whole:  # a part block would overwrite what vLLM writes into it, by layer
                    self._layer_loads = self._packed_loads(loads, pieces, failures)
                    return
            buffers = dict(staging)
            targets: dict[int, torch.Tensor | Pieces] = {**pieces, **staging}
            readable = sorted(targets)
            verdicts, via_shm = self._read(
                [loads[i] for i in readable], [targets[i] for i in readable]
            )
            for i, verdict in zip(readable, verdicts, strict=True):
                failures[i] = verdict
        # A chunk that moves this step (relevant_last) is loaded rotated to where it is
        # attended, not rotated again in the cache by the hook: unless one of its request's
        # loads failed (vLLM computes it again from the first failed block: the step that
        # does moves each chunk once).
        failed = {loads[i][0].req_id for i, failure in enumerate(failures) if failure}
        if place:
            self.placed = {plan.req_id: plan.placed() for plan in metadata.requests}
            self.placed.update(dict.fromkeys(failed))
        fetched = self._settle(loads, failures, pieces, buffers, via_shm)
        read = time.perf_counter() - began
        self.stats.add("read_seconds", read)
        self.stats.add("load_seconds", read)
        if fetched:
            self._layer_loads = self._staged_writes(fetched)

    def _read_now(self, metadata: ChunkStoreMetadata) -> list[tuple[RequestPlan, LoadItem]]:
        """The step's loads read now, whole; a sparse one goes to the hook, which reads it
        layer by layer (none: it fails, and vLLM computes it)."""
        loads = []
        for plan in metadata.requests:
            if plan.receiving and not plan.loads:  # vLLM waits for tokens nothing supplies
                self._failed_requests.add(plan.req_id)
            for item in plan.loads:
                if item.sparse is None:
                    loads.append((plan, item))
                elif self.sparse is not None:  # read in the hook, layer by layer
                    self.sparse.add(plan, item)
                else:  # no hook to read it: vLLM computes it
                    self._failed(plan, item)
        return loads

    def moved_by_load(self, req_id: str) -> dict[int, int] | None:
        """The chunks of a request this step's loads put where they are attended (start ->
        shift), or None where one of its loads failed: vLLM drops the step's result for it
        and computes it again from the first failed block, so nothing of it may move now
        (the chunks the failed step kept would move twice)."""
        return self.placed.get(req_id, {})

    def wait(self, layer_name: str) -> None:
        """Before a layer's attention: until its loads are in the cache."""
        if self._layer_loads is not None:
            self._layer_loads.wait(self.cache.layer_index[layer_name])

    def finish(self) -> None:
        """End of the step: the background loads are done. If the model did not wait for
        every layer it may have read one before it was loaded: those loads count as failed
        and vLLM computes them (never wrong KV); overlap is turned off from then on. What
        was placed is forgotten: vLLM starts a step's loads after its forward where the step
        loads nothing, so the next forward must not see this step's."""
        self.placed = {}
        loads, self._layer_loads = self._layer_loads, None
        if loads is None:
            return
        error = loads.finish()
        self.stats.add("load_seconds", loads.seconds)
        self.stats.add(f"{loads.phase}_seconds", loads.seconds)
        self.stats.add("wait_seconds", loads.wait_seconds)
        if error is None and not loads.all_waited():
            log.warning(
                "chunkstore: vLLM did not wait for every layer's load (waited for %d of %d); "
                "those loads are computed, and layers load before the forward from now on",
                len(loads.waited),
                len(self.cache.layers),
            )
            self.config = replace(self.config, overlap_layers=False)
        elif error is not None:
            log.warning("chunkstore: loading KV failed: %s; computing instead", error)
        loads.settle(error is None and loads.all_waited())

    def failed_blocks(self) -> set[int]:
        """The blocks whose loads failed since last asked (the step's loads finished)."""
        self.finish()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def received(self) -> tuple[set[str], set[str]]:
        """The requests whose asynchronous loads ended since last asked: loaded, failed."""
        self.finish()
        failed = self._receiving & self._failed_requests
        received = self._receiving - failed
        self._receiving, self._failed_requests = set(), set()
        return received, failed

    def ended(self) -> LoadsEnded | None:
        """The requests whose loads ended this step, for the scheduler to release their leases."""
        ended, self._ended = self._ended, LoadsEnded()
        return ended if ended.shm_bytes else None

    def shutdown(self) -> None:
        if self._writers is not None:
            self._writers.shutdown(wait=True)

    # Staged and packed ----------------------------------------------------------------------

    def _packed_targets(
        self, loads: list[PlannedLoad]
    ) -> tuple[list[ChunkStoreError | None], dict[int, Pieces]]:
        """Each load's failure so far (a packed entry this cache cannot take), and where
        each packed one goes: its cache blocks."""
        failures: list[ChunkStoreError | None] = [None] * len(loads)
        pieces: dict[int, Pieces] = {}
        for i, (plan, item) in enumerate(loads):
            try:
                blocks = self._cache_blocks(plan, item)  # None: not packed
            except LoadFailed as err:
                failures[i] = err
                continue
            if blocks is not None:
                pieces[i] = blocks
        return failures, pieces

    def _start_writers(self) -> None:
        if self._writers is None:
            self._writers = ThreadPoolExecutor(
                max(2, self.threads),
                thread_name_prefix="chunkstore-load",
                initializer=place_thread,
                initargs=(self.cpus,),
            )

    def _packed_loads(
        self,
        loads: list[PlannedLoad],
        pieces: dict[int, Pieces],
        failures: list[ChunkStoreError | None],
    ) -> LayerLoads:
        """Packed entries only: read on a background thread, front to back together, so a
        layer is ready as soon as every entry's blocks of it are in (a packed entry holds
        its layers one after another). Checked at the end of the step, once read whole: a
        mismatch fails its blocks then, and vLLM drops this step's token for that request
        and computes them (as for any load error)."""
        readable = sorted(pieces)
        layers = len(self.cache.layers)
        per_layer = [loads[i][1].lease.nbytes // layers for i in readable]
        read: dict[str, Any] = {}

        def produce(mark: Callable[[int], None]) -> None:
            read["verdicts"], read["via_shm"] = self._read(
                [loads[i] for i in readable],
                [pieces[i] for i in readable],
                threads=2 if self.threads > 1 else 1,
                progress=lambda done: mark(min(done // size for size in per_layer)),
            )

        def settle(ok: bool) -> None:
            if not ok:
                for plan, item in loads:
                    self._failed(plan, item)
                return
            for i, verdict in zip(readable, read["verdicts"], strict=True):
                failures[i] = verdict
            self._settle(loads, failures, pieces, {}, read["via_shm"])

        return LayerLoads(layers, produce, settle, self._overlap, self.cpus, phase="read")

    def _staged_writes(self, fetched: list[Fetched]) -> LayerLoads:
        """The fetched entries written layer by layer (a layer's side by side on the
        writers: the write kernels run without the GIL)."""
        writers = self._writers if self.threads > 1 else None

        def produce(mark: Callable[[int], None]) -> None:
            for layer in range(len(self.cache.layers)):
                if writers is None or len(fetched) < 2:
                    for entry in fetched:
                        self._write_layer(entry, layer)
                else:
                    for write in [writers.submit(self._write_layer, e, layer) for e in fetched]:
                        write.result()  # raises what the write raised
                mark(layer + 1)

        def settle(ok: bool) -> None:
            for entry in fetched:
                if ok:
                    self._count_loaded(entry.item)
                else:
                    self._failed(entry.plan, entry.item)

        layers = len(self.cache.layers)
        return LayerLoads(layers, produce, settle, self._overlap, self.cpus)

    def _settle(
        self,
        loads: list[PlannedLoad],
        failures: list[ChunkStoreError | None],
        pieces: dict[int, Pieces],
        buffers: dict[int, torch.Tensor | HeldPart],
        via_shm: bool,
    ) -> list[Fetched]:
        """Count the loads that were read: a packed one is in the cache and done, the
        others are to be written (returned); failed ones are computed."""
        fetched: list[Fetched] = []
        for i, (plan, item) in enumerate(loads):
            self._ended.shm_bytes.setdefault(plan.req_id, 0)
            try:
                failure = failures[i]
                if failure is not None:
                    raise failure
                if i in pieces:  # in the cache already
                    self._count_loaded(item, block_copied=True)
                else:
                    fetched.append(self._checked(plan, item, buffers[i]))
            except ChunkStoreError as err:
                if not isinstance(err, DaemonDown):
                    self.link.trouble(f"load of {item.key.hex()[:12]}", err)
                self._failed(plan, item)
                continue
            if via_shm:
                read = buffers.get(i)
                part = read.data.numel() if isinstance(read, HeldPart) else item.lease.nbytes
                self._ended.shm_bytes[plan.req_id] += part
        return fetched

    def _failed(self, plan: RequestPlan, item: LoadItem) -> None:
        """vLLM is told these blocks did not load, and computes them; an asynchronous
        load's request is (``received``): the hybrid manager takes no failed blocks."""
        self.stats.add("load_failures")
        if plan.receiving:
            self._failed_requests.add(plan.req_id)
            return
        slots = self.cache.slots(plan.block_ids, item.actual_start, item.num_tokens)
        slots = slots[slots != PAD_SLOT]  # another context-parallel rank's tokens
        self._failed_blocks.update(int(b) for b in torch.unique(slots // self.cache.block_size))

    def _count_loaded(self, item: LoadItem, block_copied: bool = False) -> None:
        self.stats.add("loaded_tokens", item.num_tokens)
        if item.prefix:
            self.stats.add("prefix_loaded_tokens", item.num_tokens)
        if block_copied:
            self.stats.add("block_copied_tokens", item.num_tokens)

    # Out of the pool ------------------------------------------------------------------------

    def _buffers(self, items: list[LoadItem]) -> list[torch.Tensor]:
        """A slice of the staging buffer for each entry, grown if it must be."""
        need = sum(_aligned(item.lease.nbytes) for item in items)
        if need > self._staging.numel():
            self._staging = torch.empty(need, dtype=torch.uint8)
        buffers, offset = [], 0
        for item in items:
            buffers.append(self._staging[offset : offset + item.lease.nbytes])
            offset += _aligned(item.lease.nbytes)
        return buffers

    def _read(
        self,
        loads: list[PlannedLoad],
        buffers: list[torch.Tensor | Pieces],
        threads: int = 2,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[list[ChunkStoreError | None], bool]:
        """Copy every leased entry out of the pool into its buffer (or its pieces) and check
        it: what went wrong with each (None: read and checked), and whether they came
        through shared memory. The scheduler's leases keep the blocks; the checksum catches
        any torn read. ``progress``: ``client.read_each``'s (one daemon session only)."""
        if not self.cache.layers:
            return [LoadFailed("no usable KV cache layout")] * len(loads), False
        client = self.link.get()
        if client is None:
            return [DaemonDown("daemon unreachable")] * len(loads), False
        failures: list[ChunkStoreError | None] = [None] * len(loads)
        by_session: dict[str, list[int]] = {}
        for i, (_, item) in enumerate(loads):
            by_session.setdefault(item.session, []).append(i)
        last = next(reversed(by_session), None)  # read after the others: its progress is all
        for session, picked in by_session.items():
            try:
                verdicts: list[ChunkStoreError | None] = list(
                    client.read_each(
                        [loads[i][1].lease for i in picked],
                        [buffers[i] for i in picked],
                        session=session,
                        threads=threads,
                        helper=self._writers,  # vLLM binds this thread to its compute cores
                        progress=progress if session == last else None,
                    )
                )
            except ChunkStoreError as err:
                verdicts = [err] * len(picked)
            for i, verdict in zip(picked, verdicts, strict=True):
                failures[i] = verdict
        return failures, client.transport == "shm"

    def _read_held(
        self, loads: list[PlannedLoad], failures: list[ChunkStoreError | None]
    ) -> tuple[dict[int, torch.Tensor | HeldPart], bool]:
        """Under context parallelism: each entry's rows this rank owns (``held_parts``), from
        the pool or over the stream, checked with the group's parts against the keyed sums
        the scheduler's lease carries (its secret key shared by the group through the
        metadata); under a lease without them, whole entries,
        each checked here. Each rank calls the group's all-reduce once either way (a
        collective: every rank has the step's loads). Updates ``failures``; returns what
        was read (by load) and whether through shared memory."""
        cp, group = self.cache.cp, self.cache.cp_group
        client = self.link.get()
        sums = torch.zeros(len(loads), 3, dtype=torch.int64)  # two keyed sums, ranks read
        parts: dict[int, HeldPart] = {}
        for i, (_, item) in enumerate(loads):
            if client is None or not item.lease.summed or failures[i]:
                continue
            pool = client.device_pool
            where = torch.device("cpu") if pool is None else pool.device
            try:
                self._check_layout(item)
                rows = held_rows(item, cp, self.cache.block_size)
                starts = row_starts(item.lease.layout, rows, where)
                row = row_bytes(item.lease.layout)
                data = torch.empty(len(starts) * row, dtype=torch.uint8, device=where)
                sums[i, :2] = client.read_runs(item.lease, starts, row, data, item.session).cpu()
                sums[i, 2] = 1
                parts[i] = HeldPart(rows, data)
            except ChunkStoreError as err:
                failures[i] = err
        dist.all_reduce(sums, group=group.cpu_group)
        for i in parts:
            assert client is not None  # they were read through it
            *keyed, ranks = sums[i].tolist()
            lease, session = loads[i][1].lease, loads[i][1].session
            if ranks != cp.size:  # the sums are not the whole entry's: nothing is known
                failures[i] = LoadFailed(f"{cp.size - ranks} other rank(s) could not read theirs")
            else:
                failures[i] = client.check_sums(lease, keyed, session)
        whole = [i for i, failure in enumerate(failures) if failure is None and i not in parts]
        buffers = dict(zip(whole, self._buffers([loads[i][1] for i in whole]), strict=True))
        verdicts, _ = self._read([loads[i] for i in whole], [buffers[i] for i in whole])
        for i, verdict in zip(whole, verdicts, strict=True):
            failures[i] = verdict
        return {**buffers, **parts}, client is not None and client.transport == "shm"

    def _check_layout(self, item: LoadItem) -> None:
        layout, want = item.lease.layout, self.keys.layout
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
            want.num_layers,
            want.num_kv_heads,
            want.head_dim,
            self.keys.kv_dtype,
        ):
            raise LoadFailed(f"entry layout {layout} does not match the model's")

    def _checked(
        self, plan: RequestPlan, item: LoadItem, buffer: torch.Tensor | HeldPart
    ) -> Fetched:
        """One entry read into ``buffer`` (or this rank's part of it), ready to write, if
        its layout is the model's."""
        self._check_layout(item)
        layout = item.lease.layout
        heads = self.cache.heads.local_slice()
        groups: tuple[tuple[torch.Tensor, torch.Tensor | None], ...] = ()
        if self.cache.groups.hybrid:  # each layer to its group's blocks, those there are
            try:
                groups = tuple(
                    self.cache.group_slots(plan.tables(), item.actual_start, item.num_tokens)
                )
            except ValueError as err:
                raise LoadFailed(str(err)) from err
        slots = self.cache.slots(plan.block_ids, item.actual_start, item.num_tokens)
        read = item.lease.nbytes
        if isinstance(buffer, HeldPart):  # the rows this rank owns, the loaded ones written
            whole_keys, whole_values = buffer.tensors(layout)
            mine: Any = buffer.loaded(item)
            slots, read = slots[slots != PAD_SLOT], buffer.data.numel()
        else:
            whole_keys, whole_values = tensors_of(buffer, layout)
            mine = slice(item.entry_offset, item.entry_offset + item.num_tokens)
        keys = whole_keys[:, mine][:, :, heads]
        values = None if whole_values is None else whole_values[:, mine][:, :, heads]
        if self.cache.cp.size > 1 and not isinstance(buffer, HeldPart):
            local = slots != PAD_SLOT  # context parallelism: only the tokens this rank holds
            keys, slots = keys[:, local], slots[local]
            values = None if values is None else values[:, local]
        if self.cache.cp.size > 1:
            self.stats.add("cp_read_bytes", read)
            self.stats.add("cp_held_bytes", item.lease.nbytes * len(slots) // layout.num_tokens)
        delta = item.actual_start - item.entry_offset - layout.virtual_start
        delta += (self.placed.get(plan.req_id) or {}).get(item.actual_start, 0)
        rotations = self.keys.layers.tables(delta, len(slots)) if delta else None
        return Fetched(plan, item, keys, values, rotations, slots, groups)

    def _cache_blocks(self, plan: RequestPlan, item: LoadItem) -> Pieces | None:
        """Where a packed entry's bytes go, in their order: each layer's cache blocks at the
        request's positions (a block the load skips: scratch); None for an entry that is not
        packed. Whole blocks at the positions the entry was computed at, into a cache of the
        same packing, or not at all (``LoadFailed``). A last block loaded in part is copied
        whole: the rest of it is this request's own block, which vLLM fills after the load
        (a block its prefix cache shares is always full, and never loaded into)."""
        layout, cache, size = item.lease.layout, self.cache, self.cache.block_size
        if not layout.packing:
            return None
        self._check_layout(item)
        if layout.packing != cache.packing:
            raise LoadFailed(
                f"entry packed as {layout.packing!r}; this cache's blocks are "
                f"{cache.packing or 'not packable'!r}"
            )
        entry_blocks = layout.num_tokens // size
        if (
            item.entry_offset % size
            or item.actual_start % size
            or item.actual_start - item.entry_offset != layout.virtual_start
            or layout.num_tokens % size
            or layout.nbytes != len(cache.block_bytes) * entry_blocks * cache.scratch.shape[0]
        ):
            raise LoadFailed("a packed entry loads only whole blocks at its own positions")
        lo, count = item.entry_offset // size, -(-item.num_tokens // size)
        first = item.actual_start // size
        ids = plan.block_ids[first : first + count]
        return Pieces(
            [
                blocks[ids[j - lo]] if lo <= j < lo + count else cache.scratch
                for blocks in cache.block_bytes
                for j in range(entry_blocks)
            ]
        )

    def _write_layer(self, entry: Fetched, layer: int) -> None:
        name, cache = self.cache.layers[layer]
        kind = self.keys.layers.of_layer[layer]  # the layer's own rotary
        keys = entry.keys[layer]
        values = None if entry.values is None else entry.values[layer]
        rotation = None if entry.rotations is None else entry.rotations[kind]
        slots = entry.slots
        if entry.groups:  # the layer's KV-cache group's blocks, the tokens it holds
            slots, held = entry.groups[self.cache.layer_groups[layer]]
            if held is not None:
                keys = keys[held]
                values = None if values is None else values[held]
                # every row is the same rotation (one delta): as many as tokens written
                rotation = None if rotation is None else (rotation[0][held], rotation[1][held])
            if not len(slots):
                return
        self.cache.access.write_rotated(
            name, cache, keys, values, slots, rotation, self.keys.layers.kinds[kind]
        )
