"""The model and layout fingerprints of the served model, the same in every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint
from chunkstore.kv.keys import KVLayout, prefix_keys, prefix_tail_key, segment_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import Segment, SegmentKind, split_prompt
from chunkstore.prompts import separator_ids

from .config import ConnectorConfig


@dataclass(frozen=True)
class SegmentPlan:
    segment: Segment
    key: bytes


@dataclass
class ModelKeys:
    """Computes segment keys for the model vLLM serves."""

    model_fp: bytes
    layout_fp: bytes
    rotary: RotaryConfig
    layout: KVLayout
    kv_dtype: str
    separator: list[int]
    config: ConnectorConfig
    fingerprint: ModelFingerprint

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
        return cls(fp.model_fp, fp.layout_fp, fp.rotary, fp.layout, kv_dtype, separator, config, fp)

    def segments(self, token_ids: list[int]) -> list[Segment]:
        return split_prompt(token_ids, self.separator)

    def plan(self, segments: list[Segment], salt: str = "") -> list[SegmentPlan]:
        """The cacheable segments of a prompt (sys and chunks), with their keys, in order
        (``salt``: the request's ``cache_salt``, part of every key)."""
        keys = segment_keys(
            segments,
            self.model_fp,
            self.layout_fp,
            self.config.isolation_mode,
            self.config.virtual_gap,
            salt,
        )
        return [
            SegmentPlan(seg, key)
            for seg, key in zip(segments, keys, strict=True)
            if key is not None and seg.kind is not SegmentKind.QUESTION
        ]

    def prefix_plan(self, token_ids: list[int], salt: str, block_tokens: int) -> list[SegmentPlan]:
        """The whole ``block_tokens`` blocks of a plain prompt (or of a prompt and what was
        generated after it), as exact prefix entries with their chained keys."""
        keys = prefix_keys(self.model_fp, self.layout_fp, token_ids, block_tokens, salt)
        return [
            SegmentPlan(
                Segment(
                    SegmentKind.PREFIX,
                    i * block_tokens,
                    tuple(token_ids[i * block_tokens : (i + 1) * block_tokens]),
                ),
                key,
            )
            for i, key in enumerate(keys)
        ]

    def prefix_tail(self, token_ids: list[int], salt: str, block_tokens: int) -> SegmentPlan | None:
        """The part block after the whole ones, as an exact prefix entry (None if none)."""
        key = prefix_tail_key(self.model_fp, self.layout_fp, token_ids, block_tokens, salt)
        if key is None:
            return None
        start = len(token_ids) // block_tokens * block_tokens
        return SegmentPlan(Segment(SegmentKind.PREFIX, start, tuple(token_ids[start:])), key)
