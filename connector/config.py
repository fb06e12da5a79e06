"""The connector's settings, from ``kv_connector_extra_config``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from chunkstore.client import default_address
from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.fingerprint import is_mla
from chunkstore.kv.keys import Isolation
from chunkstore.kv.keyspace import DEFAULT_PREFIX_BLOCK_TOKENS
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.kv.treatment import QualityConfig


@dataclass(frozen=True)
class ConnectorConfig:
    address: str = ""  # daemon address: unix:/path or host:port ("" = the default socket)
    token: str = ""
    transport: str = "auto"  # auto | shm | stream
    separator: str | list[int] = "auto"  # auto (a free special token, else ##), text or IDs
    isolation: str = "sys"  # sys | none
    save: bool = True  # store what vLLM computed under its isolation context
    min_chunk_tokens: int = 1  # shorter segments are neither looked up nor saved
    reconnect_s: float = 10.0  # how often to retry an unreachable daemon
    timeout_s: float = 1.0  # per call: a hung daemon stalls scheduling no longer than this
    overlap_layers: bool = True  # write layer i + 1 while vLLM computes layer i
    load_threads: int = 2  # threads that write a layer's loaded entries side by side
    load_cpus: str = "spare"  # where: spare (cores vLLM does not compute on) | all | vllm | "0-3"
    populate_pool: bool = True  # map the shared pool's pages in the background, not per read
    inband_isolation: bool = True  # the isolation mask inside vLLM's attention (worker hook)
    # Chunks computed as if standing this many tokens after sys (in the keys: each needs
    # in-band isolation).
    virtual_gap: int = 0
    # Answer quality under isolation (each needs in-band isolation; docs/connector.md,
    # "Answer quality"), set as flat keys of the same names.
    quality: QualityConfig = QualityConfig()
    # A chunk recomputed whole that the request computes anyway (not loaded) is computed
    # once, where it is attended, and not stored by this request (a request that uses it
    # isolated stores it); false: computed isolated too, stored, then recomputed.
    recompute_in_one_pass: bool = True
    # Recomputed tokens ride in vLLM's own forward, after its rows, one pass over the
    # weights (vLLM not compiling: --enforce-eager); false: a pass of their own each step.
    recompute_in_vllm_batch: bool = True
    # A chunk that missed between stored ones is computed by the workers' hook, isolated,
    # so the stored chunks after it load (vLLM computes a prompt from its first miss on);
    # Llama and Qwen2, no tensor parallelism, in-band isolation (else the loaded run stops).
    fill_gaps: bool = True
    # Plain prompts (no separator) share their exact prefix KV through the store in blocks
    # of this many tokens (rounded up to a multiple of vLLM's block size; 0: off).
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS
    # ... and store the blocks of what they generate, so a chat's next turn loads this one.
    save_generated: bool = True
    # Chunks of at least this many tokens are stored with a summary of their keys (each
    # block of sparse_block tokens' min and max, 1/sparse_block of the entry's bytes): what
    # a sparse read of a long document chooses its blocks by, read without the entry (seed
    # 002; docs/whats-left.md). 0: none.
    sparse_summary_tokens: int = 1024
    sparse_block: int = 16
    # Long stored chunks (with a summary) are loaded sparse: per layer only the blocks that
    # cover this share of the question's estimated attention (kv.sparse.select), and the
    # question and every token after it attend only those (in the hook; vLLM's prefix
    # cache keeps those blocks private). 0: off, every chunk loaded whole; 1: every block,
    # through the same path (a check).
    sparse_threshold: float = 0.0
    # ... chosen in two steps: the bound keeps blocks up to this share of the estimated
    # attention, their keys are read, and the question's exact attention over those keys
    # keeps blocks up to sparse_threshold, whose values are read (kv.sparse.refine). 0: the
    # bound chooses alone.
    sparse_candidates: float = 0.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """From ``kv_connector_extra_config``: its keys are this class's fields and, flat
        beside them, ``QualityConfig``'s."""
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"quality"}
        quality_names = set(QualityConfig.names())
        unknown = sorted(set(extra) - own - quality_names)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: "
                f"{sorted(own | quality_names)}"
            )
        quality = QualityConfig.from_settings({k: extra.pop(k) for k in quality_names & set(extra)})
        config = cls(**extra, quality=quality)
        Isolation(config.isolation)  # raises on a bad mode
        if config.transport not in ("auto", "shm", "stream"):
            raise ValueError(f"transport must be auto, shm or stream, not {config.transport!r}")
        if min(config.virtual_gap, config.prefix_block_tokens, config.sparse_summary_tokens) < 0:
            raise ValueError(
                "virtual_gap, prefix_block_tokens and sparse_summary_tokens: counts >= 0"
            )
        if config.sparse_block < 1:
            raise ValueError(f"sparse_block: tokens a block, >= 1, not {config.sparse_block}")
        for name in ("sparse_threshold", "sparse_candidates"):
            if not 0 <= getattr(config, name) <= 1:
                raise ValueError(
                    f"{name}: a share of the attention, 0 (off) to 1, not {getattr(config, name)}"
                )
        if config.sparse_threshold and not (
            config.inband_isolation and config.sparse_summary_tokens
        ):
            raise ValueError(
                "sparse_threshold reads the blocks a question needs in the in-band isolation "
                "hook, chosen by the summaries stored with long chunks: it needs "
                "inband_isolation and sparse_summary_tokens > 0"
            )
        if config.load_threads < 1:
            raise ValueError(f"load_threads must be >= 1, not {config.load_threads}")
        load_cpus(config.load_cpus)  # raises on a bad list
        if (config.virtual_gap or config.quality.needs_hook) and not config.inband_isolation:
            raise ValueError(
                "virtual_gap, recompute_chunks, recompute_tokens, question_temperature and "
                "question_scale act in the in-band isolation hook: they need inband_isolation "
                "(relevant_last does not: without the hook, relevant chunks that stand last "
                "are left to vLLM to compute)"
            )
        return config

    @property
    def daemon_address(self) -> str:
        return self.address or default_address()

    @property
    def isolation_mode(self) -> Isolation:
        return Isolation(self.isolation)


