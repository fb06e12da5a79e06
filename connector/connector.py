"""``ChunkStoreConnector``: vLLM's KV connector (v1 API) for chunkstore.

    --kv-transfer-config '{"kv_connector": "ChunkStoreConnector",
        "kv_connector_module_path": "chunkstore_vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "unix:/run/chunkstore/chunkstore.sock"}}'

The scheduler side decides (``scheduler.py``), the worker side moves bytes (``worker.py``),
``common.py`` holds what travels between them, ``metrics.py`` what they count.

``ChunkStoreHybridConnector`` is the same connector declaring vLLM's ``SupportsHMA``: vLLM
then keeps its hybrid KV-cache manager on (a sliding-window model's local layers hold only
their window: ``cache_groups.py``), loads go per KV-cache group and asynchronously, and the
in-band hook is off for a model with sliding-window layers (``config.hook_refused``). vLLM
decides on the class, before any connector exists, so the choice is the class name:

    --kv-transfer-config '{"kv_connector": "ChunkStoreHybridConnector", ...}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from chunkstore.connector_config import ConnectorConfig

from .cache_groups import CacheGroups
from .common import ChunkStoreMetadata
from .config import for_deployment
from .metrics import ConnectorPromMetrics, ConnectorStats
from .scheduler import SchedulerSide
from .versions import warn_outside_matrix
from .worker import WorkerSide

if TYPE_CHECKING:  # vLLM's types at the boundary, for the type checker only
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("chunkstore.connector")


class ChunkStoreConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # None where vLLM's factory passes none (older versions); the base is typed for one.
        super().__init__(
            vllm_config=vllm_config,
            role=role,
            kv_cache_config=kv_cache_config,  # type: ignore[arg-type]
        )
        asked = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        # The back end decides the hook once; the scheduler's process says so, once.
        config = for_deployment(asked, vllm_config, log if scheduler else None)
        if scheduler:
            warn_outside_matrix(log)  # once per engine: the scheduler has one connector
            # A chunk that fails to load (daemon gone, entry evicted, checksum) is computed,
            # never served wrong and never a failed request. The scheduler reads this after
            # creating its connector.
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("chunkstore: kv_load_failure_policy set to 'recompute'")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        groups = CacheGroups.from_kv_cache_config(kv_cache_config)
        self.scheduler = SchedulerSide(vllm_config, config, groups) if scheduler else None
        self.worker = (
            WorkerSide(vllm_config, config, groups) if role == KVConnectorRole.WORKER else None
        )

    # Worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, ChunkStoreMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ChunkStoreMetadata)
        self.worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saved whole in wait_for_save, once the step's KV is in the cache

    def wait_for_save(self) -> None:
        assert self.worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ChunkStoreMetadata)
        self.worker.wait_for_save(metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads (the hybrid KV-cache manager's) that ended this step, and those
        that failed among them (vLLM computes those requests whole)."""
        results = super().get_transfer_results(finished_req_ids)
        if self.worker is not None:
            received, failed = self.worker.received()
            results.finished_recving |= received | failed
            results.failed_recving |= failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.loads_ended() if self.worker else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is transferred after a request ends; what the worker kept for it goes."""
        if self.worker is not None:
            self.worker.sparse.forget(finished_req_ids)
        return None, None

    # Both sides ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.worker or self.scheduler
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return ConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.shutdown()

    # Scheduler side ---------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        count = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return count, self.scheduler.loads_async and count > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        tables = blocks.get_block_ids() if self.scheduler.loads_async else ()
        self.scheduler.update_state_after_alloc(request, num_external_tokens, tables)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None


class ChunkStoreHybridConnector(ChunkStoreConnector, SupportsHMA):
    """The connector with vLLM's hybrid KV-cache manager on (module docstring)."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None
