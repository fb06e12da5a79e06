"""Which chunks of a chunked prompt are recomputed whole, and which are attended as if they
stood last: the pure choices the policy (``treatment``) is made of.

Under isolation a real model answers from the wrong document; recomputing the chunk that
holds the answer, seeing everything before it, brings the answer back
(docs/answer-quality.md). Which chunk that is, the question's own attention does not tell: it
follows recency. Relevance does. The choice, in order:

- the application's, per request: ``kv_transfer_params`` in the request body (the openai
  client's ``extra_body``) with ``recompute_chunks``, the indices of the chunks to recompute
  (0 = the first chunk after sys), or ``chunk_scores``, a score per chunk (its retriever's,
  higher = more relevant) from which the highest ``recompute_chunks`` of the connector's
  settings are taken;
- else the connector's ``recompute_by``: ``relevance`` ranks chunks by BM25 of the question's
  token IDs against each chunk's (the prompt's chunks are the collection), ``position`` takes
  the last ones (the chunks nearest the question);
- within a budget: at most ``recompute_chunks`` chunks and, with ``recompute_max_tokens``,
  at most that many chunk tokens (a chunk that does not fit is passed over).

The first chunk, chosen, is not recomputed when its isolated KV is its causal KV already
(``isolation: sys`` with no ``virtual_gap``: it sees sys and itself either way).

``relevant_last``: the question reads isolated chunks by recency, so the chunks most
relevant to it (the request's ``chunk_scores``, else BM25, leaving out those scoring under
``relevant_min_score`` of the best) take the positions just before the question, the most
relevant last, and the others move up in prompt order (``placement``). Isolated chunks do
not see each other, so that is the same KV as the prompt with those documents put last,
at the cost of re-rotating their keys. They are also recomputed there, seeing every
document attended before them (the KV of the prompt with them put last, blended), the most
relevant first within ``recompute_budget`` (``relevant``), each in part: its ``span``, the
tokens around its heaviest match of the question's terms, of an equal part of
``relevant_recompute_share`` of the prompt's chunk tokens, however long the chunk. With
that share 0, whole where each holds at most ``relevant_recompute_tokens``; a longer one
only moved, or with ``relevant_span_tokens`` recomputed in part.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.kv.segments import Segment, SegmentKind

POSITION, RELEVANCE = "position", "relevance"
RECOMPUTE_BY = (POSITION, RELEVANCE)
# The relevant chunks recomputed hold at most this share of a prompt's chunk tokens (the
# most relevant first), or RECOMPUTE_FLOOR tokens where that is more: a recompute costs
# about its tokens' prefill, so the share bounds the TTFT given back (``recompute_budget``).
RECOMPUTE_SHARE, RECOMPUTE_FLOOR = 0.4, 256
# BM25's usual constants: term-frequency saturation and length normalization.
K1, B = 1.2, 0.75


class BadTransferParams(ValueError):
    """A request's ``kv_transfer_params`` name chunks it does not have, or are malformed."""


def _terms(tokens: Sequence[int]) -> list[int | tuple[int, int]]:
    """A token sequence's terms: its tokens and its pairs of adjacent tokens (a name split
    into sub-words, "Dara" + " Ivanov", matches as a phrase, not only piece by piece)."""
    return [*tokens, *zip(tokens, tokens[1:], strict=False)]


@functools.lru_cache(maxsize=1024)
def _counted(chunk: tuple[int, ...]) -> Counter[int | tuple[int, int]]:
    """A chunk's terms, counted; remembered by its tokens (the same documents come back
    request after request, in any order; never changed by a caller)."""
    return Counter(_terms(chunk))


def _idf(chunks: int, holding: int) -> float:
    return math.log(1 + (chunks - holding + 0.5) / (holding + 0.5))


def bm25_scores(question: Sequence[int], chunks: Sequence[Sequence[int]]) -> list[float]:
    """BM25 of the question's terms (tokens and adjacent pairs) against each chunk's, the
    chunks as the collection. Token IDs stand for words: a name, a number or a rare word of
    the question that a chunk repeats scores; tokens every chunk has (articles,
    punctuation) score almost nothing."""
    if not chunks:
        return []
    counts = [_counted(tuple(chunk)) for chunk in chunks]
    lengths = [max(2 * len(chunk) - 1, 0) for chunk in chunks]  # its tokens and pairs
    average = sum(lengths) / len(chunks)
    terms = set(_terms(question))
    holding = {term: sum(term in count for count in counts) for term in terms}
    scores = []
    for length, count in zip(lengths, counts, strict=True):
        norm = K1 * (1 - B + B * length / max(average, 1))
        score = 0.0
        for term in terms & count.keys():
            tf = count[term]
            score += _idf(len(chunks), holding[term]) * tf * (K1 + 1) / (tf + norm)
        scores.append(score)
    return scores


