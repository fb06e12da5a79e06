"""The connector's settings, from ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from chunkstore.client import default_address
from chunkstore.kv.keys import Isolation


@dataclass(frozen=True)
class ConnectorConfig:
    address: str = ""  # daemon address: unix:/path or host:port ("" = the default socket)
    token: str = ""
    transport: str = "auto"  # auto | shm | stream
    separator: str | list[int] = "##"  # text (tokenized alone) or token IDs
    isolation: str = "sys"  # sys | none
    save: bool = True  # store what vLLM computed under its isolation context
    min_chunk_tokens: int = 1  # shorter segments are neither looked up nor saved
    reconnect_s: float = 10.0  # how often to retry an unreachable daemon
    timeout_s: float = 1.0  # per call: a hung daemon stalls scheduling no longer than this
    overlap_layers: bool = True  # write layer i + 1 while vLLM computes layer i
    inband_isolation: bool = True  # the isolation mask inside vLLM's attention (worker hook)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        config = cls(**extra)
        Isolation(config.isolation)  # raises on a bad mode
        if config.transport not in ("auto", "shm", "stream"):
            raise ValueError(f"transport must be auto, shm or stream, not {config.transport!r}")
        return config

    @property
    def daemon_address(self) -> str:
        return self.address or default_address()

    @property
    def isolation_mode(self) -> Isolation:
        return Isolation(self.isolation)


def unsupported_parallelism(vllm_config: Any) -> str | None:
    """Why the connector must stay off for this deployment, or None. Context parallelism
    spreads a request's tokens over ranks and pipeline parallelism its layers; the connector
    writes whole entries into one rank's cache, which would put KV in the wrong places."""
    parallel = vllm_config.parallel_config
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            return f"{name}={getattr(parallel, name)} is not supported"
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported"
    return None
