"""Worker side: copy hit chunks from the pool into vLLM's paged KV cache at the slots of their
actual positions, keys re-rotated by p - v; store what the scheduler marked for saving.

vLLM's CPU attention keeps one tensor per layer, [blocks, kv_heads, block_size, 2 * head_size]:
viewed as [blocks, kv_heads, 2 * block_size, head_size], the first block_size rows are K and
the rest V (vllm/v1/attention/backends/cpu_attn.py). Writes go through vLLM's own
``cpu_attn_reshape_and_cache``, whatever its kernel's internal layout; reads (for saving)
decode the layout of its "vec" kernels, and only after a probe at start-up shows the kernel
wrote exactly that (otherwise saving is off, loudly). Any doubt on a load: it fails, vLLM is
told which blocks, and it computes them.

``WorkerSide`` is what the connector calls: it registers the caches (here: which access,
which heads, whether they read back, the isolation hook) and hands each step to ``Loads``
(``loads.py``, with ``LayerLoads`` in ``layer_loads.py``) and ``Saves`` (``saves.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from chunkstore.connector_config import ConnectorConfig
from chunkstore.errors import LayoutError

from .cache_groups import CacheGroups
from .client_holder import DaemonLink
from .common import ChunkStoreMetadata, LoadsEnded
from .config import unsupported_parallelism
from .cpu_layout import CpuKVLayout
from .device_layout import DeviceKVLayout, cache_access
from .heads import RankHeads
from .hook.isolation import IsolationHook
from .keys import ModelKeys
from .layer_loads import LayerLoads
from .loads import DaemonDown, LoadFailed, Loads
from .metrics import ConnectorStats
from .registered_cache import RegisteredCache, context_parallel, prefill_replica
from .saves import Saves, Summaries
from .sparse_reads import SparseReads

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["DaemonDown", "LayerLoads", "LoadFailed", "WorkerSide"]

log = logging.getLogger("chunkstore.connector")


class WorkerSide:
    """What the connector calls in a worker process: set-up here, each step's loads and
    saves handed on."""

    def __init__(
        self, vllm_config: VllmConfig, config: ConnectorConfig, groups: CacheGroups | None = None
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.groups = groups or CacheGroups()  # vLLM's KV-cache groups (hybrid manager)
        self.keys = ModelKeys.from_vllm(vllm_config, config)
        block_size = vllm_config.cache_config.block_size
        heads = self.keys.layout.num_kv_heads
        self.cache = RegisteredCache(
            CpuKVLayout(vllm_config, block_size), RankHeads(0, 1, heads, heads), block_size
        )
        self.hook: IsolationHook | None = None
        self.stats = ConnectorStats()
        self.link = DaemonLink(config, "chunkstore-worker", self.stats)
        self.link.populate = config.populate_pool
        self.loads = Loads(self.cache, self.keys, config, self.link, self.stats)
        self.saves = Saves(
            self.cache,
            self.keys,
            self.link,
            self.stats,
            Summaries(config.sparse_summary_tokens, config.sparse_block),
        )
        # Long chunks loaded sparse, in the hook (``sparse_threshold``; none without it).
        self.sparse = SparseReads(self.cache, self.keys, self.link, self.stats)

    # Set-up --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        off = unsupported_parallelism(self.vllm_config)
        if off:
            log.warning("chunkstore: %s; loading and saving are off", off)
            return
        self.loads.place_threads()
        self.cache.set_layers(kv_caches, self.groups)
        self.cache.cp, self.cache.cp_group = context_parallel(self.vllm_config)
        self.cache.replica = prefill_replica(self.vllm_config)
        why = self._unusable_cache()
        if why:
            log.warning("chunkstore: %s; loading and saving are off: vLLM computes", why)
            self.cache.layers = []
            return
        if not self.cache.readable:
            log.warning(
                "chunkstore: the attention kernel's cache layout is not plain; "
                "saving and in-band isolation are off (loads still go through vLLM's own "
                "write op)"
            )
        # a block: every token, every layer (not under the hybrid manager: a layer's block
        # is its group's, and a sliding-window group's may be gone)
        single = self.cache.heads.size == 1 and self.cache.cp.size == 1 and not self.groups.hybrid
        if single and isinstance(self.cache.access, CpuKVLayout):
            self.cache.pack(self.cache.access.packing(self.cache.layers, self.keys.kv_dtype))
        if self.cache.readable and isinstance(self.cache.access, CpuKVLayout):
            self.cache.access.warm_up(*self.cache.layers[0], self.keys.rotary)
        self.link.connect_early()
        hook = self.config.back_end.inband  # decided once (``config.for_deployment``)
        if hook and self.keys.rotary_refused:
            log.info("chunkstore: in-band isolation is off: %s", self.keys.rotary_refused)
        elif hook:
            self._install_hook()

    def _unusable_cache(self) -> str | None:
        """Why this worker's KV caches can be neither loaded into nor saved from, or None;
        on the way, the cache access, this rank's heads and whether the cache reads back
        as written (``readable``: a probe) are set."""
        layout, cache = self.keys.layout, self.cache
        first = cache.layers[0]
        if self.groups.unsupported:
            return f"vLLM's hybrid KV-cache manager with {self.groups.unsupported}"
        if self.groups.hybrid and cache.cp.size > 1:
            return "context parallelism under vLLM's hybrid KV-cache manager"
        try:
            latent = self.keys.rotary.rotary_offset if layout.kind == "mla" else 0
            cache.access = cache_access(
                self.vllm_config, cache.block_size, first[1], layout.head_dim, latent
            )
            shapes = {
                (cache.access.local_heads(c), cache.access.head_dim(c)) for _, c in cache.layers
            }
        except LayoutError as err:
            return str(err)
        fits = len(shapes) == 1 and next(iter(shapes))[1] == layout.head_dim
        if len(cache.layers) != layout.num_layers or not fits:
            return (
                f"KV caches of (heads, head_dim) {sorted(shapes)} in {len(cache.layers)} layers "
                f"do not fit the model's {layout.num_layers} layers"
            )
        try:
            cache.heads = self._rank_heads()
        except ValueError as err:
            return str(err)
        cache.readable = cache.access.probe(*first)
        if isinstance(cache.access, DeviceKVLayout):  # loads copy the pool to the device
            self.link.pin_for = cache.access.layout.views(first[1])[0].device.type
            if not cache.readable:
                return (
                    f"the {cache.access.layout.name} cache probe did not find the back end's "
                    "own write where the layout reads (loads count as load_failures)"
                )
        return None

    def _install_hook(self) -> None:
        """The isolation mask inside vLLM's attention; refused, with one warning, where the
        hook cannot serve the attention back end (attention stays vLLM's: chunks computed
        in a request then see their neighbours, and only segments that causal attention
        isolates are saved)."""
        access = self.cache.access
        why = "the cache layout probe failed" if not self.cache.readable else None
        if not isinstance(access, CpuKVLayout):
            why = f"it serves vLLM's CPU attention only, not a {access.layout.name} cache"
        if why is None:
            assert isinstance(access, CpuKVLayout)
            hook = IsolationHook(
                access,
                self.keys.layers,
                self.config,
                self._isolation_missed,
                self.loads.moved_by_load,
                self.sparse,
            )
            why = hook.install(self.vllm_config, [name for name, _ in self.cache.layers])
            if why is None:
                self.hook = hook
                self.loads.sparse = self.sparse
                return
        log.warning("chunkstore: in-band isolation is off: %s", why)

    def _isolation_missed(self, req_id: str) -> None:
        """A planned request the hook did not find in a batch (vLLM attended it causally)."""
        self.saves.isolation_missed(req_id)
        self.sparse.missed(req_id)

    def _rank_heads(self) -> RankHeads:
        local = self.cache.access.local_heads(self.cache.layers[0][1])
        if local == self.keys.layout.num_kv_heads and self.keys.layout.kind != "mla":
            return RankHeads(0, 1, local, local)
        # Heads split over the tensor-parallel group, or an MLA latent every rank holds
        # whole (tensor rank 0 stores it).
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

    # A step ---------------------------------------------------------------------------------

    def bind(self, metadata: ChunkStoreMetadata) -> None:
        """A step's plans, before its forward (vLLM may start loads after the forward when
        none are synchronous, but the isolation hook needs the plans during it)."""
        if self.hook is not None:
            self.hook.begin_step(metadata.requests)

    def start_load_kv(self, metadata: ChunkStoreMetadata) -> None:
        self.loads.start(metadata, place=self.hook is not None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loads.wait(layer_name)

    def wait_for_save(self, metadata: ChunkStoreMetadata) -> None:
        self.loads.finish()
        self.saves.save(metadata, self.hook)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = self.loads.failed_blocks()
        if self.hook is not None:
            failed |= self.hook.take_failed_blocks()
        return failed | self.sparse.take_failed_blocks()

    def received(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads (the hybrid manager's) ended: loaded, failed."""
        return self.loads.received()

    def loads_ended(self) -> LoadsEnded | None:
        return self.loads.ended()

    def shutdown(self) -> None:
        self.loads.shutdown()
        self.link.close()
