"""Pre-warm a corpus through an in-process ``vllm.LLM`` built with this connector: the daemon
address, separator, isolation mode and model fingerprint come from the LLM's own
``kv_transfer_config``, so the keys are the ones its connector computes.

    llm = LLM(model=..., kv_transfer_config={... "kv_connector": "ChunkStoreConnector" ...})
    summary = ingest_with_llm(llm, chunks, sys_text="You answer from the documents.")

``chat=True`` stores the chunks as chat requests hold them (the model's chat template, the
chunks in the user message: ``chunkstore.prompts``); ``cache_salt`` stores them for the
requests that carry that salt, and for no other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from chunkstore.client import ChunkStoreClient
from chunkstore.connector_config import ConnectorConfig
from chunkstore.ingest import IngestSummary, LLMBackend, ingest
from chunkstore.prompts import RagPrompts

from .keys import ModelKeys


def ingest_with_llm(
    llm: Any,
    chunks: Sequence[str],
    sys_text: str,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    chat: bool = False,
    cache_salt: str = "",
) -> IngestSummary:
    vllm_config = llm.llm_engine.vllm_config
    transfer = vllm_config.kv_transfer_config
    if transfer is None or transfer.kv_connector != "ChunkStoreConnector":
        raise ValueError("this LLM was not built with kv_connector 'ChunkStoreConnector'")
    config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
    keys = ModelKeys.from_vllm(vllm_config, config)
    prompts = RagPrompts(
        llm.get_tokenizer(),
        sys_text,
        chat=chat,
        separator=keys.separator,
        fingerprint=keys.fingerprint,
        isolation=config.isolation_mode,
        virtual_gap=config.virtual_gap,
        cache_salt=cache_salt,
    )
    with ChunkStoreClient(config.daemon_address, token=config.token or None) as client:
        return ingest(LLMBackend(llm), client, prompts, chunks, batch_size, progress)
