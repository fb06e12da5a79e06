"""The quality policy in one place (``chunkstore.policy.treatment``): what a prompt's chunks get,
in the order the connector applies it, on back ends with and without the in-band hook."""

from __future__ import annotations

import dataclasses

import pytest

from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.policy.treatment import BackEnd, QualityConfig, relevant_order, treat

NONE = Isolation.NONE


def prompt(*bodies: list[int], question: list[int] | None = None) -> list[Segment]:
    """sys (two tokens), the chunks, and a question (none: a prompt that asks nothing)."""
    segments, start = [Segment(SegmentKind.SYS, 0, (9, 9))], 2
    for body in bodies:
        segments.append(Segment(SegmentKind.CHUNK, start, tuple(body)))
        start += len(body)
    if question is not None:
        segments.append(Segment(SegmentKind.QUESTION, start, tuple(question)))
    return segments


# Chunks 1 and 3 (segments 2 and 4) name the question's 42; chunk 1 twice.
RAG = prompt([1, 1, 1], [42, 42, 42, 42], [2, 2, 2, 2, 2], [42, 5, 5], question=[42])


def test_the_default_puts_the_relevant_chunks_last_and_recomputes_them_there() -> None:
    treated = treat(RAG, QualityConfig())
    assert treated.last == (4, 2)  # the most relevant last
    assert treated.shifts == {2: 8, 3: -4, 4: -4}
    assert treated.recomputed == {2: range(4), 4: range(3)}
    assert treated.exact == {2, 4} and treated.moved == 2
    # Their spans (each at least 32 tokens: these chunks whole), every other chunk's first 4.
    assert treated.first_tokens == 4
    # Where the workers cannot recompute (tensor parallelism): only moved, nothing blended.
    moved = treat(RAG, QualityConfig(), back_end=BackEnd(recompute=False))
    assert (moved.last, moved.recomputed, moved.first_tokens) == ((4, 2), {}, 0)


def test_a_recompute_share_recomputes_each_relevant_chunk_in_part() -> None:
    """``relevant_recompute_share`` (the default's): the relevant chunks, put last, each
    recompute the ``span`` of an equal part of that share of the chunk tokens, at least
    ``relevant_span_min_tokens`` (whole where shorter), however long they are."""
    long = prompt(*([7] * 40 for _ in range(2)), [7] * 30 + [42] * 3 + [7] * 27, question=[42])
    share = QualityConfig(
        relevant_recompute_share=0.2, relevant_span_min_tokens=0, relevant_first_tokens=0
    )
    treated = treat(long, share)
    assert treated.last == (3,) and treated.shifts == {}  # last already
    # 0.2 x 140 chunk tokens: 28, around the question's 42s, the first (30) a quarter in.
    assert treated.recomputed == {3: range(23, 51)} and treated.first_tokens == 0
    # The default's floor: 32 tokens, 30 - 32 // 4 on.
    assert treat(long, QualityConfig(relevant_recompute_share=0.2)).recomputed == {3: range(22, 54)}
    # A chunk longer than relevant_recompute_tokens too, where without the share it is
    # only moved.
    longer = dataclasses.replace(share, relevant_recompute_tokens=59)
    assert treat(long, longer).recomputed == {3: range(23, 51)}
    whole = dataclasses.replace(longer, relevant_recompute_share=0.0)
    assert treat(long, whole).recomputed == {}
    # Two relevant chunks share it equally (0.4 x 15 tokens: 3 each), one shorter whole ...
    equal = QualityConfig(
        relevant_recompute_share=0.4, relevant_span_min_tokens=0, relevant_first_tokens=0
    )
    both = treat(RAG, equal)
    assert both.last == (4, 2) and both.shifts == {2: 8, 3: -4, 4: -4}
    assert both.recomputed == {2: range(0, 3), 4: range(0, 3)}
    # ... and the other chunks' first tokens come out of the share: 6 less one each of the
    # two others, 4 for the picks, 2 each.
    firsts = treat(RAG, dataclasses.replace(equal, relevant_first_tokens=1))
    assert firsts.recomputed == {2: range(0, 2), 4: range(0, 2)} and firsts.first_tokens == 1
    with pytest.raises(ValueError, match="relevant_recompute_share"):
        QualityConfig(relevant_recompute_share=1.5)


def test_chunks_named_or_counted_are_recomputed_where_they_stand() -> None:
    quality = QualityConfig.from_settings({"recompute_chunks": 1})
    assert quality.relevant_last == 0  # the default gives way
    treated = treat(RAG, quality)
    assert (treated.recomputed, treated.shifts, treated.last) == ({2: range(4)}, {}, ())
    named = treat(RAG, QualityConfig(), params={"recompute_chunks": [2, 3]})
    assert named.recomputed == {3: range(5), 4: range(3)} and not named.shifts
    assert named.first_tokens == 0
    # Without the in-band hook nothing is recomputed where it stands: the request's own
    # choice included.
    hookless = BackEnd(inband=False)
    assert treat(RAG, quality, back_end=hookless).recomputed == {}