def load_cpus(text: str, bound: set[int] | None = None) -> set[int] | None:
    """The CPUs the connector's load threads may run on (``load_cpus``); None: where vLLM
    put the thread that starts them.

    vLLM's CPU worker binds its thread, and so every thread it starts, to its compute
    cores, keeping the rest (``VLLM_CPU_NUM_OF_RESERVED_CPU``) for its scheduler. The loads
    run beside the forward: on the compute cores they slow it down, while the reserved ones
    idle. "spare" puts them on the cores the calling thread is not bound to (``bound``, by
    default its own affinity: vLLM's compute cores), or on all where none is spare (a GPU
    worker); "all" on every core."""
    if text == "vllm":
        return None
    everything = set(range(os.cpu_count() or 1))
    if text == "all":
        return everything
    if text == "spare":
        return everything - (os.sched_getaffinity(0) if bound is None else bound) or everything
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        cpus = set()
    if not cpus:
        raise ValueError(
            f"load_cpus must be spare, all, vllm or a CPU list like 0-3,8, not {text!r}"
        )
    return cpus


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


def for_deployment(config: ConnectorConfig, vllm_config: Any) -> ConnectorConfig:
    """The settings this deployment can serve: under context parallelism a rank's cache
    holds a share of every chunk's tokens (decode), or a rank computes a share of them
    (prefill), so in-band isolation (the hook attends a chunk's rows over its own keys,
    on one rank) is off, and with it recompute, moves and sparse loads: stored chunks are
    loaded (isolated, as the router or ingest stored them) and exact prefixes shared, as on
    a back end without the hook. The same for an MLA model (``latent_attention``) and a
    sliding-window one with ``virtual_gap`` (the hook's window counts positions from sys).
    A model whose layers rotate keys differently or attend through a window keeps the hook
    with what it serves there (``hook_limits``). Under vLLM's hybrid KV-cache manager
    (``hybrid_kv_cache``) a sliding-window model's hook is off too: its sliding layers free
    the blocks before their window, where a chunk's rows (at their virtual positions) read
    sys's keys; the connector that is not ``SupportsHMA`` keeps it (full KV everywhere)."""
    parallel = decode_context_parallel(vllm_config) * prefill_context_parallel(vllm_config)
    windowed = any(layer_rotary(vllm_config).windows)
    hookless = latent_attention(vllm_config) or (
        windowed and (config.virtual_gap > 0 or hybrid_kv_cache(vllm_config))
    )
    if not config.inband_isolation:
        return config
    if parallel > 1 or hookless:
        return replace(config, inband_isolation=False)
    if windowed:
        # Moves, recompute and question re-weighting attend chunks where vLLM's kernel
        # counts other positions (its window covers where tokens stand in the cache).
        quality = replace(
            config.quality,
            relevant_last=0,
            recompute_chunks=0,
            recompute_tokens=0,
            question_temperature=1.0,
            question_scale=1.0,
        )
        config = replace(config, quality=quality, fill_gaps=False)
    if windowed or several_rotaries(vllm_config):  # sparse reads rotate with one rotary
        config = replace(config, sparse_threshold=0.0, sparse_candidates=0.0)
    return config


