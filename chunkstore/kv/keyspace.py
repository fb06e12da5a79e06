"""The key space of a served model: the settings that make an entry's key (model
fingerprint, separator, isolation, virtual gap, prefix block size) in one object, and a
prompt's cacheable pieces with their keys.

The connector's scheduler (``chunkstore_vllm.keys``), the router and ``RagPrompts`` all key
through it, so a key is assembled one way: a router or an ingest started with the
connector's settings computes the keys the connector stores under.

A chunked prompt (``sys SEP c SEP ... SEP question``) has a piece per sys and chunk
segment; a plain one (no separator) a piece per whole block of its exact prefix. Each piece
carries the prompt that stores it alone: for chunk ``c`` that is ``sys SEP c SEP`` in
``isolation: sys`` (the chunk right after sys, where causal attention gives it exactly its
isolated context) and ``c SEP`` in ``isolation: none``, where sys is stored by a ``sys SEP``
of its own; cut from the prompt's own token IDs, so nothing is tokenized twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.kv.keys import Isolation, prefix_keys, prefix_tail_key, segment_keys
from chunkstore.kv.segments import Segment, SegmentKind, split_prompt

if TYPE_CHECKING:  # fingerprints need torch (rope); keys alone must not
    from chunkstore.kv.fingerprint import ModelFingerprint

# LMCache's chunk size: a prefix entry per 256 tokens (the connector's prefix_block_tokens).
DEFAULT_PREFIX_BLOCK_TOKENS = 256


@dataclass(frozen=True)
class Piece:
    """A cacheable part of a prompt: its segment (a prefix block is a ``PREFIX`` one), its
    entry key, and the prompt that stores it alone (None: it is stored by the request's own
    computation, or never on its own)."""

    segment: Segment
    key: bytes
    alone: tuple[int, ...] | None = None
    loads: int | None = None  # its first tokens that load, where vLLM computes the rest

    @property
    def tokens(self) -> int:
        """Its tokens a request loads: all, or its ``loads``."""
        return len(self.segment) if self.loads is None else self.loads


@dataclass(frozen=True)
class Plan:
    """One prompt's pieces in order; ``chunked``: it holds the separator (sys, chunks and a
    question), else its pieces are the whole blocks of its exact prefix."""

    pieces: tuple[Piece, ...]
    chunked: bool


@dataclass(frozen=True)
class KeySpace:
    """``prefix_block_tokens``: a plain prompt's block size (0: plain prompts have no
    pieces)."""

    fingerprint: ModelFingerprint
    separator: tuple[int, ...]
    isolation: Isolation = Isolation.SYS
    virtual_gap: int = 0
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS
    separator_text: str = field(default="", compare=False)  # as the model's tokenizer reads it

    @classmethod
    def for_model(
        cls,
        model: str | Path,
        dtype: str,
        separator: str = "auto",
        isolation: Isolation = Isolation.SYS,
        virtual_gap: int = 0,
        prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS,
        tokenizer: Any = None,
    ) -> KeySpace:
        """From the model folder vLLM serves (its weights are hashed into the keys) and the
        KV cache dtype vLLM runs with; ``tokenizer``: the folder's, where the caller has it
        loaded already."""
        from transformers import AutoTokenizer

        from chunkstore.kv.fingerprint import fingerprint_of_folder
        from chunkstore.kv.separator import resolve_separator, separator_ids

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
        return cls(
            fingerprint_of_folder(model, dtype),
            tuple(separator_ids(tokenizer, separator)),
            isolation,
            virtual_gap,
            prefix_block_tokens,
            resolve_separator(tokenizer, separator),
        )

    def plan(self, token_ids: Sequence[int], salt: str = "") -> Plan:
        """``salt``: the request's ``cache_salt``, part of every key ("" = shared)."""
        segments = self.segments(token_ids)
        if segments and segments[0].kind is SegmentKind.SYS:
            return Plan(tuple(self.chunk_pieces(segments, salt)), chunked=True)
        if not self.prefix_block_tokens:
            return Plan((), chunked=False)
        return Plan(tuple(self.prefix_pieces(token_ids, salt)), chunked=False)

    def segments(self, token_ids: Sequence[int]) -> list[Segment]:
        return split_prompt(token_ids, self.separator)

    def segment_keys(self, segments: Sequence[Segment], salt: str = "") -> list[bytes | None]:
        """The keys of a chunked prompt's segments, in order (None for the question)."""
        fp = self.fingerprint
        return segment_keys(
            segments, fp.model_fp, fp.layout_fp, self.isolation, self.virtual_gap, salt
        )

    def chunk_pieces(self, segments: Sequence[Segment], salt: str = "") -> list[Piece]:
        """A chunked prompt's sys and chunk segments (never the question), keyed, each with
        the prompt that stores it alone."""
        sys = segments[0].token_ids if segments else ()
        pieces = []
        for seg, key in zip(segments, self.segment_keys(segments, salt), strict=True):
            if key is None or seg.kind is SegmentKind.QUESTION:
                continue  # the question: never stored
            if seg.kind is SegmentKind.SYS:
                alone = sys if self.isolation is Isolation.NONE else None
            elif self.isolation is Isolation.NONE:
                alone = seg.token_ids
            else:
                alone = sys + seg.token_ids
            pieces.append(Piece(seg, key, alone))
        return pieces

    def prefix_pieces(
        self, token_ids: Sequence[int], salt: str = "", block_tokens: int | None = None
    ) -> list[Piece]:
        """The whole blocks of a plain prompt (or of a prompt and what was generated after
        it), as exact prefix entries with their chained keys; ``block_tokens``: the block
        size, if not ``prefix_block_tokens`` (the connector rounds it up to vLLM's)."""
        size = self.prefix_block_tokens if block_tokens is None else block_tokens
        fp = self.fingerprint
        keys = prefix_keys(fp.model_fp, fp.layout_fp, token_ids, size, salt)
        return [
            Piece(
                Segment(SegmentKind.PREFIX, i * size, tuple(token_ids[i * size : (i + 1) * size])),
                key,
            )
            for i, key in enumerate(keys)
        ]

    def prefix_tail(
        self, token_ids: Sequence[int], salt: str = "", block_tokens: int | None = None
    ) -> Piece | None:
        """The part block after the whole ones, as an exact prefix entry (None if none)."""
        size = self.prefix_block_tokens if block_tokens is None else block_tokens
        fp = self.fingerprint
        key = prefix_tail_key(fp.model_fp, fp.layout_fp, token_ids, size, salt)
        if key is None:
            return None
        start = len(token_ids) // size * size
        return Piece(Segment(SegmentKind.PREFIX, start, tuple(token_ids[start:])), key)
