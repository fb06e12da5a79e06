"""Worker side: copy hit chunks from the pool into vLLM's paged KV cache at the slots of their
actual positions, keys re-rotated by p - v; store what the scheduler marked for saving.

vLLM's CPU attention keeps one tensor per layer, [blocks, kv_heads, block_size, 2 * head_size]:
viewed as [blocks, kv_heads, 2 * block_size, head_size], the first block_size rows are K and
the rest V (vllm/v1/attention/backends/cpu_attn.py). Writes go through vLLM's own
``cpu_attn_reshape_and_cache``, whatever its kernel's internal layout; reads (for saving)
decode the layout of its "vec" kernels, and only after a probe at start-up shows the kernel
wrote exactly that (otherwise saving is off, loudly). Any doubt on a load: it fails, vLLM is
told which blocks, and it computes them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from chunkstore.client import Pieces
from chunkstore.errors import ChunkStoreError, LayoutError
from chunkstore.kv.entry import EntryLayout, tensors_of
from chunkstore.kv.rope import RotaryConfig, rotation_table

from .client_holder import DaemonLink
from .common import ChunkStoreMetadata, LoadItem, LoadsEnded, RequestPlan, SaveItem
from .config import ConnectorConfig, load_cpus, unsupported_parallelism
from .cpu_layout import CpuKVLayout
from .device_layout import DeviceKVLayout, cache_access
from .heads import RankHeads
from .isolation import IsolationHook
from .keys import ModelKeys
from .metrics import ConnectorStats
from .recompute import IsolatedCopy

log = logging.getLogger("chunkstore.connector")


class LoadFailed(ChunkStoreError):
    """This load cannot be done; the tokens are computed instead."""


class DaemonDown(LoadFailed):
    """The link is down (it warned when it went down)."""


def _layer_index(name: str) -> int:
    numbers = re.findall(r"\.(\d+)\.", name)
    return int(numbers[0]) if numbers else 0


@dataclass
class Fetched:
    """One load, read out of the pool and checked, ready to be written layer by layer."""

    plan: RequestPlan
    item: LoadItem
    keys: torch.Tensor  # [layers, tokens, local heads, head_dim], at the entry's positions
    values: torch.Tensor
    rotation: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin of actual - virtual position
    slots: torch.Tensor


def _aligned(nbytes: int) -> int:
    """Room an entry takes in the staging buffer: each starts on a 64-byte boundary, so any
    dtype can view it whatever the entries before it held."""
    return -(-nbytes // 64) * 64


def place_thread(cpus: set[int] | None) -> None:
    """Let the calling thread run on ``cpus`` (None: leave it where it is)."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:  # none of them allowed here: stay on vLLM's cores
        log.warning("chunkstore: load threads stay on vLLM's cores (load_cpus: %s)", err)


class LayerLoads:
    """A step's loads made ready in vLLM's cache one layer at a time on a background thread,
    so the model computes layer i while layer i + 1 loads; vLLM calls ``wait_for_layer_load``
    before each layer's attention. ``produce(mark)`` does the loading and calls ``mark(n)``
    once layers 0..n-1 are in the cache. Without ``overlap`` it all happens here, before the
    forward. ``settle(ok)`` counts the loads at the end of the step: ``ok`` False when the
    work failed or the model did not wait for every layer (then they are computed)."""

    def __init__(
        self,
        layers: int,
        produce: Callable[[Callable[[int], None]], None],
        settle: Callable[[bool], None],
        overlap: bool,
        cpus: set[int] | None = None,
        phase: str = "write",
    ) -> None:
        self.produce = produce
        self.phase = phase  # the connector's counter of its seconds: write or read
        self.settle = settle
        self.ready = [threading.Event() for _ in range(layers)]
        self.waited: set[int] = set()
        self.error: Exception | None = None
        self.seconds = 0.0  # loading, remap included
        self.wait_seconds = 0.0  # the model blocked in wait()
        self.thread: threading.Thread | None = None
        if overlap:
            self.thread = threading.Thread(
                target=self._run, args=(cpus,), name="chunkstore-load", daemon=True
            )
            self.thread.start()
        else:
            self._run()
            self.waited = set(range(len(self.ready)))
            self.wait_seconds = self.seconds  # loaded before the forward: all of it waited

    def _mark(self, layers: int) -> None:
        for ready in self.ready[:layers]:
            ready.set()

    def _run(self, cpus: set[int] | None = None) -> None:
        began = time.perf_counter()
        place_thread(cpus)
        try:
            self.produce(self._mark)
        except Exception as err:  # reported by finish(); those loads are computed
            self.error = err
        finally:
            self.seconds = time.perf_counter() - began
            self._mark(len(self.ready))  # a failure must not leave the model waiting

    def wait(self, layer: int) -> None:
        self.waited.add(layer)
        ready = self.ready[layer]
        if not ready.is_set():
            began = time.perf_counter()
            ready.wait()
            self.wait_seconds += time.perf_counter() - began

    def all_waited(self) -> bool:
        return len(self.waited) == len(self.ready)

    def finish(self) -> Exception | None:
        if self.thread is not None:
            self.thread.join()
        return self.error


