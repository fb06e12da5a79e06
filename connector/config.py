"""The connector's settings, from ``kv_connector_extra_config``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from chunkstore.client import default_address
from chunkstore.kv.keys import Isolation

from .selection import RECOMPUTE_BY

# On Qwen2.5-Coder with 8 documents: at most the three BM25 ranks highest, those scoring at
# least half the best (the one-fact and two-fact questions; over 120 cases of each length
# from ~50 to ~500 tokens they hold every answer document more often than a fixed two, and
# are fewer): docs/benchmarks.md, "Answer quality".
DEFAULT_RELEVANT_LAST = 3
DEFAULT_RELEVANT_MIN_SCORE = 0.5
# ... and recomputed there when each holds at most this many tokens (within
# selection.recompute_budget): on ~200-token documents (held-out) that answers 15 of 24,
# as full prefill does, where recomputing them where they stand answers 12 and moving them
# alone 12.
DEFAULT_RELEVANT_RECOMPUTE_TOKENS = 384
# ... and a longer one's tokens around what matches the question, this many (``span``):
# off by default, as 128 changed no answer of 24 held-out cases of ~500-token documents
# (16 of 24 either way, full prefill 15) for 9% of the chunk tokens recomputed.
DEFAULT_RELEVANT_SPAN_TOKENS = 0
# ... and, when they are, the first tokens of every other chunk with them (EPIC's choice:
# where isolation leaves each chunk an attention sink): on ~200-token documents that and
# the relevant chunks answer 16 of 24 where the relevant chunks alone answer 13.
DEFAULT_RELEVANT_FIRST_TOKENS = 16
# LMCache's chunk size: a prefix entry per 256 tokens.
DEFAULT_PREFIX_BLOCK_TOKENS = 256


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
    # Answer quality under isolation (each needs in-band isolation; docs/connector.md,
    # "Answer quality"):
    virtual_gap: int = 0  # chunks computed as if standing this many tokens after sys
    recompute_chunks: int = 0  # N chunks recomputed whole, seeing everything before them
    recompute_by: str = "relevance"  # which: relevance (BM25) | position (the last N)
    recompute_max_tokens: int = 0  # at most this many chunk tokens recomputed (0: no cap)
    recompute_tokens: int = 0  # each chunk's first N tokens recomputed seeing all before them
    question_temperature: float = 1.0  # APE: question's scores against chunk keys / this
    question_scale: float = 1.0  # APE: the chunks' share of its attention times this
    # At most N chunks most relevant to the question attended last (0 where chunks or
    # tokens are recomputed, or without in-band isolation, unless set) ...
    relevant_last: int = DEFAULT_RELEVANT_LAST
    # ... of those BM25 scores at least this share of the best (0: always N) ...
    relevant_min_score: float = DEFAULT_RELEVANT_MIN_SCORE
    # ... and recomputed there when each holds at most this many tokens (0: only moved).
    relevant_recompute_tokens: int = DEFAULT_RELEVANT_RECOMPUTE_TOKENS
    # ... a longer one in part: this many tokens around what matches the question (0: not).
    relevant_span_tokens: int = DEFAULT_RELEVANT_SPAN_TOKENS
    # ... and then the first N tokens of every other chunk too (0: not).
    relevant_first_tokens: int = DEFAULT_RELEVANT_FIRST_TOKENS
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

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}"
            )
        recovers_otherwise = extra.get("recompute_chunks") or extra.get("recompute_tokens")
        if "relevant_last" not in extra and (
            recovers_otherwise or not extra.get("inband_isolation", True)
        ):
            extra["relevant_last"] = 0  # the default gives way to what was asked for
        config = cls(**extra)
        Isolation(config.isolation)  # raises on a bad mode
        if config.transport not in ("auto", "shm", "stream"):
            raise ValueError(f"transport must be auto, shm or stream, not {config.transport!r}")
        counts = (
            config.virtual_gap,
            config.recompute_chunks,
            config.recompute_tokens,
            config.recompute_max_tokens,
            config.relevant_last,
            config.relevant_recompute_tokens,
            config.relevant_span_tokens,
            config.relevant_first_tokens,
            config.prefix_block_tokens,
        )
        if min(counts) < 0:
            raise ValueError(
                "virtual_gap, recompute_chunks, recompute_tokens, recompute_max_tokens, "
                "relevant_last, relevant_recompute_tokens, relevant_span_tokens, "
                "relevant_first_tokens and prefix_block_tokens are counts >= 0"
            )
        if config.relevant_last and (config.recompute_chunks or config.recompute_tokens):
            raise ValueError(
                "relevant_last moves chunks, recompute_chunks and recompute_tokens recompute "
                "them where they stand: choose one (set relevant_last to 0 to recompute)"
            )
        if config.recompute_by not in RECOMPUTE_BY:
            raise ValueError(
                f"recompute_by must be {' or '.join(RECOMPUTE_BY)}, not {config.recompute_by!r}"
            )
        if config.load_threads < 1:
            raise ValueError(f"load_threads must be >= 1, not {config.load_threads}")
        load_cpus(config.load_cpus)  # raises on a bad list
        if not 0 <= config.relevant_min_score <= 1:
            raise ValueError(
                f"relevant_min_score is a share of the best score, 0 to 1: "
                f"{config.relevant_min_score}"
            )
        if config.question_temperature <= 0 or config.question_scale <= 0:
            raise ValueError("question_temperature and question_scale must be > 0")
        if config.quality_recovery and not config.inband_isolation:
            raise ValueError(
                "virtual_gap, recompute_chunks, recompute_tokens, relevant_last, "
                "question_temperature and question_scale act in the in-band isolation hook: "
                "they need inband_isolation"
            )
        return config

    @property
    def daemon_address(self) -> str:
        return self.address or default_address()

    @property
    def isolation_mode(self) -> Isolation:
        return Isolation(self.isolation)

    @property
    def reweights_questions(self) -> bool:
        return self.question_temperature != 1.0 or self.question_scale != 1.0

    @property
    def quality_recovery(self) -> bool:
        return bool(
            self.virtual_gap
            or self.recompute_chunks
            or self.recompute_tokens
            or self.relevant_last
            or self.reweights_questions
        )


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
