"""Segmentation of chunked prompts: ``sys SEP c1 SEP c2 SEP ... SEP question`` as token IDs.

The separator belongs to the segment before it
(docs/semantics.md#the-contract-everything-else-serves). A prompt without a separator is an
ordinary prompt: one question segment, nothing to reuse. A prompt that ends with a separator has
no question (the shape of an ingest request, ``sys SEP chunk SEP``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from chunkstore.errors import SegmentationError


class SegmentKind(StrEnum):
    SYS = "sys"
    CHUNK = "chunk"
    QUESTION = "question"
    PREFIX = "prefix"  # a whole block of a plain prompt's exact prefix (never split out)


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    start: int  # index of the segment's first token in the prompt
    token_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)


def find_separators(token_ids: Sequence[int], separator: Sequence[int]) -> list[int]:
    """End indices (exclusive) of the non-overlapping separator matches, left to right."""
    sep = list(separator)
    if not sep:
        raise SegmentationError("the separator must be at least one token")
    ids = token_ids if isinstance(token_ids, list) else list(token_ids)
    ends: list[int] = []
    n, m = len(ids), len(sep)
    first = sep[0]
    i = 0
    while i <= n - m:
        try:  # the next candidate, found at C speed (a prompt has a few separators)
            i = ids.index(first, i, n - m + 1)
        except ValueError:
            break
        if ids[i : i + m] == sep:
            ends.append(i + m)
            i += m
        else:
            i += 1
    return ends


def split_prompt(token_ids: Sequence[int], separator: Sequence[int]) -> list[Segment]:
    """Split a prompt into sys / chunk / question segments.

    Each separator ends the segment it follows. With k separators there is one sys segment,
    k - 1 chunks and a question (omitted when the prompt ends with a separator).
    """
    ends = find_separators(token_ids, separator)
    tokens = tuple(token_ids)
    if not ends:
        return [Segment(SegmentKind.QUESTION, 0, tokens)] if tokens else []
    bounds = [0, *ends]
    segments = [
        Segment(SegmentKind.SYS if i == 0 else SegmentKind.CHUNK, start, tokens[start:end])
        for i, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False))
    ]
    if ends[-1] < len(tokens):
        segments.append(Segment(SegmentKind.QUESTION, ends[-1], tokens[ends[-1] :]))
    return segments


def reordered_ids(segments: Sequence[Segment], order: Sequence[int]) -> list[int]:
    """The prompt's token IDs with its chunks in ``order`` (segment indices; each chunk
    carries its separator): sys first, the question last."""
    chunks = [seg for seg in segments if seg.kind is SegmentKind.CHUNK]
    moved = [segments[i] for i in order if 0 <= i < len(segments)]
    if sorted(s.start for s in moved) != [s.start for s in chunks] or len(moved) < len(order):
        raise SegmentationError(f"{list(order)} is not an order of the prompt's chunks")
    rest = [seg for seg in segments if seg.kind is not SegmentKind.CHUNK]
    ordered = [rest[0], *moved, *rest[1:]]
    return [t for seg in ordered for t in seg.token_ids]


def chunk_places(order: Sequence[int]) -> dict[int, int]:
    """Where each chunk (0: the first) stands once its chunks are in ``order``."""
    return {i - 1: place for place, i in enumerate(order)}  # segment 0 is sys


@dataclass(frozen=True)
class ChunkedPrompt:
    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]


def build_chunked_prompt(
    tokenize: Callable[[str], Sequence[int]],
    sys_text: str,
    chunk_texts: Sequence[str],
    question: str | None,
    separator: Sequence[int],
    prefix: Sequence[int] = (),
) -> ChunkedPrompt:
    """Tokenize each segment on its own and join them with the separator.

    Tokenizing segments separately means no token ever merges across a boundary, so a chunk's
    token IDs (and hence its cache key) do not depend on its neighbours. ``prefix`` (e.g. a BOS
    token) is prepended to the sys segment. A segment whose own tokens contain the separator
    would be split in the wrong place, so it is refused.
    """
    sep = tuple(separator)
    texts = [("sys", sys_text), *((f"chunk {i}", t) for i, t in enumerate(chunk_texts))]
    if question is not None:
        texts.append(("the question", question))
    token_ids: list[int] = list(prefix)
    intended_ends: list[int] = []
    for i, (name, text) in enumerate(texts):
        ids = list(tokenize(text))
        if find_separators(ids, sep):
            raise SegmentationError(f"{name} contains the separator {list(sep)} in its tokens")
        token_ids += ids
        if question is None or i < len(texts) - 1:
            token_ids += sep
            intended_ends.append(len(token_ids))
    if find_separators(token_ids, sep) != intended_ends:
        # A segment ending in the separator's first tokens makes a match start too early.
        raise SegmentationError("a segment's last tokens merge with the separator; reword it")
    return ChunkedPrompt(tuple(token_ids), tuple(split_prompt(token_ids, sep)))
