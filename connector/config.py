"""What this deployment serves of the connector's settings (``ConnectorConfig``, in
chunkstore: the router and the benches read them too), decided once from vLLM's config:
``for_deployment``, and what it reads there."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from chunkstore.connector_config import (
    ConnectorConfig,
    hook_refused_by_model,
    model_limits,
    model_rotary,
    within_model_limits,
)
from chunkstore.policy.treatment import BackEnd


def unsupported_parallelism(vllm_config: Any) -> str | None:
    """Why the connector must stay off for this deployment, or None. Pipeline parallelism
    spreads a request's layers over ranks, which the worker does not follow (it loads and
    saves every layer it is given as the whole model's). Context parallelism is served:
    under decode context parallelism each rank loads the tokens it holds and saves gather
    them (``decode_context_parallel``); prefill context parallelism does not shard the
    cache (``prefill_context_parallel``)."""
    size = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if size > 1:
        return f"pipeline_parallel_size={size} is not supported"
    return None


def decode_context_parallel(vllm_config: Any) -> int:
    """Ranks a request's KV cache is sharded over by token (1: none)."""
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def prefill_context_parallel(vllm_config: Any) -> int:
    """Ranks a request's prefill is split over by token (1: none). Each computes its share
    of the tokens, and every one writes every token's KV into its own cache (vLLM 0.32's
    model runner V2: the gathered KV and its slot mapping, sharded by the decode group
    only, vllm/v1/worker/gpu/pcp_manager.py ``_build_batch_layout`` and
    ``prepare_slot_mappings``; its scheduler counts blocks with ``pcp_world_size=1``,
    vllm/v1/core/sched/scheduler.py:338). vllm-ascend serves none since July 2026 ("remove
    PCP from MRV1", vllm-ascend #12592). So the group's ranks hold the same cache: each
    loads, one stores."""
    return int(getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) or 1)


