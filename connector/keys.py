"""The served model's key space (``chunkstore.kv.keyspace``) as vLLM's configuration and the
connector's settings make it, the same in every process, with the KV shape the workers
write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint
from chunkstore.kv.keys import KVLayout
from chunkstore.kv.keyspace import KeySpace, Piece
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import Segment
from chunkstore.kv.separator import separator_ids

from .config import ConnectorConfig

SegmentPlan = Piece  # a cacheable segment of a request, with its key


@dataclass(frozen=True)
class ModelKeys:
    """Computes segment keys for the model vLLM serves."""

    space: KeySpace

    @classmethod
    def from_vllm(cls, vllm_config: Any, config: ConnectorConfig) -> ModelKeys:
        model_config = vllm_config.model_config
        kv_dtype = str(model_config.dtype).removeprefix("torch.")
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None):
            kv_dtype = str(cache_dtype)
        fp = fingerprint(model_config.hf_config, model_config.model, kv_dtype)
        if isinstance(config.separator, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
            separator = separator_ids(tokenizer, config.separator)
        else:
            separator = [int(t) for t in config.separator]
        space = KeySpace(
            fp,
            tuple(separator),
            config.isolation_mode,
            config.virtual_gap,
            config.prefix_block_tokens,
        )
        return cls(space)

    @property
    def fingerprint(self) -> ModelFingerprint:
        return self.space.fingerprint

    @property
    def separator(self) -> list[int]:
        return list(self.space.separator)

    @property
    def rotary(self) -> RotaryConfig:
        return self.space.fingerprint.rotary

    @property
    def layout(self) -> KVLayout:
        return self.space.fingerprint.layout

    @property
    def kv_dtype(self) -> str:
        return self.space.fingerprint.kv_dtype

    def segments(self, token_ids: list[int]) -> list[Segment]:
        return self.space.segments(token_ids)

    def plan(self, segments: list[Segment], salt: str = "") -> list[SegmentPlan]:
        """The cacheable segments of a prompt (sys and chunks), with their keys, in order
        (``salt``: the request's ``cache_salt``, part of every key)."""
        return self.space.chunk_pieces(segments, salt)

    def prefix_plan(self, token_ids: list[int], salt: str, block_tokens: int) -> list[SegmentPlan]:
        """The whole ``block_tokens`` blocks of a plain prompt (or of a prompt and what was
        generated after it), as exact prefix entries with their chained keys."""
        return self.space.prefix_pieces(token_ids, salt, block_tokens)

    def prefix_tail(self, token_ids: list[int], salt: str, block_tokens: int) -> SegmentPlan | None:
        """The part block after the whole ones, as an exact prefix entry (None if none)."""
        return self.space.prefix_tail(token_ids, salt, block_tokens)
