"""The model and layout fingerprints of the served model, the same in every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint
from chunkstore.kv.keys import KVLayout, segment_keys
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

    def plan(self, segments: list[Segment]) -> list[SegmentPlan]:
        """The cacheable segments of a prompt (sys and chunks), with their keys, in order."""
        keys = segment_keys(
            segments,
            self.model_fp,
            self.layout_fp,
            self.config.isolation_mode,
            self.config.virtual_gap,
        )
        return [
            SegmentPlan(seg, key)
            for seg, key in zip(segments, keys, strict=True)
            if key is not None and seg.kind is not SegmentKind.QUESTION
        ]