def test_without_the_hook_relevant_chunks_standing_last_are_left_to_vllm() -> None:
    """Only a prefix loads: the relevant chunks recomputed whole that stand last already are
    computed by vLLM (``computed_from``); one standing elsewhere cannot move, so stays
    loaded; put last (``relevant_order``, as the router sends it) the last of them is
    computed, the one before it loaded (``hookless_from`` ``last``; ``span``: both)."""
    hookless = BackEnd(inband=False)
    treated = treat(RAG, QualityConfig(), back_end=hookless)
    assert treated.last == (4, 2) and not treated.shifts
    assert treated.recomputed == {4: range(3)}  # chunk 1 (segment 2) does not stand last
    assert treated.computed_from(RAG) == RAG[4].start and treated.first_tokens == 0
    order = relevant_order(RAG, QualityConfig())
    assert order == [1, 3, 4, 2]  # the others in prompt order, the most relevant last
    sent = prompt(*(RAG[i].token_ids for i in order), question=[42])
    there = treat(sent, QualityConfig(), back_end=hookless)
    assert there.recomputed == {4: range(4)} and there.last == (3, 4)
    assert there.computed_from(sent) == sent[4].start
    both = treat(sent, QualityConfig(hookless_from="span"), back_end=hookless)
    assert both.recomputed == {3: range(3), 4: range(4)} and both.last == (3, 4)
    assert both.computed_from(sent) == sent[3].start
    assert relevant_order(sent, QualityConfig()) is None  # in its order already
    # Nothing relevant, or relevant_last 0: everything loads.
    assert treat(RAG, QualityConfig(relevant_last=0), back_end=hookless).computed_from(RAG) is None
    # The application's scores rank, as they do with the hook.
    scored = relevant_order(RAG, QualityConfig(), params={"chunk_scores": [9, 0, 0, 0]})
    assert scored == [2, 3, 4, 1]


def test_without_the_hook_vllm_computes_from_the_last_relevant_chunks_span() -> None:
    """``hookless_from`` ``last`` (the default): only the last of the relevant chunks
    standing last is computed, from its span on (the hook's, ``relevant``), the others and
    its tokens before the span load; ``span``: the first of them from its span, the ones
    after it whole; ``chunk``: the first from its first token."""
    hookless = BackEnd(inband=False)
    body = [7] * 60 + [42] * 2 + [7] * 38  # a relevant chunk of 100, its match 60 in
    short = [42] + [9] * 29  # the most relevant (BM25 favours the short one)
    sent = prompt([7] * 100, [8] * 100, body, short, question=[42])  # in the router's order
    # Its span is the hook's (each pick at least 32 tokens around the match) ...
    assert treat(sent, QualityConfig()).recomputed == {3: range(52, 84), 4: range(30)}
    last = treat(sent, QualityConfig(), back_end=hookless)
    assert last.recomputed == {4: range(30)} and last.last == (3, 4) and last.exact == {4}
    assert last.computed_from(sent) == sent[4].start and not last.shifts
    longer = prompt([7] * 100, short, body, question=[42])  # the last one in part
    assert treat(longer, QualityConfig(), back_end=hookless).recomputed == {3: range(52, 100)}
    # ... from the first one's span: the rest of it, the chunk after, the question.
    span = treat(sent, QualityConfig(hookless_from="span"), back_end=hookless)
    assert span.recomputed == {3: range(52, 100), 4: range(30)} and span.exact == {4}
    assert span.computed_from(sent) == sent[3].start + 52
    whole = treat(sent, QualityConfig(hookless_from="chunk"), back_end=hookless)
    assert whole.recomputed == {3: range(100), 4: range(30)}
    assert whole.computed_from(sent) == sent[3].start
    with pytest.raises(ValueError, match="hookless_from must be last or span or chunk"):
        QualityConfig(hookless_from="token")


def test_the_chunk_right_after_sys_is_never_recomputed_where_it_is_causal_already() -> None:
    # Named alone: its isolated KV is its causal KV, nothing is left of the request's
    # choice, and the defaults decide (the connector's behaviour since the choice was
    # added; the bench reports it so).
    first = treat(RAG, QualityConfig(), params={"recompute_chunks": [0]})
    assert 1 not in first.recomputed and first.last == (4, 2)
    # With a virtual gap (or isolation none) it is not causal: recomputed.
    gapped = treat(RAG, QualityConfig(), NONE, params={"recompute_chunks": [0]})
    assert gapped.recomputed == {1: range(3)} and not gapped.first_is_causal
    # Chosen by relevance and staying first (the only chunk): exact, and free.
    alone = prompt([42, 42], question=[42])
    treated = treat(alone, QualityConfig(relevant_last=1))
    assert (treated.recomputed, treated.exact, treated.last) == ({}, {1}, (1,))


def test_malformed_transfer_params_are_ignored_and_said() -> None:
    treated = treat(RAG, QualityConfig(), params={"recompute_chunks": [7]})
    assert treated.ignored_params is not None and "7" in treated.ignored_params
    assert treated.recomputed == treat(RAG, QualityConfig()).recomputed


def test_a_prompt_without_a_question_keeps_its_chunks_isolated() -> None:
    asks_nothing = prompt([1, 1], [42, 42])
    treated = treat(asks_nothing, QualityConfig(recompute_tokens=4, relevant_last=0))
    assert (treated.recomputed, treated.shifts, treated.first_tokens) == ({}, {}, 4)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"recompute_max_tokens": -1}, "counts >= 0"),
        ({"relevant_last": 2, "recompute_chunks": 1}, "choose one"),
        ({"recompute_by": "attention"}, "recompute_by must be"),
        ({"relevant_min_score": 1.5}, "relevant_min_score"),
        ({"question_scale": 0}, "must be > 0"),
    ],
)
def test_settings_are_checked_in_one_place(settings: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        QualityConfig.from_settings(settings)
