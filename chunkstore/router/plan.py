"""A prompt as the connector will see it: its segments, each cacheable one's entry key, and
for a chunk the prompt that stores it alone.

The keys are the connector's (``chunkstore.kv.keys``) for the same model fingerprint,
separator, isolation mode, virtual gap and cache salt: the router must be started with the
connector's settings, and ``cold`` checks after each warm-up that what it sent was stored
under the keys it computed (a mismatch is counted and reported, never served).

The prompt that stores chunk ``c`` alone is ``sys SEP c SEP`` in ``isolation: sys`` (the
chunk right after sys, where causal attention gives it exactly its isolated context), and
``c SEP`` in ``isolation: none``, where sys is stored by a ``sys SEP`` of its own. These are
token IDs cut from the request's own, so nothing is tokenized twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint_of_folder
from chunkstore.kv.keys import Isolation, prefix_keys, segment_keys
from chunkstore.kv.segments import SegmentKind, split_prompt
from chunkstore.prompts import separator_ids

DEFAULT_PREFIX_BLOCK_TOKENS = 256  # the connector's default prefix_block_tokens


@dataclass(frozen=True)
class Piece:
    """A cacheable part of a prompt: its entry key, its tokens, and the prompt that stores it
    alone (None: it is stored by the request's own computation, or never on its own)."""

    key: bytes
    tokens: int
    alone: tuple[int, ...] | None


@dataclass(frozen=True)
class Plan:
    """One prompt's pieces in order; ``chunked``: it holds the separator (sys, chunks and a
    question), else its pieces are the whole blocks of its exact prefix."""

    pieces: tuple[Piece, ...]
    chunked: bool


@dataclass(frozen=True)
class KeySpace:
    fingerprint: ModelFingerprint
    separator: tuple[int, ...]
    isolation: Isolation = Isolation.SYS
    virtual_gap: int = 0
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS

    @classmethod
    def for_model(
        cls,
        model: str | Path,
        dtype: str,
        separator: str = "auto",
        isolation: Isolation = Isolation.SYS,
        virtual_gap: int = 0,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
    ) -> KeySpace:
        """From the model folder vLLM serves (its weights are hashed into the keys) and the
        KV cache dtype vLLM runs with."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        return cls(
            fingerprint_of_folder(model, dtype),
            tuple(separator_ids(tokenizer, separator)),
            isolation,
            virtual_gap,
            prefix_block_tokens,
        )

    def plan(self, token_ids: list[int], salt: str = "") -> Plan:
        segments = split_prompt(token_ids, self.separator)
        if not segments or segments[0].kind is SegmentKind.QUESTION:
            return self._prefix_plan(token_ids, salt)
        fp = self.fingerprint
        keys = segment_keys(
            segments, fp.model_fp, fp.layout_fp, self.isolation, self.virtual_gap, salt
        )
        sys = segments[0].token_ids
        pieces = []
        for seg, key in zip(segments, keys, strict=True):
            if key is None:
                continue  # the question: never stored
            if seg.kind is SegmentKind.SYS:
                alone = sys if self.isolation is Isolation.NONE else None
            elif self.isolation is Isolation.NONE:
                alone = seg.token_ids
            else:
                alone = sys + seg.token_ids
            pieces.append(Piece(key, len(seg), alone))
        return Plan(tuple(pieces), chunked=True)

    def _prefix_plan(self, token_ids: list[int], salt: str) -> Plan:
        if not self.prefix_block_tokens:
            return Plan((), chunked=False)
        fp = self.fingerprint
        size = self.prefix_block_tokens
        keys = prefix_keys(fp.model_fp, fp.layout_fp, token_ids, size, salt)
        return Plan(tuple(Piece(k, size, None) for k in keys), chunked=False)