def span(question: Sequence[int], chunks: Sequence[Sequence[int]], index: int, width: int) -> range:
    """The ``width`` tokens of chunk ``index`` that a question reads it for: the window
    holding the most idf of the question's terms (tokens and adjacent pairs, idf over the
    chunks as in BM25), placed so that its heaviest match stands a quarter in (the answer
    follows what the question names: its rarest terms, not a common word of the question
    that happens to come first). The whole chunk where it is no longer."""
    chunk = chunks[index]
    if len(chunk) <= width:
        return range(len(chunk))
    terms = set(_terms(question))
    counts = [_counted(tuple(c)) for c in chunks]
    holding = {term: sum(term in count for count in counts) for term in terms}
    weight = [0.0] * len(chunk)
    for p, token in enumerate(chunk):
        if token in terms:
            weight[p] += _idf(len(chunks), holding[token])
        pair = (token, chunk[p + 1]) if p + 1 < len(chunk) else None
        if pair in terms:
            weight[p] += _idf(len(chunks), holding[pair])
    window = best = sum(weight[:width])
    start = 0
    for s in range(1, len(chunk) - width + 1):
        window += weight[s + width - 1] - weight[s - 1]
        if window > best:
            best, start = window, s
    heaviest = max(range(start, start + width), key=weight.__getitem__)
    start = min(max(0, heaviest - width // 4), len(chunk) - width)
    return range(start, start + width)


# The kv_transfer_params that name chunks by place (0: the first chunk after sys).
NAMED = ("recompute_chunks", "chunk_scores")
KEEP_ORDER = "keep_order"  # the application forbids reordering its chunks
SPARSE_SHARES = ("sparse_threshold", "sparse_candidates")  # its own sparse loads
HOLD = "hold_s"  # what it stores is kept from eviction until read, at most this long


@dataclass(frozen=True)
class TransferParams:
    """A request's ``kv_transfer_params`` as chunkstore reads them, parsed once (``parse``)
    where the request comes in: the connector's scheduler, the policy and the router read
    this, never the request's dict. Its keys: ``recompute_chunks`` (the chunks to recompute,
    by index) or ``chunk_scores`` (a score per chunk, higher = more relevant),
    ``keep_order`` (the router sends the prompt as it came), ``sparse_threshold`` /
    ``sparse_candidates`` (its own shares of the attention, 0 to 1) and ``hold_s`` (seconds
    the daemon keeps the entries it stores from eviction until their first read, at most
    its lease TTL: a prompt sent only to store its chunks for a request that follows, as
    the router's cold chunks are). A malformed one is left
    out, and ``ignored`` says why (the caller logs and counts it); other keys (another
    connector's) are not read."""

    recompute_chunks: tuple[int, ...] | None = None
    chunk_scores: tuple[float, ...] | None = None
    keep_order: bool = False
    sparse_threshold: float | None = None
    sparse_candidates: float | None = None
    hold_s: float = 0.0
    ignored: tuple[tuple[str, str], ...] = ()  # (key, why it was left out)

    @classmethod
    def parse(cls, raw: Any) -> TransferParams:
        """From the request's ``kv_transfer_params`` (anything: None, or not a dict, is
        none given)."""
        if isinstance(raw, TransferParams):
            return raw
        if not isinstance(raw, dict):
            return NO_PARAMS
        ignored: list[tuple[str, str]] = []
        indices, scores = raw.get("recompute_chunks"), raw.get("chunk_scores")
        named: tuple[int, ...] | None = None
        scored: tuple[float, ...] | None = None
        if indices is not None and scores is not None:
            ignored.append(("recompute_chunks", "give recompute_chunks or chunk_scores, not both"))
        elif indices is not None:
            if isinstance(indices, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in indices
            ):
                named = tuple(indices)
            else:
                why = f"recompute_chunks must be a list of indices: {indices!r}"
                ignored.append(("recompute_chunks", why))
        elif scores is not None:
            if isinstance(scores, list) and all(
                isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s)
                for s in scores
            ):
                scored = tuple(float(s) for s in scores)
            else:
                why = f"chunk_scores must be finite numbers, one per chunk: {scores!r}"
                ignored.append(("chunk_scores", why))
        shares: dict[str, float | None] = {}
        for name in SPARSE_SHARES:
            value = raw.get(name)
            fits = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and not (fits and 0 <= value <= 1):
                why = f"{name} is a share of the attention, 0 to 1, not {value!r}"
                ignored.append((name, why))
                value = None
            shares[name] = None if value is None else float(value)
        hold = raw.get(HOLD, 0.0)
        if isinstance(hold, bool) or not isinstance(hold, int | float) or not 0 <= hold < 1e6:
            ignored.append((HOLD, f"{HOLD} is seconds, 0 or more, not {hold!r}"))
            hold = 0.0
        return cls(
            named,
            scored,
            raw.get(KEEP_ORDER) is True,
            shares["sparse_threshold"],
            shares["sparse_candidates"],
            float(hold),
            tuple(ignored),
        )

    @property
    def names_chunks(self) -> bool:
        """Whether it names chunks by place (which a new order renames)."""
        return self.recompute_chunks is not None or self.chunk_scores is not None

    def why_ignored(self, *keys: str) -> str | None:
        """Why these keys (all, where none are named) were left out, or None."""
        said = [why for key, why in self.ignored if not keys or key in keys]
        return "; ".join(said) or None

    def chosen(self, chunks: int) -> tuple[list[int] | None, list[float] | None]:
        """The request's own choice for a prompt of ``chunks`` chunks: (chunk indices, None),
        (None, a score per chunk), or (None, None) when it makes none. Raises
        BadTransferParams where what it names is malformed or does not fit the prompt."""
        malformed = self.why_ignored(*NAMED)
        if malformed:
            raise BadTransferParams(malformed)
        if self.recompute_chunks is not None:
            wrong = [i for i in self.recompute_chunks if not 0 <= i < chunks]
            if wrong:
                raise BadTransferParams(
                    f"recompute_chunks {wrong} out of range: the prompt has {chunks} chunks "
                    "(0-based)"
                )
            return sorted(set(self.recompute_chunks)), None
        if self.chunk_scores is not None:
            if len(self.chunk_scores) != chunks:
                raise BadTransferParams(
                    f"chunk_scores must be {chunks} finite numbers, one per chunk: "
                    f"{list(self.chunk_scores)!r}"
                )
            return None, list(self.chunk_scores)
        return None, None


NO_PARAMS = TransferParams()


def requested(params: Any, chunks: int) -> tuple[list[int] | None, list[float] | None]:
    """The request's own choice (``TransferParams.chosen``), from its parsed or raw
    ``kv_transfer_params``. Raises BadTransferParams on a malformed one."""
    return TransferParams.parse(params).chosen(chunks)


def choose(
    preference: Sequence[int], lengths: Sequence[int], max_chunks: int, max_tokens: int = 0
) -> list[int]:
    """The chunks to recompute, in prompt order: the first of ``preference`` (most wanted
    first) within ``max_chunks`` chunks and, if > 0, ``max_tokens`` tokens."""
    chosen: list[int] = []
    tokens = 0
    for index in preference:
        if len(chosen) >= max_chunks:
            break
        if max_tokens and tokens + lengths[index] > max_tokens:
            continue
        chosen.append(index)
        tokens += lengths[index]
    return sorted(chosen)


def by_score(scores: Sequence[float]) -> list[int]:
    """Indices from the highest score down; ties go to the later chunk (nearer the
    question, as position would choose)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], -i))


def select(
    question: Sequence[int],
    chunks: Sequence[Sequence[int]],
    recompute_by: str,
    max_chunks: int,
    max_tokens: int = 0,
    params: Any = None,
    first_is_causal: bool = False,
) -> list[int]:
    """The indices (into ``chunks``) of the chunks to recompute; ``first_is_causal``: the
    first chunk's isolated KV is its causal KV (it is left out, chosen or not). Raises
    BadTransferParams when the request's own choice is malformed (the caller falls back to
    ``select`` without it)."""
    lengths = [len(chunk) for chunk in chunks]
    indices, scores = requested(params, len(chunks))
    if indices is None:
        if max_chunks <= 0:
            return []  # nothing to choose: no scoring on the request's path
        if scores is None:
            if recompute_by == RELEVANCE:
                scores = bm25_scores(question, chunks)
            else:
                scores = [float(i) for i in range(len(chunks))]
        indices = choose(by_score(scores), lengths, max_chunks, max_tokens)
    # (the application named them: no budget applies)
    return [i for i in indices if not (first_is_causal and i == 0)]


def relevant_last(
    question: Sequence[int],
    chunks: Sequence[Sequence[int]],
    count: int,
    params: Any = None,
    min_score: float = 0.0,
) -> list[int]:
    """At most ``count`` chunks most relevant to the question, the most relevant last: the
    request's ``chunk_scores`` first (its ``count`` highest: a retriever's scores are ranks
    here, whatever their scale), else BM25's, leaving out a chunk scoring under
    ``min_score`` times the best (a clear ranking takes fewer chunks) and, where some chunk
    matches the question, those matching nothing. Raises
    BadTransferParams on malformed kv_transfer_params (the caller falls back to BM25)."""
    if count <= 0 or not chunks:
        return []
    _, scores = requested(params, len(chunks))
    floor = -math.inf
    if scores is None:
        scores = bm25_scores(question, chunks)
        best = max(scores)
        floor = min_score * best if min_score or not best else math.nextafter(0.0, 1.0)
    return [i for i in by_score(scores)[:count] if scores[i] >= floor][::-1]


def placement(lengths: Sequence[int], last: Sequence[int]) -> list[int]:
    """Each chunk's shift in positions when the chunks ``last`` (indices, in their new order)
    are placed after the others, which keep their order: a chunk of ``lengths[i]`` tokens
    starting where the ones before it in the new order end."""
    order = [i for i in range(len(lengths)) if i not in set(last)] + list(last)
    old = [sum(lengths[:i]) for i in range(len(lengths))]
    shifts = [0] * len(lengths)
    new = 0
    for i in order:
        shifts[i] = new - old[i]
        new += lengths[i]
    return shifts


def placed(
    segments: Sequence[Segment], count: int, params: Any = None, min_score: float = 0.0
) -> tuple[list[int], dict[int, int]]:
    """``relevant_last`` for a segmented prompt: the segment indices of the chunks placed
    last (most relevant last), and segment index -> shift in positions of each chunk that
    moves (nothing without a question). Raises BadTransferParams as ``relevant_last``."""
    if not count or not segments or segments[-1].kind is not SegmentKind.QUESTION:
        return [], {}
    chunks = [i for i, s in enumerate(segments) if s.kind is SegmentKind.CHUNK]
    bodies = [segments[i].token_ids for i in chunks]
    last = relevant_last(segments[-1].token_ids, bodies, count, params, min_score)
    shifts = placement([len(b) for b in bodies], last)
    return [chunks[i] for i in last], {i: d for i, d in zip(chunks, shifts, strict=True) if d}


def recompute_budget(chunk_tokens: int) -> int:
    """How many tokens of relevant chunks a prompt with ``chunk_tokens`` chunk tokens
    recomputes at most: RECOMPUTE_SHARE of them, or RECOMPUTE_FLOOR where that is more."""
    return max(RECOMPUTE_FLOOR, int(RECOMPUTE_SHARE * chunk_tokens))


def relevant(
    segments: Sequence[Segment],
    count: int,
    recompute_up_to: int,
    params: Any = None,
    first_is_causal: bool = False,
    min_score: float = 0.0,
    span_tokens: int = 0,
    recompute_share: float = 0.0,
    span_min: int = 0,
    first_tokens: int = 0,
) -> tuple[dict[int, range], dict[int, int], list[int]]:
    """What the defaults do with the (at most ``count``) chunks most relevant to the
    question: attend them last, just before the question (``placed``), and recompute them
    there (nothing where ``recompute_up_to`` is 0), the most relevant first while they fit
    in ``recompute_budget``: with ``recompute_share``, each its ``span`` of an equal part of
    that share of the prompt's chunk tokens less the ``first_tokens`` of each other chunk
    (recomputed with them: the share bounds both), at least ``span_min`` (whole where it is
    no longer), however long; without, whole where it holds at most ``recompute_up_to``
    tokens, else its ``span`` of ``span_tokens`` (0: only moved). Returns segment index ->
    the offsets recomputed in it (in prompt order; a chunk that stays first, when
    ``first_is_causal``, is left out: its isolated KV is causal already, and free),
    ``placed``'s shifts, and the chunks placed last (most relevant last). Raises
    BadTransferParams as ``placed``."""
    last, shifts = placed(segments, count, params, min_score)
    if not last or not recompute_up_to:
        return {}, shifts, last
    chunks = [i for i, s in enumerate(segments) if s.kind is SegmentKind.CHUNK]
    bodies = [segments[i].token_ids for i in chunks]
    question = segments[-1].token_ids
    candidates = [  # the most relevant first; one staying first is causal already, and free
        i for i in reversed(last) if not (first_is_causal and i == chunks[0] and i not in shifts)
    ]
    total = sum(len(b) for b in bodies)
    budget = recompute_budget(total)
    width = 0
    if recompute_share and candidates:
        others = sum(min(first_tokens, len(segments[c])) for c in chunks if c not in candidates)
        width = max(1, span_min, (int(recompute_share * total) - others) // len(candidates))
    kept: dict[int, range] = {}
    tokens = 0
    for i in candidates:
        if width:  # its span of an equal part of the share, however long it is
            offsets = span(question, bodies, chunks.index(i), width)
        elif len(segments[i]) <= recompute_up_to:
            offsets = range(len(segments[i]))
        elif span_tokens:
            offsets = span(question, bodies, chunks.index(i), span_tokens)
        else:
            continue
        if tokens + len(offsets) > budget:
            break
        tokens += len(offsets)
        kept[i] = offsets
    return dict(sorted(kept.items())), shifts, last