def hybrid_kv_cache(vllm_config: Any) -> bool:
    """Whether vLLM keeps its hybrid KV-cache manager on (a ``SupportsHMA`` connector, and
    not ``--disable-hybrid-kv-cache-manager``): sliding-window layers then free the blocks
    out of their window (``cache_groups``); decided before any connector exists."""
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    return getattr(scheduler_config, "disable_hybrid_kv_cache_manager", True) is False


def hook_limits(vllm_config: Any) -> str | None:
    """What the hook does not serve for this model (``for_deployment``), or None."""
    if any(layer_rotary(vllm_config).windows):
        return (
            "sliding-window layers: the hook isolates chunks with each layer's window; "
            "relevant_last moves, recompute, question re-weighting, gap filling and sparse "
            "reads are off"
        )
    if several_rotaries(vllm_config):
        return "layers rotate keys differently: sparse reads are off"
    return None


def latent_attention(vllm_config: Any) -> bool:
    """Whether the model attends through MLA (DeepSeek V2 / V3): its cache holds one latent a
    token, which the hook (vLLM's CPU attention over K and V) does not serve."""
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    return hf_config is not None and is_mla(hf_config)


def layer_rotary(vllm_config: Any) -> LayerRotary:
    """Each layer's rotary and window (none known: one kind, no window)."""
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    none = LayerRotary((), (), ())
    if hf_config is None or is_mla(hf_config):
        return none
    try:
        return LayerRotary.from_hf_config(hf_config)
    except UnsupportedRotaryError:  # no remap at all: the key space says so (``ModelKeys``)
        return none


def several_rotaries(vllm_config: Any) -> bool:
    """Whether the model's layers rotate keys differently (Gemma 3: base 1e4 in sliding
    layers, 1e6 in global ones). Loads and the hook rotate each layer with its own; sparse
    reads take one, so they are off."""
    return len(layer_rotary(vllm_config).kinds) > 1


# The models whose decoder layers the workers' recomputer drives (``recompute``).
RECOMPUTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def unsupported_recompute(vllm_config: Any) -> str | None:
    """Why the workers cannot recompute chunks for this deployment, as far as its config
    tells (the scheduler's view; the workers check the loaded model itself), or None."""
    tensor_parallel = getattr(vllm_config.parallel_config, "tensor_parallel_size", 1)
    if tensor_parallel > 1:
        return f"tensor_parallel_size={tensor_parallel} is not supported"
    architectures = list(getattr(vllm_config.model_config, "architectures", None) or [])
    if not set(architectures) & set(RECOMPUTED_ARCHITECTURES):
        return f"{architectures} is not one of {list(RECOMPUTED_ARCHITECTURES)}"
    return None
