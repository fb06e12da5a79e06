"""What travels from the scheduler to the workers each step: small, typed, serializable."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadItem:
    """Copy tokens [entry_offset, entry_offset + num_tokens) of entry ``key`` into the
    request's positions from ``actual_start``. The entry records the virtual start its keys
    were computed at; the worker rotates them by the difference."""

    key: bytes
    entry_offset: int
    actual_start: int
    num_tokens: int


@dataclass(frozen=True)
class SaveItem:
    """Store positions [start, start + num_tokens) of the request as entry ``key``; vLLM
    computed them under exactly the entry's isolation context, at ``start``."""

    key: bytes
    start: int
    num_tokens: int


@dataclass
class RequestPlan:
    req_id: str
    block_ids: list[int]
    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)


@dataclass
class ChunkStoreMetadata(KVConnectorMetadata):
    requests: list[RequestPlan] = field(default_factory=list)
