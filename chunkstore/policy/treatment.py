"""The quality policy, in one place: what a chunked prompt's chunks get beyond their
isolated KV, decided once from the prompt's segments, the quality settings and what the
back end can do.

Every caller asks this module and nothing else, through a ``Policy`` built from the
connector's ``kv_connector_extra_config``: the connector's scheduler (what its workers
recompute, move and blend: ``Policy.treat``), the router (the order it sends a prompt's
chunks in: ``Policy.order``), ``bench quality`` (what it reports a method recomputes) and
the HF reference (the KV a served prompt must equal). A request's own choice comes in as
its ``kv_transfer_params``, parsed once (``selection.TransferParams``). The choices
themselves (BM25, budgets, placement) are ``selection``'s pure functions; this module says
which apply, in what order:

1. chunks named by the request (``kv_transfer_params``) or ``recompute_chunks``: recomputed
   whole where they stand (needs the in-band hook);
2. else ``relevant_last``: the chunks most relevant to the question attended last, just
   before it, and recomputed there where the workers can recompute: each its span of an
   equal part of ``relevant_recompute_share`` of the chunk tokens, however long (by
   default), or, with that 0, whole when short and a longer one in part with
   ``relevant_span_tokens``;
3. with either, the first ``recompute_tokens`` (or, for 2, ``relevant_first_tokens``)
   tokens of every other chunk recomputed too.

Without the hook (CUDA, Ascend) only a prefix can be loaded: vLLM computes a prompt from its
first token not loaded on, seeing everything before it. So 2 is what vLLM computes when the
relevant chunks already stand last: the connector loads the run before them and leaves
them to vLLM (``computed_from``), and the router puts them there first (``relevant_order``:
isolated chunks do not see each other, so the order of the loaded ones changes no KV).

The chunk attended right after sys (``isolation: sys``, no virtual gap) is computed isolated
exactly as causally: recomputing it changes nothing, so it is never recomputed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import Segment, SegmentKind

from .selection import RECOMPUTE_BY, BadTransferParams, TransferParams, relevant, select

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
# ... or, by default, each in part: its ``span`` of an equal part of this share of the
# prompt's chunk tokens, placed by the question's heaviest match (held-out, with the two
# settings below, Qwen2.5-Coder 0.5B at ~46 to ~494 tokens: 88 of 120 where recomputing
# them whole with every chunk's first 16 tokens answers 78, for 12-20% of the chunk tokens
# against 0.5-43%; docs/benchmarks.md) ...
DEFAULT_RELEVANT_RECOMPUTE_SHARE = 0.12
# ... at least this many tokens each where documents are short (12% of 8 documents of ~46
# tokens is ~15 tokens a pick) ...
DEFAULT_RELEVANT_SPAN_MIN_TOKENS = 32
# ... and the first tokens of every other chunk with them (EPIC's choice: where isolation
# leaves each chunk an attention sink): on the 1.5B at ~46 tokens the spans answer 24 of 24
# with 4 of them, 22 without (23 with windows of at least 40 tokens).
DEFAULT_RELEVANT_FIRST_TOKENS = 4
# Without the hook, vLLM computes from the last relevant chunk's span on (``last``), the
# relevant chunks before it loaded where they now stand: with bench workload's trace all
# stored, 150 prompt tokens a request where from the first one's span (``span``) is 200 and
# from its first token (``chunk``) 226: 1.72x vLLM's prefix caching's requests/s against
# 1.28-1.41x and 1.19x; held out on Qwen2.5-Coder 0.5B every case answered as from the
# first one's span (21 and 20 of 24; from its first token 21 and 20, its span 22 and 20 the
# day it was chosen) (docs/benchmarks.md, "RAG traffic").
HOOKLESS_FROM = ("last", "span", "chunk")
DEFAULT_HOOKLESS_FROM = "last"


@dataclass(frozen=True)
class QualityConfig:
    """The quality settings (each a ``kv_connector_extra_config`` key of the same name;
    docs/answer-quality.md)."""

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
    # ... and recomputed there (0: only moved): with the share 0, whole when each holds at
    # most this many tokens (and without the hook, where vLLM computes them whole) ...
    relevant_recompute_tokens: int = DEFAULT_RELEVANT_RECOMPUTE_TOKENS
    # ... a longer one in part: this many tokens around what matches the question (0: not).
    relevant_span_tokens: int = DEFAULT_RELEVANT_SPAN_TOKENS
    # ... each in part, long or short: its span of an equal part of this share of the
    # prompt's chunk tokens, less the first tokens below (0: whole, or as the two settings
    # above) ...
    relevant_recompute_share: float = DEFAULT_RELEVANT_RECOMPUTE_SHARE
    # ... of at least this many tokens (0: no floor).
    relevant_span_min_tokens: int = DEFAULT_RELEVANT_SPAN_MIN_TOKENS
    # ... and then the first N tokens of every other chunk too (0: not).
    relevant_first_tokens: int = DEFAULT_RELEVANT_FIRST_TOKENS
    # Without the hook, where vLLM computes the prompt from one token on: from the last
    # relevant chunk's span (``last``: the others before it loaded), from the first one's
    # span (``span``: that chunk's tokens before it loaded, as the hook would leave them) or
    # from its first token (``chunk``).
    hookless_from: str = DEFAULT_HOOKLESS_FROM

    def __post_init__(self) -> None:
        counts = [
            f.name
            for f in fields(self)
            if f.type == "int" and getattr(self, f.name) < 0  # annotations are strings here
        ]
        if counts:
            raise ValueError(f"{', '.join(counts)}: counts >= 0")
        if self.relevant_last and (self.recompute_chunks or self.recompute_tokens):
            raise ValueError(
                "relevant_last moves chunks, recompute_chunks and recompute_tokens recompute "
                "them where they stand: choose one (set relevant_last to 0 to recompute)"
            )
        if self.hookless_from not in HOOKLESS_FROM:
            raise ValueError(
                f"hookless_from must be {' or '.join(HOOKLESS_FROM)}, not {self.hookless_from!r}"
            )
        if self.recompute_by not in RECOMPUTE_BY:
            raise ValueError(
                f"recompute_by must be {' or '.join(RECOMPUTE_BY)}, not {self.recompute_by!r}"
            )
        if not 0 <= self.relevant_recompute_share <= 1:
            raise ValueError(
                f"relevant_recompute_share is a share of the chunk tokens, 0 to 1: "
                f"{self.relevant_recompute_share}"
            )
        if not 0 <= self.relevant_min_score <= 1:
            raise ValueError(
                f"relevant_min_score is a share of the best score, 0 to 1: "
                f"{self.relevant_min_score}"
            )
        if self.question_temperature <= 0 or self.question_scale <= 0:
            raise ValueError("question_temperature and question_scale must be > 0")

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> QualityConfig:
        """From the settings given (the others default): the default ``relevant_last`` gives
        way where chunks or tokens are recomputed where they stand, unless it is set."""
        given = dict(settings)
        recovers_otherwise = given.get("recompute_chunks") or given.get("recompute_tokens")
        if "relevant_last" not in given and recovers_otherwise:
            given["relevant_last"] = 0
        return cls(**given)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> QualityConfig:
        """From the connector's ``kv_connector_extra_config``: its keys of this class's
        names (the others are the connector's own)."""
        return cls.from_settings({k: v for k, v in extra.items() if k in cls.names()})

    @classmethod
    def names(cls) -> dict[str, type]:
        """Each setting's name and type, as a user writes it."""
        kinds = {"int": int, "float": float, "str": str}
        return {f.name: kinds[str(f.type)] for f in fields(cls)}

    @property
    def reweights_questions(self) -> bool:
        return self.question_temperature != 1.0 or self.question_scale != 1.0

    @property
    def needs_hook(self) -> bool:
        """Whether a setting acts only in the in-band hook (all but ``relevant_last``, which
        a back end without it serves by leaving relevant chunks that stand last to vLLM)."""
        return bool(self.recompute_chunks or self.recompute_tokens or self.reweights_questions)


@dataclass(frozen=True)
class BackEnd:
    """What the back end serving the prompt can do."""

    inband: bool = True  # the in-band isolation hook runs (chunks recomputed where they stand)
    recompute: bool = True  # its workers recompute chunks (not under tensor parallelism)


@dataclass(frozen=True)
class Treatment:
    """What a prompt's chunks get (segment indices throughout)."""

    recomputed: dict[int, range]  # chunk -> the offsets recomputed in it, prompt order
    shifts: dict[int, int]  # chunk -> positions it is attended from where it stands
    last: tuple[int, ...] = ()  # the chunks attended last, the most relevant last
    # The chunks given their full-prefill KV: those recomputed, and the one attended right
    # after sys where chosen and causal already (``first_is_causal``: never recomputed).
    exact: frozenset[int] = frozenset()
    first_tokens: int = 0  # every other chunk's first N tokens recomputed too
    first_is_causal: bool = False  # the chunk right after sys is its causal KV already
    ignored_params: str | None = None  # why the request's kv_transfer_params were ignored

    @property
    def moved(self) -> int:
        """How many of the chunks attended last moved to get there."""
        return sum(1 for i in self.last if i in self.shifts)

    def computed_from(self, segments: Sequence[Segment]) -> int | None:
        """Without the hook: the position from which vLLM computes the prompt (the
        ``recomputed`` tokens, which stand last), None where everything is loaded."""
        return min((segments[i].start + r.start for i, r in self.recomputed.items()), default=None)


NOTHING = Treatment({}, {})


def first_is_causal(isolation: Isolation, virtual_gap: int) -> bool:
    """Whether the chunk attended right after sys is computed isolated exactly as causally
    (it sees sys and itself either way, at the same positions)."""
    return isolation is Isolation.SYS and not virtual_gap


@dataclass(frozen=True)
class Policy:
    """The policy as one deployment runs it: the quality settings, the isolation the keys
    are made with and what the back end can do, all from the connector's
    ``kv_connector_extra_config`` (``from_extra``; the connector narrows ``back_end`` to
    what its deployment serves, ``for_deployment``). The connector's scheduler asks it what
    a prompt's chunks get (``treat``), the router in what order to send them (``order``),
    from the same settings."""

    quality: QualityConfig = QualityConfig()
    isolation: Isolation = Isolation.SYS
    virtual_gap: int = 0
    back_end: BackEnd = BackEnd()

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Policy:
        """From ``kv_connector_extra_config`` (the dict, as vLLM is given it): the quality
        keys, ``isolation``, ``virtual_gap`` and ``inband_isolation`` (what is asked of the
        back end; the connector's own keys are the connector's to check)."""
        extra = dict(extra or {})
        return cls(
            QualityConfig.from_extra(extra),
            Isolation(extra.get("isolation", Isolation.SYS.value)),
            int(extra.get("virtual_gap", 0)),
            BackEnd(inband=bool(extra.get("inband_isolation", True))),
        )

    @property
    def first_is_causal(self) -> bool:
        return first_is_causal(self.isolation, self.virtual_gap)

    def treat(self, segments: Sequence[Segment], params: Any = None) -> Treatment:
        """What ``segments`` (a chunked prompt, the question last) get; ``params``: the
        request's ``TransferParams`` (or its raw ``kv_transfer_params``; what names chunks
        wrongly is ignored, and the treatment says why)."""
        params = TransferParams.parse(params)
        causal = self.first_is_causal
        quality, back_end = self.quality, self.back_end
        chunks = [i for i, s in enumerate(segments) if s.kind is SegmentKind.CHUNK]
        if not chunks or segments[-1].kind is not SegmentKind.QUESTION:
            return Treatment({}, {}, first_tokens=quality.recompute_tokens, first_is_causal=causal)
        if not back_end.inband:
            return _without_hook(segments, quality, causal, params)
        ignored = None
        choice = functools.partial(
            select,
            segments[-1].token_ids,
            [segments[i].token_ids for i in chunks],
            quality.recompute_by,
            quality.recompute_chunks,
            quality.recompute_max_tokens,
        )
        try:
            chosen = choice(params=params)
        except BadTransferParams as err:
            ignored, params = str(err), None
            chosen = choice()
        kept = [i for i in chosen if not (causal and i == 0)]  # causal already: left be
        if kept:  # recomputed where they stand: nothing moves
            recomputed = {chunks[i]: range(len(segments[chunks[i]])) for i in kept}
            exact = frozenset(chunks[i] for i in chosen)
            return Treatment(recomputed, {}, (), exact, quality.recompute_tokens, causal, ignored)
        up_to = quality.relevant_recompute_tokens if back_end.recompute else 0
        picks = _hook_picks(segments, quality, up_to, causal)
        try:
            recomputed, shifts, last = picks(params)
        except BadTransferParams as err:
            ignored = ignored or str(err)
            recomputed, shifts, last = picks()
        first = quality.relevant_first_tokens if recomputed else 0
        stays_first = causal and chunks[0] in last and chunks[0] not in shifts
        kept_first = {chunks[0]} if stays_first else set()  # staying first: causal already
        return Treatment(
            recomputed,
            shifts,
            tuple(last),
            frozenset({*recomputed, *kept_first}),
            max(quality.recompute_tokens, first),
            causal,
            ignored,
        )

    def order(self, segments: Sequence[Segment], params: Any = None) -> list[int] | None:
        """The chunks' order (segment indices) that puts the relevant ones last, the most
        relevant last, the others in prompt order: what a router sends a back end without
        the hook so that ``treat`` there leaves them to vLLM (with the hook, the chunks the
        connector attends last, in its order); None where the order stays (nothing relevant
        moves, or no question). What names chunks wrongly is ignored, as ``treat`` does."""
        treated = _without_hook(
            segments, self.quality, self.first_is_causal, TransferParams.parse(params)
        )
        chunks = [i for i, s in enumerate(segments) if s.kind is SegmentKind.CHUNK]
        order = [i for i in chunks if i not in treated.last] + list(treated.last)
        return None if order == chunks else order

    def without_hook(self) -> Policy:
        """The same settings on a back end without the in-band hook (what a router sends
        its reordered prompts to)."""
        return replace(self, back_end=BackEnd(inband=False, recompute=self.back_end.recompute))


def treat(
    segments: Sequence[Segment],
    quality: QualityConfig,
    isolation: Isolation = Isolation.SYS,
    virtual_gap: int = 0,
    back_end: BackEnd = BackEnd(),
    params: Any = None,
) -> Treatment:
    """``Policy(quality, isolation, virtual_gap, back_end).treat(segments, params)``: for
    callers that hold the settings apart (the HF reference, the quality bench)."""
    return Policy(quality, isolation, virtual_gap, back_end).treat(segments, params)


def _hook_picks(
    segments: Sequence[Segment], quality: QualityConfig, up_to: int, causal: bool
) -> functools.partial[tuple[dict[int, range], dict[int, int], list[int]]]:
    """``relevant`` with the hook's settings (its picks and their spans), given the
    request's params."""
    return functools.partial(
        relevant,
        segments,
        quality.relevant_last,
        up_to,
        first_is_causal=causal,
        min_score=quality.relevant_min_score,
        span_tokens=quality.relevant_span_tokens,
        recompute_share=quality.relevant_recompute_share,
        span_min=quality.relevant_span_min_tokens,
        first_tokens=quality.relevant_first_tokens,
    )


def _without_hook(
    segments: Sequence[Segment], quality: QualityConfig, causal: bool, params: TransferParams
) -> Treatment:
    """``relevant_last`` where only a prefix loads: the relevant chunks recomputed whole that
    stand last already (a trailing run of them, just before the question) are left to vLLM,
    which computes them seeing everything before; nothing moves where it stands, nothing
    else is recomputed. With ``hookless_from`` ``last`` (the default) only the last of
    them (the most relevant), from its span (``relevant``'s, the hook's) on: the others and
    its tokens before that load isolated; ``span``: all of them, the first from its span."""
    picks = functools.partial(
        relevant,
        segments,
        quality.relevant_last,
        quality.relevant_recompute_tokens,
        first_is_causal=causal,
        min_score=quality.relevant_min_score,
    )
    ignored = None
    try:
        recomputed, _, last = picks(params)
    except BadTransferParams as err:
        ignored = str(err)
        recomputed, _, last = picks()
    chunks = [i for i, s in enumerate(segments) if s.kind is SegmentKind.CHUNK]
    tail: list[int] = []
    for i in reversed(chunks):
        if len(recomputed.get(i, ())) != len(segments[i]):
            break
        tail.append(i)
    computed = {i: range(len(segments[i])) for i in sorted(tail)}
    if computed and quality.hookless_from == "last":  # the others before it load
        computed = {max(computed): computed[max(computed)]}
    if computed and quality.hookless_from in ("span", "last"):
        first = min(computed)
        picks = _hook_picks(segments, quality, quality.relevant_recompute_tokens, causal)
        spans, _, _ = picks(params if ignored is None else None)
        if first in spans:  # its tokens before the span loaded, as the hook leaves them
            computed[first] = range(spans[first].start, len(segments[first]))
    exact = frozenset(i for i, r in computed.items() if r.start == 0)
    return Treatment(computed, {}, tuple(last), exact, 0, causal, ignored)


def relevant_order(
    segments: Sequence[Segment],
    quality: QualityConfig,
    isolation: Isolation = Isolation.SYS,
    virtual_gap: int = 0,
    params: Any = None,
) -> list[int] | None:
    """``Policy(quality, isolation, virtual_gap).order(segments, params)``, for callers that
    hold the settings apart."""
    return Policy(quality, isolation, virtual_gap).order(segments, params)