class WorkerSide:
    def __init__(self, vllm_config: Any, config: ConnectorConfig) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.keys = ModelKeys.from_vllm(vllm_config, config)
        self.rotary: RotaryConfig = self.keys.rotary
        self.block_size = vllm_config.cache_config.block_size
        self.layers: list[tuple[str, Any]] = []  # a tensor per layer, or vllm-ascend's (K, V)
        self.cache: CpuKVLayout | DeviceKVLayout = CpuKVLayout(vllm_config, self.block_size)
        self.can_read_cache = False
        self.hook: IsolationHook | None = None
        self._causal_requests: OrderedDict[str, None] = OrderedDict()  # see _isolation_missed
        self._failed_blocks: set[int] = set()
        self._layer_loads: LayerLoads | None = None
        # Where loads are read to, kept from step to step: a fresh buffer each step would
        # fault in every page of it first (~2 GB/s, slower than the copy itself).
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._writers: ThreadPoolExecutor | None = None
        self.load_cpus = load_cpus(config.load_cpus)  # again once vLLM bound its threads
        self.load_threads = config.load_threads
        self._layer_index: dict[str, int] = {}
        self.heads = RankHeads(0, 1, self.keys.layout.num_kv_heads, self.keys.layout.num_kv_heads)
        # Exact prefix blocks are stored as this cache's own blocks where it has a packing
        # (``CpuKVLayout.packing``; "": token by token, as chunks are).
        self.packing = ""
        self._block_bytes: list[np.ndarray] = []  # each layer's blocks, as bytes
        self._scratch = np.empty(0, dtype=np.uint8)
        self._ended = LoadsEnded()
        self.stats = ConnectorStats()
        self.link = DaemonLink(config, "chunkstore-worker", self.stats)
        self.link.populate = config.populate_pool

    # Set-up --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        off = unsupported_parallelism(self.vllm_config)
        if off:
            log.warning("chunkstore: %s; loading and saving are off", off)
            return
        # vLLM has bound this thread to its compute cores by now: "spare" is the rest.
        self.load_cpus = load_cpus(self.config.load_cpus)
        if self.load_cpus is not None:  # more writers than cores only contend
            self.load_threads = max(1, min(self.config.load_threads, len(self.load_cpus)))
        log.info(
            "chunkstore: %d load thread(s) on CPUs %s (vLLM computes on %s)",
            self.load_threads,
            "vLLM's" if self.load_cpus is None else sorted(self.load_cpus),
            sorted(os.sched_getaffinity(0)),
        )
        self.layers = sorted(kv_caches.items(), key=lambda item: _layer_index(item[0]))
        self._layer_index = {name: i for i, (name, _) in enumerate(self.layers)}
        why = self._unusable_cache()
        if why:
            log.warning("chunkstore: %s; loading and saving are off: vLLM computes", why)
            self.layers = []
            return
        if not self.can_read_cache:
            log.warning(
                "chunkstore: the attention kernel's cache layout is not plain; "
                "saving and in-band isolation are off (loads still go through vLLM's own "
                "write op)"
            )
        if self.heads.size == 1 and isinstance(self.cache, CpuKVLayout):
            self.packing = self.cache.packing(self.layers, self.keys.kv_dtype)
        if self.packing:  # each layer's blocks as bytes, where packed entries are read to
            self._block_bytes = [
                cache.view(torch.uint8).view(cache.shape[0], -1).numpy() for _, cache in self.layers
            ]
            self._scratch = np.empty(self._block_bytes[0].shape[1], dtype=np.uint8)
        if self.config.inband_isolation:
            self._install_hook()

    def _unusable_cache(self) -> str | None:
        """Why this worker's KV caches can be neither loaded into nor saved from, or None;
        on the way, the cache access, this rank's heads and whether the cache reads back
        as written (``can_read_cache``: a probe) are set."""
        layout = self.keys.layout
        try:
            self.cache = cache_access(
                self.vllm_config, self.block_size, self.layers[0][1], layout.head_dim
            )
            shapes = {
                (self.cache.local_heads(cache), self.cache.head_dim(cache))
                for _, cache in self.layers
            }
        except LayoutError as err:
            return str(err)
        fits = len(shapes) == 1 and next(iter(shapes))[1] == layout.head_dim
        if len(self.layers) != layout.num_layers or not fits:
            return (
                f"KV caches of (heads, head_dim) {sorted(shapes)} in {len(self.layers)} layers "
                f"do not fit the model's {layout.num_layers} layers"
            )
        try:
            self.heads = self._rank_heads()
        except ValueError as err:
            return str(err)
        self.can_read_cache = self.cache.probe(*self.layers[0])
        if isinstance(self.cache, DeviceKVLayout):  # loads copy the pool to the device
            self.link.pin_for = self.cache.layout.views(self.layers[0][1])[0].device.type
            if not self.can_read_cache:
                return (
                    f"the {self.cache.layout.name} cache probe did not find the back end's own "
                    "write where the layout reads (loads count as load_failures)"
                )
        return None

    def _install_hook(self) -> None:
        """The isolation mask inside vLLM's attention; refused, with one warning, where the
        hook cannot serve the attention back end (attention stays vLLM's: chunks computed
        in a request then see their neighbours, and only segments that causal attention
        isolates are saved)."""
        why = "the cache layout probe failed" if not self.can_read_cache else None
        if not isinstance(self.cache, CpuKVLayout):
            why = f"it serves vLLM's CPU attention only, not a {self.cache.layout.name} cache"
        if why is None:
            assert isinstance(self.cache, CpuKVLayout)
            hook = IsolationHook(self.cache, self.rotary, self.config, self._isolation_missed)
            why = hook.install(self.vllm_config, [name for name, _ in self.layers])
            if why is None:
                self.hook = hook
                return
        log.warning("chunkstore: in-band isolation is off: %s", why)

    def _rank_heads(self) -> RankHeads:
        local = self.cache.local_heads(self.layers[0][1])
        if local == self.keys.layout.num_kv_heads:
            return RankHeads(0, 1, local, local)
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return RankHeads(
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size(),
            self.keys.layout.num_kv_heads,
            local,
        )

    def _slots(self, plan: RequestPlan, start: int, count: int) -> torch.Tensor:
        return self.cache.slots(torch.tensor(plan.block_ids, dtype=torch.int64), start, count)

    # Loads ----------------------------------------------------------------------------------

    def bind(self, metadata: ChunkStoreMetadata) -> None:
        """A step's plans, before its forward (vLLM may start loads after the forward when
        none are synchronous, but the isolation hook needs the plans during it)."""
        if self.hook is not None:
            self.hook.begin_step(metadata.requests)

    def start_load_kv(self, metadata: ChunkStoreMetadata) -> None:
        """Read and check every entry now, all at once over two threads (the model waits
        for this step's loads: its cores are idle). An exact prefix entry stored as this
        cache's own blocks is read straight into them, and is done; every other entry is
        read into a staging buffer, then written into the cache layer by layer on a
        background thread (``LayerLoads``) while the model computes, or all at once."""
        self._finish_loads()  # a previous step's, should vLLM not have asked for its results
        loads = [(plan, item) for plan in metadata.requests for item in plan.loads]
        if not loads:
            return
        began = time.perf_counter()
        failures: list[ChunkStoreError | None] = [None] * len(loads)
        pieces: dict[int, Pieces] = {}  # packed entries: into the cache
        for i, (plan, item) in enumerate(loads):
            try:
                blocks = self._cache_blocks(plan, item)  # None: not packed
            except LoadFailed as err:
                failures[i] = err
                continue
            if blocks is not None:
                pieces[i] = blocks
        staged = [i for i, failure in enumerate(failures) if failure is None and i not in pieces]
        buffers = dict(zip(staged, self._buffers([loads[i][1] for i in staged]), strict=True))
        if self._writers is None:
            self._writers = ThreadPoolExecutor(
                max(2, self.load_threads),
                thread_name_prefix="chunkstore-load",
                initializer=place_thread,
                initargs=(self.load_cpus,),
            )
        if pieces and not buffers and self.config.overlap_layers:
            whole = all(loads[i][1].num_tokens % self.block_size == 0 for i in pieces)
            if whole:  # a part block would overwrite what vLLM writes into it, layer by layer
                self._layer_loads = self._packed_loads(loads, pieces, failures)
                return
        targets: dict[int, torch.Tensor | Pieces] = {**pieces, **buffers}
        readable = sorted(targets)
        verdicts, via_shm = self._read([loads[i] for i in readable], [targets[i] for i in readable])
        for i, verdict in zip(readable, verdicts, strict=True):
            failures[i] = verdict
        fetched = self._settle(loads, failures, pieces, buffers, via_shm)
        read = time.perf_counter() - began
        self.stats.add("read_seconds", read)
        self.stats.add("load_seconds", read)
        if fetched:
            writers = self._writers if self.load_threads > 1 else None
            self._layer_loads = LayerLoads(
                len(self.layers),
                self._writes(fetched, writers),
                lambda ok: self._settle_writes(fetched, ok),
                self.config.overlap_layers,
                self.load_cpus,
            )

    def _packed_loads(
        self,
        loads: list[tuple[RequestPlan, LoadItem]],
        pieces: dict[int, Pieces],
        failures: list[ChunkStoreError | None],
    ) -> LayerLoads:
        """Packed entries only: read on a background thread, front to back together, so a
        layer is ready as soon as every entry's blocks of it are in (a packed entry holds
        its layers one after another). Checked at the end of the step, once read whole: a
        mismatch fails its blocks then, and vLLM drops this step's token for that request
        and computes them (as for any load error)."""
        readable = sorted(pieces)
        layers = len(self.layers)
        per_layer = [loads[i][1].lease.nbytes // layers for i in readable]
        read: dict[str, Any] = {}

        def produce(mark: Callable[[int], None]) -> None:
            read["verdicts"], read["via_shm"] = self._read(
                [loads[i] for i in readable],
                [pieces[i] for i in readable],
                threads=2 if self.load_threads > 1 else 1,
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

        return LayerLoads(layers, produce, settle, True, self.load_cpus, phase="read")

    def _settle(
        self,
        loads: list[tuple[RequestPlan, LoadItem]],
        failures: list[ChunkStoreError | None],
        pieces: dict[int, Pieces],
        buffers: dict[int, torch.Tensor],
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
                self._ended.shm_bytes[plan.req_id] += item.lease.nbytes
        return fetched

    def _writes(
        self, fetched: list[Fetched], writers: ThreadPoolExecutor | None
    ) -> Callable[[Callable[[int], None]], None]:
        """Write the fetched entries layer by layer (a layer's side by side on ``writers``:
        the write kernels run without the GIL)."""

        def produce(mark: Callable[[int], None]) -> None:
            for layer in range(len(self.layers)):
                if writers is None or len(fetched) < 2:
                    for entry in fetched:
                        self._write_layer(entry, layer)
                else:
                    for write in [writers.submit(self._write_layer, e, layer) for e in fetched]:
                        write.result()  # raises what the write raised
                mark(layer + 1)

        return produce

    def _settle_writes(self, fetched: list[Fetched], ok: bool) -> None:
        for entry in fetched:
            if ok:
                self._count_loaded(entry.item)
            else:
                self._failed(entry.plan, entry.item)

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

    def _failed(self, plan: RequestPlan, item: LoadItem) -> None:
        """vLLM is told these blocks did not load, and computes them."""
        self.stats.add("load_failures")
        slots = self._slots(plan, item.actual_start, item.num_tokens)
        self._failed_blocks.update(int(b) for b in torch.unique(slots // self.block_size))

    def _read(
        self,
        loads: list[tuple[RequestPlan, LoadItem]],
        buffers: list[torch.Tensor | Pieces],
        threads: int = 2,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[list[ChunkStoreError | None], bool]:
        """Copy every leased entry out of the pool into its buffer (or its pieces) and check
        it: what went wrong with each (None: read and checked), and whether they came
        through shared memory. The scheduler's leases keep the blocks; the checksum catches
        any torn read. ``progress``: ``client.read_each``'s (one daemon session only)."""
        if not self.layers:
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

    def _check_layout(self, item: LoadItem) -> None:
        layout, want = item.lease.layout, self.keys.layout
        if (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
            want.num_layers,
            want.num_kv_heads,
            want.head_dim,
            self.keys.kv_dtype,
        ):
            raise LoadFailed(f"entry layout {layout} does not match the model's")

    def _checked(self, plan: RequestPlan, item: LoadItem, buffer: torch.Tensor) -> Fetched:
        """One entry read into ``buffer``, ready to write, if its layout is the model's."""
        self._check_layout(item)
        layout = item.lease.layout
        keys, values = tensors_of(buffer, layout)
        assert values is not None
        rows = slice(item.entry_offset, item.entry_offset + item.num_tokens)
        heads = self.heads.local_slice()
        delta = item.actual_start - item.entry_offset - layout.virtual_start
        return Fetched(
            plan,
            item,
            keys[:, rows, heads],
            values[:, rows, heads],
            rotation_table(self.rotary, delta, item.num_tokens) if delta else None,
            slots=self._slots(plan, item.actual_start, item.num_tokens),
        )

    def _cache_blocks(self, plan: RequestPlan, item: LoadItem) -> Pieces | None:
        """Where a packed entry's bytes go, in their order: each layer's cache blocks at the
        request's positions (a block the load skips: scratch); None for an entry that is not
        packed. Whole blocks at the positions the entry was computed at, into a cache of the
        same packing, or not at all (``LoadFailed``). A last block loaded in part is copied
        whole: the rest of it is this request's own block, which vLLM fills after the load
        (a block its prefix cache shares is always full, and never loaded into)."""
        layout, size = item.lease.layout, self.block_size
        if not layout.packing:
            return None
        self._check_layout(item)
        if layout.packing != self.packing:
            raise LoadFailed(
                f"entry packed as {layout.packing!r}; this cache's blocks are "
                f"{self.packing or 'not packable'!r}"
            )
        entry_blocks = layout.num_tokens // size
        if (
            item.entry_offset % size
            or item.actual_start % size
            or item.actual_start - item.entry_offset != layout.virtual_start
            or layout.num_tokens % size
            or layout.nbytes != len(self._block_bytes) * entry_blocks * self._scratch.shape[0]
        ):
            raise LoadFailed("a packed entry loads only whole blocks at its own positions")
        lo, count = item.entry_offset // size, -(-item.num_tokens // size)
        first = item.actual_start // size
        ids = plan.block_ids[first : first + count]
        return Pieces(
            [
                blocks[ids[j - lo]] if lo <= j < lo + count else self._scratch
                for blocks in self._block_bytes
                for j in range(entry_blocks)
            ]
        )

    def _write_layer(self, entry: Fetched, layer: int) -> None:
        name, cache = self.layers[layer]
        self.cache.write_rotated(
            name,
            cache,
            entry.keys[layer],
            entry.values[layer],
            entry.slots,
            entry.rotation,
            self.rotary,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_loads is not None:
            self._layer_loads.wait(self._layer_index[layer_name])

    def _finish_loads(self) -> None:
        """End of the step: the background loads are done. If the model did not wait for
        every layer it may have read one before it was loaded: those loads count as failed
        and vLLM computes them (never wrong KV); overlap is turned off from then on."""
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
                len(self.layers),
            )
            self.config = replace(self.config, overlap_layers=False)
        elif error is not None:
            log.warning("chunkstore: loading KV failed: %s; computing instead", error)
        loads.settle(error is None and loads.all_waited())

    def _count_loaded(self, item: LoadItem, block_copied: bool = False) -> None:
        self.stats.add("loaded_tokens", item.num_tokens)
        if item.prefix:
            self.stats.add("prefix_loaded_tokens", item.num_tokens)
        if block_copied:
            self.stats.add("block_copied_tokens", item.num_tokens)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def loads_ended(self) -> LoadsEnded | None:
        """The requests whose loads ended this step, for the scheduler to release their leases."""
        ended, self._ended = self._ended, LoadsEnded()
        return ended if ended.shm_bytes else None

    # Saves ----------------------------------------------------------------------------------

    def wait_for_save(self, metadata: ChunkStoreMetadata) -> None:
        """Store the segments the scheduler marked. Under tensor parallelism every rank reads
        its heads and they are gathered (a collective, so every rank takes every step here);
        rank 0 stores the entry, which holds all heads."""
        self._finish_loads()
        blended: dict[str, IsolatedCopy] = {}
        moved: dict[str, dict[int, int]] = {}
        if self.hook is not None:
            blended, moved = self.hook.end_step()
            self.stats.add("isolated_tokens", self.hook.take_isolated_tokens())
            self.stats.add("recomputed_tokens", sum(len(c.positions) for c in blended.values()))
        if not self.can_read_cache:
            return
        began = time.perf_counter()
        saved = False
        for plan in metadata.requests:
            for item in plan.saves:
                if item.isolated and not self._isolated(plan.req_id):
                    continue  # computed seeing other chunks: never stored
                packed = self._packed(plan, item)
                if packed is None:
                    keys, values = self._read_segment(plan, item)
                if packed is None and plan.req_id in blended:  # the cache holds the blend
                    try:  # put isolation back
                        blended[plan.req_id].restore(item.start, keys, values)
                    except ValueError as err:
                        log.error("chunkstore: not saving %s: %s", item.key.hex()[:12], err)
                        self.stats.add("save_failures")
                        continue
                if self.heads.rank != 0:
                    continue
                client = self.link.get()
                if client is None:
                    continue
                try:
                    # Moved this step (relevant_last): its keys stand ``shift`` further on.
                    virtual_start = item.start + moved.get(plan.req_id, {}).get(item.start, 0)
                    # False: another request stored (or is storing) it first.
                    kind = "prefix" if item.prefix else "chunk"
                    if packed is not None:
                        stored = client.put_packed(item.key, *packed)
                    else:
                        stored = client.put(item.key, keys, values, virtual_start, kind)
                    if stored:
                        self.stats.add("saved_segments")
                        self.stats.add("saved_tokens", item.num_tokens)
                        if item.prefix:
                            self.stats.add("prefix_saved_tokens", item.num_tokens)
                        saved = True
                except ChunkStoreError as err:
                    self.stats.add("save_failures")
                    self.link.trouble(f"save of {item.key.hex()[:12]}", err)
        if saved:
            self.stats.add("save_seconds", time.perf_counter() - began)

    def _isolation_missed(self, req_id: str) -> None:
        """The hook could not find a planned request's rows in the batch: vLLM computed its
        chunk tokens causally, so none of its chunks may be stored."""
        self.stats.add("isolation_misses")
        if not self._causal_requests:
            log.warning(
                "chunkstore: request %s was not found in the attention batch; its chunks "
                "were computed seeing each other and are not stored",
                req_id,
            )
        self._causal_requests[req_id] = None
        while len(self._causal_requests) > 10_000:
            self._causal_requests.popitem(last=False)

    def _isolated(self, req_id: str) -> bool:
        """Whether every chunk token this request computed was served by the hook."""
        return self.hook is not None and req_id not in self._causal_requests

    def _packed(self, plan: RequestPlan, item: SaveItem) -> tuple[EntryLayout, torch.Tensor] | None:
        """An exact prefix block of whole cache blocks, as the cache's own blocks (all
        heads: one rank); None where it is saved token by token."""
        size = self.block_size
        if not (self.packing and item.prefix) or item.start % size or item.num_tokens % size:
            return None
        first = item.start // size
        ids = torch.tensor(plan.block_ids[first : first + item.num_tokens // size])
        assert isinstance(self.cache, CpuKVLayout)  # only its caches are packed
        blocks = torch.stack([self.cache.read_blocks(cache, ids) for _, cache in self.layers])
        model = self.keys.layout
        layout = EntryLayout(
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            self.keys.kv_dtype,
            "kv",
            item.num_tokens,
            item.start,
            "prefix",
            self.packing,
        )
        return layout, blocks

    def _read_segment(self, plan: RequestPlan, item: SaveItem) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a segment, [layers, tokens, every head, head_dim], from vLLM's cache."""
        slots = self._slots(plan, item.start, item.num_tokens)
        pairs = [self.cache.read(cache, slots) for _, cache in self.layers]
        keys = torch.stack([k for k, _ in pairs])
        values = torch.stack([v for _, v in pairs])
        if self.heads.size == 1:
            return keys, values
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return self.heads.gather(keys, 2, group), self.heads.gather(values, 2, group)

    def shutdown(self) -> None:
        if self._writers is not None:
            self._writers.shutdown(wait=True)
        self.link.close()