def device_type(vllm_config: Any) -> str:
    """The device vLLM runs the model on (``cpu``, ``cuda``, ``npu``, ...): its device
    config's, else (a config without one) the platform's."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if not device:
        try:
            from vllm.platforms import current_platform
        except ImportError:  # no vLLM (the doctor's reading of a model): the CPU build's
            return "cpu"
        device = current_platform.device_type or "cpu"
    return str(device)


def hook_refused(config: ConnectorConfig, vllm_config: Any) -> str | None:
    """Why the in-band hook cannot serve this deployment, or None. It wraps vLLM's CPU
    attention and attends a chunk's rows over its own keys on one rank: another device's
    attention back end (CUDA, Ascend), context parallelism (a rank's cache holds a share of
    every chunk's tokens, decode, or a rank computes a share of them, prefill), what the
    model refuses (``hook_refused_by_model``: MLA, ``virtual_gap`` with sliding-window
    layers) and a sliding-window model under vLLM's hybrid
    KV-cache manager (``hybrid_kv_cache``: its sliding layers free the blocks before their
    window, where a chunk's rows read sys's keys; the connector that is not ``SupportsHMA``
    keeps the hook, full KV everywhere) are served without it."""
    device = device_type(vllm_config)
    if device != "cpu":
        return f"the {device} attention back end (the hook wraps vLLM's CPU attention)"
    if decode_context_parallel(vllm_config) * prefill_context_parallel(vllm_config) > 1:
        return "context parallelism: each rank holds or computes a share of every chunk"
    refused = hook_refused_by_model(config, hf_config_of(vllm_config))
    if refused:
        return refused
    if any(model_rotary(hf_config_of(vllm_config)).windows) and hybrid_kv_cache(vllm_config):
        return (
            "vLLM's hybrid KV-cache manager (ChunkStoreHybridConnector): a sliding-window "
            "layer's blocks before its window are freed, where a chunk's rows read sys's keys"
        )
    return None


def hybrid_kv_cache(vllm_config: Any) -> bool:
    """Whether vLLM keeps its hybrid KV-cache manager on (a ``SupportsHMA`` connector, and
    not ``--disable-hybrid-kv-cache-manager``): sliding-window layers then free the blocks
    out of their window (``cache_groups``); decided before any connector exists."""
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    return getattr(scheduler_config, "disable_hybrid_kv_cache_manager", True) is False


def for_deployment(
    config: ConnectorConfig, vllm_config: Any, say: logging.Logger | None = None
) -> ConnectorConfig:
    """The settings this deployment can serve, decided once, here: ``back_end`` (the hook,
    recompute), which the scheduler and the workers read. Where the hook cannot serve the
    deployment (``hook_refused``) it is off, and with it recompute, moves and sparse loads:
    stored chunks are loaded (isolated, as the router or ingest stored them), exact
    prefixes shared, and the relevant chunks standing last left to vLLM (what the router's
    order sends). A model whose layers rotate keys differently or attend through a window
    keeps the hook with what it serves there (``hook_limits``). ``say``: the log that tells
    the operator (the scheduler's: once an engine)."""
    no_recompute = unsupported_recompute(vllm_config)
    refused = hook_refused(config, vllm_config) if config.inband_isolation else None
    served = config
    if refused:
        served = replace(
            config, inband_isolation=False, sparse_threshold=0.0, sparse_candidates=0.0
        )
    elif config.inband_isolation:
        served = within_model_limits(config, hf_config_of(vllm_config))
    hook = served.inband_isolation
    served = replace(served, decided=BackEnd(inband=hook, recompute=hook and not no_recompute))
    if say is not None:
        _say_back_end(say, config, served, refused, no_recompute, hook_limits(vllm_config))
    return served


def _say_back_end(
    say: logging.Logger,
    asked: ConnectorConfig,
    served: ConnectorConfig,
    refused: str | None,
    no_recompute: str | None,
    limits: str | None,
) -> None:
    """The back end's decision, for the operator: once, with what it means for the router."""
    if refused:
        idle = [
            name
            for name, on in (
                ("recompute_chunks", asked.quality.recompute_chunks),
                ("recompute_tokens", asked.quality.recompute_tokens),
                ("question re-weighting", asked.quality.reweights_questions),
                ("sparse_threshold", asked.sparse_threshold),
            )
            if on
        ]
        say.warning(
            "chunkstore: in-band isolation is off (%s): stored chunks load isolated and "
            "none is stored from requests; the relevant chunks standing last are left to "
            "vLLM. Put `chunkstore router` in front (its --order relevant-last, with this "
            "--connector-config) to send them there and store chunks from live traffic, or "
            "store them with `chunkstore ingest`%s",
            refused,
            f"; off with the hook: {', '.join(idle)}" if idle else "",
        )
    elif not served.back_end.inband:
        say.info("chunkstore: in-band isolation is off (inband_isolation: false)")
    elif limits:
        say.warning("chunkstore: in-band isolation: %s", limits)
    quality = served.quality
    recomputes = quality.relevant_recompute_tokens and quality.relevant_last
    if served.back_end.inband and no_recompute and recomputes:
        say.info(
            "chunkstore: relevant chunks are attended last, never recomputed: %s", no_recompute
        )


def hook_limits(vllm_config: Any) -> str | None:
    """What the hook does not serve for this deployment's model (``for_deployment``), or
    None."""
    return model_limits(hf_config_of(vllm_config))


def hf_config_of(vllm_config: Any) -> Any:
    """The model's HF config in vLLM's config (None: none known)."""
    return getattr(getattr(vllm_config, "model_config", None), "hf_config", None)


# The models whose decoder layers the workers' recomputer drives (``recompute``).
RECOMPUTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def unsupported_recompute(vllm_config: Any) -> str | None:
    """Why the workers cannot recompute chunks for this deployment, as far as its config
    tells (the scheduler's view; the workers check the loaded model itself), or None."""
    tensor_parallel = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
    if tensor_parallel > 1:
        return f"tensor_parallel_size={tensor_parallel} is not supported"
    model_config = getattr(vllm_config, "model_config", None)
    architectures = list(getattr(model_config, "architectures", None) or [])
    if not set(architectures) & set(RECOMPUTED_ARCHITECTURES):
        return f"{architectures} is not one of {list(RECOMPUTED_ARCHITECTURES)}"
    return None
