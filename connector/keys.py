"""The served model's key space (``chunkstore.kv.keyspace``) as vLLM's configuration and the
connector's settings make it, the same in every process, with the KV shape the workers
write."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from chunkstore.connector_config import ConnectorConfig
from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint, unremappable
from chunkstore.kv.keys import KVLayout
from chunkstore.kv.keyspace import KeySpace, Piece
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.kv.separator import separator_ids

log = logging.getLogger("chunkstore.connector")

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
        try:
            fp = fingerprint(model_config.hf_config, model_config.model, kv_dtype)
        except UnsupportedRotaryError as error:  # the scheduler says so (``rotary_refused``)
            fp = unremappable(model_config.hf_config, model_config.model, kv_dtype, str(error))
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
    def rotary_refused(self) -> str:
        """Why keys cannot be re-rotated for this model ("": they can): then every prompt is
        served as a plain one, its exact prefix blocks shared (never rotated), no chunk loaded
        or stored."""
        return self.space.fingerprint.refused

    @property
    def separator(self) -> list[int]:
        return list(self.space.separator)

    @property
    def rotary(self) -> RotaryConfig:
        return self.space.fingerprint.rotary

    @property
    def layers(self) -> LayerRotary:
        """Each layer's rotary and window: loads rotate each layer with its own."""
        return self.space.fingerprint.layer_rotary

    @property
    def layout(self) -> KVLayout:
        return self.space.fingerprint.layout

    @property
    def kv_dtype(self) -> str:
        return self.space.fingerprint.kv_dtype

    def segments(self, token_ids: list[int]) -> list[Segment]:
        return self.space.segments(token_ids)

    def served_segments(self, token_ids: list[int]) -> tuple[list[Segment], bool]:
        """The segments the connector serves a prompt as, and whether a prompt holding the
        separator is served as a plain one because the rotary cannot be remapped."""
        segments = self.segments(token_ids)
        if self.rotary_refused and segments and segments[0].kind is SegmentKind.SYS:
            return [Segment(SegmentKind.QUESTION, 0, tuple(token_ids))], True
        return segments, False

    def say_if_refused(self, model: str) -> None:
        """Log, loudly, that chunk loads are off for ``model`` and why (nothing if they are
        not)."""
        if self.rotary_refused:
            log.error(
                "chunkstore: model %s: %s; chunk loads are off (prompts with the separator "
                "are served as plain ones: only their exact prefix blocks are shared, never "
                "rotated), counted in rotary_refused_prompts",
                model,
                self.rotary_refused,
            )

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
