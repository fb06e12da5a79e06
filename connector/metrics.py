"""The connector's metrics, exported the way vLLM exports connector metrics: each side counts
into a ``ConnectorStats``; vLLM collects it every step (``get_kv_connector_stats``), sums the
workers' and the scheduler's, logs it and feeds ``ConnectorPromMetrics``, which shows it on
vLLM's own ``/metrics`` as ``vllm:chunkstore_*_total`` counters.

Counts are per tensor-parallel rank for the worker fields (each rank loads its own heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .vllm_bases import KVConnectorPromMetrics, KVConnectorStats

# field -> help text; every field is a running sum, exported as vllm:chunkstore_<field>_total.
FIELDS = {
    # Scheduler side.
    "lookups": "Requests looked up in the store.",
    "lookup_tokens": "Prompt tokens in the segments looked up.",
    "hit_tokens": "Tokens the store supplies beyond vLLM's own prefix cache.",
    "chunked_prompts": "Prompts holding the separator (split into sys, chunks, question).",
    "unchunked_prompts": "Prompts without the separator: only their exact prefix blocks are "
    "shared (a RAG app whose prompts land here is not chunking them: check the separator).",
    "prefix_lookup_tokens": "Tokens of plain prompts' whole prefix blocks looked up.",
    "prefix_hit_tokens": "Of hit_tokens, those of exact prefix blocks (plain prompts).",
    "computed_prompt_tokens": "Prompt tokens of looked-up prompts that neither vLLM's prefix "
    "cache nor the store supplied (vLLM computes them; on a decode instance behind the "
    "proxy, only the prefill's first token).",
    "rotary_refused_prompts": "Prompts holding the separator served as plain prompts (exact "
    "prefix blocks only) because the model's rotary cannot be remapped (said at start-up).",
    "short_segments": "Sys and chunk segments shorter than min_chunk_tokens (neither looked "
    "up nor stored).",
    "lookup_seconds": "Time spent looking chunked prompts up: segmenting, keying and the "
    "daemon's Acquire.",
    "recomputed_chunks": "Chunks chosen to be recomputed for answer quality, whole or in part "
    "(the relevant_last chunks' spans by default; recompute_chunks, or the request's "
    "kv_transfer_params, whole).",
    "one_pass_chunks": "Chunks recomputed whole that a request computed once, where they are "
    "attended, not isolated first (recompute_in_one_pass; not stored by that request).",
    "gap_tokens": "Tokens of chunks that missed between stored ones, computed by the workers' "
    "hook, isolated, so the stored chunks after them load (fill_gaps).",
    "moved_chunks": "Chunks attended as if they stood just before the question, the most "
    "relevant last (relevant_last; those already there are not counted).",
    "bad_transfer_params": "Requests whose kv_transfer_params named chunks wrongly (ignored: "
    "the connector's own choice was used).",
    "sparse_chunks": "Long chunks loaded sparse (sparse_threshold): stored with their summary "
    "and digests, each layer reading only the blocks its question chose.",
    "daemon_unreachable": "Lookups skipped because the daemon could not be reached (computed).",
    "sessions_reopened": "Daemon sessions lost (the daemon restarted, or this process was paused "
    "past the lease TTL) and reopened by the client (scheduler and workers).",
    # Worker side.
    "loaded_tokens": "Tokens copied from the store into vLLM's KV cache.",
    "load_failures": "Loads that failed and were computed instead (daemon, lease, checksum).",
    "load_seconds": "Time spent loading, remap and cache writes included (read_seconds + "
    "write_seconds).",
    "read_seconds": "Time spent reading loaded entries out of the store and checking them, "
    "before the forward.",
    "write_seconds": "Time spent remapping loaded keys and writing the KV into vLLM's cache "
    "(beside the forward with overlap_layers).",
    "wait_seconds": "Time the forward waited for a layer's loaded KV to be written (the part "
    "of write_seconds not hidden behind it).",
    "saved_segments": "Segments stored after vLLM computed them under their isolation context "
    "(not those another request stored first).",
    "saved_tokens": "Tokens stored.",
    "prefix_loaded_tokens": "Of loaded_tokens, those of exact prefix blocks.",
    "block_copied_tokens": "Of prefix_loaded_tokens, those stored as vLLM's own cache blocks "
    "and copied in as they are (no per-token write).",
    "prefix_saved_tokens": "Of saved_tokens, those of exact prefix blocks (prompt and "
    "generated tokens of plain prompts).",
    "saved_summaries": "Block summaries stored beside chunks of at least "
    "sparse_summary_tokens tokens (what a sparse read chooses blocks by).",
    "cp_read_bytes": "Bytes of entries a decode-context-parallel rank read to load them: "
    "only the rows it owns (about 1/dcp of each entry), from the pool or over the stream; "
    "whole entries under a lease without the summed checksum.",
    "cp_held_bytes": "Of the entries loaded, the bytes of the tokens the rank writes (about "
    "cp_read_bytes; 1/dcp of it where a rank reads whole entries).",
    "sparse_read_bytes": "Bytes of long chunks loaded sparse (sparse_threshold): the blocks "
    "each layer's question chose, read out of the pool.",
    "sparse_whole_bytes": "What those layers of those chunks hold whole (sparse_read_bytes "
    "over this is the share of the bytes a sparse load reads).",
    "sparse_choose_seconds": "Time the hook spent choosing sparse loads' blocks (the bound, "
    "and the exact attention over the candidates' keys with sparse_candidates).",
    "sparse_read_seconds": "Time the hook spent reading sparse loads' blocks out of the pool, "
    "checking their digests and rotating their keys.",
    "sparse_fallbacks": "Sparse loads that did not choose by their summary, by reason (the "
    "reason label, SPARSE_FALLBACKS): loaded whole, block by block, where the summary was "
    "unusable; computed by vLLM (also in load_failures) where the digests or a read failed.",
    "save_failures": "Saves that failed (the request is unaffected).",
    "save_seconds": "Time spent saving.",
    "isolated_tokens": "Chunk tokens vLLM computed under the isolation mask (in-band).",
    "recomputed_tokens": "Chunk tokens whose KV was recomputed seeing everything before them "
    "(the relevant chunks' spans, recompute_chunks, recompute_tokens).",
    "isolation_misses": "Chunked requests the isolation hook could not find in a batch "
    "(computed causally, their chunks not stored).",
}

# Why a sparse load fell back (``sparse_fallbacks``' reason label) -> what then happened.
SPARSE_FALLBACKS = {
    "summary_unreadable": "its summary failed its checksum or lease (loaded whole)",
    "summary_shape": "its summary's layers, heads, head_dim, dtype, blocks or frame are not "
    "the entry's (loaded whole; not used again)",
    "summary_values": "its summary holds NaN, infinities, a min above a max, or values whose "
    "scores overflow (loaded whole; not used again)",
    "summary_known_bad": "its summary was found unusable before in this process (loaded whole, "
    "not read)",
    "digests": "its block digests failed their checksum or shape (computed)",
    "read": "the entry was refused, the daemon unreachable, or a block failed its digest "
    "(computed)",
    "error": "anything else raised in the sparse path (computed; never into vLLM's forward)",
}
# field -> (label, its values): counted per value under "field.value", exported as one
# counter with that label.
LABELLED = {"sparse_fallbacks": ("reason", tuple(SPARSE_FALLBACKS))}
KEYS = [
    *(name for name in FIELDS if name not in LABELLED),
    *(f"{name}.{value}" for name, (_, values) in LABELLED.items() for value in values),
]


@dataclass
class ConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in KEYS:
            self.data.setdefault(name, 0)

    def add(self, name: str, amount: float = 1, label: str = "") -> None:
        """``amount`` more of ``name`` (of a labelled field, of its value ``label``)."""
        self.data[f"{name}.{label}" if label else name] += amount

    def reset(self) -> None:
        self.data = dict.fromkeys(KEYS, 0)

    def take(self) -> ConnectorStats | None:
        """What was counted since the last call (None if nothing), and start again."""
        if self.is_empty():
            return None
        taken = ConnectorStats(dict(self.data))
        self.reset()
        return taken

    def aggregate(self, other: KVConnectorStats) -> ConnectorStats:
        for name, value in other.data.items():
            if name in KEYS:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in KEYS)


class ConnectorPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {
            name: self._counter_cls(
                name=f"vllm:chunkstore_{name}",  # prometheus_client appends _total
                documentation=text,
                labelnames=[*labelnames, *(LABELLED[name][:1] if name in LABELLED else ())],
            )
            for name, text in FIELDS.items()
        }
        # Every series exists from the start (at 0), so rates and alerts on failures that
        # have not happened yet read 0, not "no data".
        for labels in per_engine_labelvalues.values():
            for _, counter, extra in self._series():
                counter.labels(*labels, *extra)

    def _series(self) -> list[tuple[str, Any, tuple[str, ...]]]:
        """(stats key, counter, its extra label value) of every series."""
        return [(key, self._counters[key.split(".")[0]], tuple(key.split(".")[1:])) for key in KEYS]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, counter, extra in self._series():
            value = transfer_stats_data.get(key, 0)
            if value:
                counter.labels(*labels, *extra).inc(value)
