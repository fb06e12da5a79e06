"""The connector's settings: ``kv_connector_extra_config``, the one JSON that the connector
(``chunkstore_vllm``), the router (``--connector-config``, the order it sends a prompt's chunks
in) and the benches read, so that they agree on it. What a deployment serves of them is the
connector's decision (``chunkstore_vllm.config.for_deployment``: it reads vLLM's config);
``back_end`` and ``policy`` are read from its result. What the hook serves on a model, read
from the model's HF config alone (``served_on_model``), is decided here: the connector and
``bench quality`` read it the same way."""

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
from chunkstore.policy.treatment import BackEnd, Policy, QualityConfig


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
    # The isolation mask inside vLLM's attention (the workers' hook), where the back end is
    # the one it wraps: vLLM's CPU attention (``for_deployment`` decides, once).
    inband_isolation: bool = True
    # Chunks computed as if standing this many tokens after sys (in the keys: each needs
    # in-band isolation).
    virtual_gap: int = 0
    # Answer quality under isolation (each needs in-band isolation; docs/answer-quality.md),
    # set as flat keys of the same names.
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
    # a sparse read of a long document chooses its blocks by, read without the entry
    # (docs/sparse-loads.md). 0: none.
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
    # What this deployment's back end serves (the hook, recompute): ``for_deployment``'s
    # decision, not a key of the extra config; read through ``back_end``.
    decided: BackEnd | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """From ``kv_connector_extra_config``: its keys are this class's fields and, flat
        beside them, ``QualityConfig``'s."""
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"quality", "decided"}
        quality_names = set(QualityConfig.names())
        unknown = sorted(set(extra) - own - quality_names)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: "
                f"{sorted(own | quality_names)}"
            )
        policy = Policy.from_extra(extra)  # the quality settings, as the router reads them
        own_keys = {k: v for k, v in extra.items() if k not in quality_names}
        config = cls(**own_keys, quality=policy.quality)
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

    @property
    def back_end(self) -> BackEnd:
        """What the back end serves: every part reads this, never ``inband_isolation`` (the
        hook asked for); ``for_deployment`` decides it, once (until then: as asked)."""
        return self.decided or BackEnd(inband=self.inband_isolation)

    @property
    def policy(self) -> Policy:
        """What a prompt's chunks get, on this back end (``chunkstore.policy.treatment``)."""
        return Policy(self.quality, self.isolation_mode, self.virtual_gap, self.back_end)


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


# What the in-band hook serves on a model, from its HF config alone (``for_deployment`` adds
# what vLLM's config decides: the device, parallelism, the KV-cache manager).


def served_on_model(config: ConnectorConfig, hf_config: Any) -> ConnectorConfig:
    """The settings the hook serves for the model of ``hf_config`` on one rank of vLLM's CPU
    back end: off where the model refuses it (``hook_refused_by_model``), narrowed where it
    serves less (``within_model_limits``)."""
    if not config.inband_isolation:
        return config
    if hook_refused_by_model(config, hf_config):
        return replace(config, inband_isolation=False, sparse_threshold=0.0, sparse_candidates=0.0)
    return within_model_limits(config, hf_config)


def hook_refused_by_model(config: ConnectorConfig, hf_config: Any) -> str | None:
    """Why the hook cannot serve this model, or None: an MLA model (its cache holds one
    latent a token, which vLLM's CPU attention over K and V does not), ``virtual_gap`` with
    sliding-window layers (the hook's window counts positions from sys)."""
    if hf_config is not None and is_mla(hf_config):
        return "an MLA model's latent cache"
    if any(model_rotary(hf_config).windows) and config.virtual_gap > 0:
        return "virtual_gap with sliding-window layers"
    return None


def within_model_limits(config: ConnectorConfig, hf_config: Any) -> ConnectorConfig:
    """What the hook serves for a model whose layers attend through a window or rotate keys
    differently."""
    layers = model_rotary(hf_config)
    windowed = any(layers.windows)
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
    if windowed or len(layers.kinds) > 1:  # sparse reads rotate with one rotary
        config = replace(config, sparse_threshold=0.0, sparse_candidates=0.0)
    return config


def model_limits(hf_config: Any) -> str | None:
    """What the hook does not serve for this model (``within_model_limits``), or None."""
    layers = model_rotary(hf_config)
    if any(layers.windows):
        return (
            "sliding-window layers: the hook isolates chunks with each layer's window; "
            "relevant_last moves, recompute, question re-weighting, gap filling and sparse "
            "reads are off"
        )
    if len(layers.kinds) > 1:  # Gemma 3: base 1e4 in sliding layers, 1e6 in global ones
        return "layers rotate keys differently: sparse reads are off"
    return None


def model_rotary(hf_config: Any) -> LayerRotary:
    """Each layer's rotary and window (none known, or an MLA model: one kind, no window)."""
    none = LayerRotary((), (), ())
    if hf_config is None or is_mla(hf_config):
        return none
    try:
        return LayerRotary.from_hf_config(hf_config)
    except UnsupportedRotaryError:  # no remap at all: the key space says so (``ModelKeys``)
        return none
