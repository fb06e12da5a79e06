"""Which chunks the connector recomputes whole: by position, by relevance (BM25 over token
IDs), or as the request's kv_transfer_params name them, within a budget; and which it
attends last (``relevant_last``) and where every chunk then stands."""

from __future__ import annotations

import pytest

from chunkstore.bench.qa_cases import generate
from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.models import model_dir
from chunkstore.policy.selection import (
    RECOMPUTE_FLOOR,
    RECOMPUTE_SHARE,
    BadTransferParams,
    TransferParams,
    bm25_scores,
    by_score,
    choose,
    placement,
    recompute_budget,
    relevant,
    relevant_last,
    requested,
    select,
    span,
)


def test_bm25_ranks_the_chunk_sharing_the_questions_rare_tokens_first() -> None:
    # Token 7 is in every chunk (an article): it ranks nothing; 42 is the question's name.
    chunks = [[7, 1, 2, 3], [7, 42, 5, 42], [7, 9, 9, 9, 9, 9], [7, 8]]
    scores = bm25_scores([7, 42, 100], chunks)
    assert max(range(4), key=scores.__getitem__) == 1
    assert scores[1] > 5 * max(scores[0], scores[2], scores[3])
    assert bm25_scores([1], []) == []


def test_position_takes_the_last_chunks_and_budgets_bound_the_choice() -> None:
    chunks = [[1] * 10, [2] * 50, [3] * 10, [4] * 10]
    assert select([9], chunks, "position", 2) == [2, 3]
    assert select([9], chunks, "position", 0) == []
    assert select([9], chunks, "position", 9) == [0, 1, 2, 3]
    # 25 tokens: the last two chunks fit, the 50-token one is passed over, the first fits.
    assert select([9], chunks, "position", 3, max_tokens=30) == [0, 2, 3]
    assert choose([1, 0], [10, 50], 2, max_tokens=20) == [0]


def test_the_requests_choice_comes_first_and_a_malformed_one_is_refused() -> None:
    chunks = [[1], [2], [3]]
    assert select([3], chunks, "relevance", 1) == [2]
    # Indices are the application's: no budget applies; scores rank within the budget.
    assert select([3], chunks, "relevance", 1, params={"recompute_chunks": [1, 0, 1]}) == [0, 1]
    assert select([3], chunks, "relevance", 1, params={"chunk_scores": [0.9, 0.1, 0.2]}) == [0]
    assert select([3], chunks, "position", 2, params={"other_connector": 1}) == [1, 2]
    assert requested(None, 3) == (None, None)
    # The first chunk, when its isolated KV is causal already, is never recomputed.
    assert select([1], chunks, "relevance", 1, first_is_causal=True) == []
    assert select([1], chunks, "position", 3, first_is_causal=True) == [1, 2]
    params = {"recompute_chunks": [0, 2]}
    assert select([1], chunks, "position", 0, params=params, first_is_causal=True) == [2]
    bad = [
        {"recompute_chunks": [3]},
        {"recompute_chunks": [-1]},
        {"recompute_chunks": "0"},
        {"recompute_chunks": [True]},
        {"chunk_scores": [1.0, 2.0]},
        {"chunk_scores": [1.0, float("nan"), 0.0]},
        {"recompute_chunks": [0], "chunk_scores": [1, 2, 3]},
    ]
    for params in bad:
        with pytest.raises(BadTransferParams):
            select([3], chunks, "relevance", 1, params=params)


def test_hold_s_is_seconds_and_a_malformed_one_is_left_out_alone() -> None:
    assert TransferParams.parse({"hold_s": 30}).hold_s == 30.0
    assert TransferParams.parse({}).hold_s == 0.0
    for bad in (-1, "30", True, float("nan"), float("inf")):
        params = TransferParams.parse({"hold_s": bad, "keep_order": True})
        assert params.hold_s == 0.0 and params.keep_order  # the rest still read
        assert "hold_s is seconds" in (params.why_ignored("hold_s") or "")
        assert params.why_ignored("recompute_chunks") is None


def test_the_most_relevant_chunks_go_last_the_most_relevant_nearest_the_question() -> None:
    chunks = [[7, 1, 1], [7, 42, 42, 42], [7, 2, 2, 2, 2], [7, 42, 5]]
    assert relevant_last([42], chunks, 1) == [1]
    assert relevant_last([42], chunks, 2) == [3, 1]  # the best one last
    assert relevant_last([42], chunks, 0) == []
    # A clear ranking takes fewer: chunk 3 scores under 90% of chunk 1, and a chunk that
    # matches nothing scores 0, under any share of the best.
    second, best = sorted(bm25_scores([42], chunks))[-2:]
    assert 0 < second / best < 0.9
    assert relevant_last([42], chunks, 2, min_score=0.9) == [1]
    assert relevant_last([42], chunks, 3, min_score=0.01) == [3, 1]
    # An application's scores are ranks: its top N, whatever their scale.
    assert relevant_last([42], chunks, 2, {"chunk_scores": [9, 0, 0.1, 1]}, 0.9) == [3, 0]
    # The request's scores rank instead of BM25; malformed ones are refused.
    assert relevant_last([42], chunks, 2, {"chunk_scores": [9, 0, 5, 1]}) == [2, 0]
    with pytest.raises(BadTransferParams):
        relevant_last([42], chunks, 1, {"chunk_scores": [1, 2]})
    # Lengths 3, 4, 5, 3; chunk 1 placed last: 2 and 3 move up 4, it moves on 8.
    assert placement([3, 4, 5, 3], [1]) == [0, 8, -4, -4]
    assert placement([3, 4, 5, 3], [1, 3]) == [0, 5, -4, 0]  # 3 stays last
    assert placement([3, 4, 5, 3], [2, 3]) == [0, 0, 0, 0]  # already there: nothing moves
    assert placement([3, 4, 5, 3], []) == [0, 0, 0, 0]


def test_relevant_chunks_go_last_and_are_recomputed_there_when_short() -> None:
    bodies = [[1, 1, 1], [42, 42, 42, 42], [2, 2, 2, 2, 2], [42, 5, 5]]
    segments, start = [Segment(SegmentKind.SYS, 0, (9, 9))], 2
    for body in [*bodies, [42]]:
        kind = SegmentKind.QUESTION if body == [42] else SegmentKind.CHUNK
        segments.append(Segment(kind, start, tuple(body)))
        start += len(body)
    # Chunks 1 and 3 (segments 2 and 4) are the two most relevant, of 4 and 3 tokens: both
    # attended last, segment 2 (the more relevant) after segment 4, and recomputed there.
    moves = {2: 8, 3: -4, 4: -4}
    assert relevant(segments, 2, 4) == ({2: range(4), 4: range(3)}, moves, [4, 2])
    # One of them longer than the limit: both attended last, the short one recomputed, the
    # long one only moved (no span) or recomputed in part (its span: here from its first
    # match, a quarter of 2 tokens in being 0 tokens).
    assert relevant(segments, 2, 3) == ({4: range(3)}, moves, [4, 2])
    assert relevant(segments, 2, 3, span_tokens=2) == ({2: range(2), 4: range(3)}, moves, [4, 2])
    # Nothing recomputed at all: both only moved.
    assert relevant(segments, 2, 0, span_tokens=2) == ({}, moves, [4, 2])
    # Already last: recomputed where it stands, nothing moves.
    alone = segments[:3] + segments[-1:]
    assert relevant(alone, 1, 10, first_is_causal=True) == ({2: range(4)}, {}, [2])
    # The only chunk follows sys: recomputing it would change nothing, so it is left out.
    first = [segments[0], segments[1], Segment(SegmentKind.QUESTION, 5, (1,))]
    assert relevant(first, 1, 10, first_is_causal=True) == ({}, {}, [1])
    assert relevant(first, 1, 10) == ({1: range(3)}, {}, [1])
    assert relevant(segments, 0, 100) == ({}, {}, [])


def test_a_long_relevant_chunk_is_recomputed_where_it_matches_the_question() -> None:
    """``span``: the window with the most idf of the question's terms, its heaviest match a
    quarter in, clamped to the chunk; the whole chunk where it is no longer."""
    question = [42, 43]
    fact = [7] * 50 + [42, 43] + [7] * 48  # the match at 50
    other = [7] * 100
    assert span(question, [fact, other], 0, 40) == range(40, 80)  # 50 - 40 // 4
    assert span(question, [fact, other], 0, 100) == range(100)
    early = [42, 43] + [7] * 98
    assert span(question, [early, other], 0, 40) == range(0, 40)  # clamped at the start
    late = [7] * 98 + [42, 43]
    assert span(question, [late, other], 0, 40) == range(60, 100)  # and at the end
    # A term every chunk holds weighs less than a rare one: the window goes to the rare one.
    common = [42] + [7] * 59 + [43, 44] + [7] * 38
    assert span([42, 43, 44], [common, [42] * 100], 0, 20) == range(55, 75)
    # A common word of the question before the name ("In which city does Ada Lovelace
    # live?"): the window is placed by the name, so the answer after it stays inside.
    named = [7] * 30 + [5] + [7] * 15 + [42, 43] + [7] * 53
    others = [[5] + [7] * 99, [7] * 50 + [5] + [7] * 49]
    assert span([5, 42, 43], [named, *others], 0, 40) == range(36, 76)  # 46 - 40 // 4
    # Within the budget, in relevant(): a 100-token pick recomputed as its 40-token span.
    segments, start = [Segment(SegmentKind.SYS, 0, (9, 9))], 2
    for kind, body in [(SegmentKind.CHUNK, fact), (SegmentKind.CHUNK, other)] + [
        (SegmentKind.QUESTION, question)
    ]:
        segments.append(Segment(kind, start, tuple(body)))
        start += len(body)
    assert relevant(segments, 1, 50, span_tokens=40) == (
        {1: range(40, 80)},
        {1: 100, 2: -100},
        [1],
    )


def chosen(result: tuple[dict[int, range], dict[int, int], list[int]]) -> tuple[list[int], int]:
    """The chunks ``relevant`` recomputes (whole, checked) and how many moved."""
    recomputed, shifts, last = result
    return [i for i, r in recomputed.items() if r.start == 0], sum(i in shifts for i in last)


def test_the_relevant_chunks_recomputed_fit_a_budget_that_scales_with_the_prompt() -> None:
    """At most RECOMPUTE_SHARE of the chunk tokens (RECOMPUTE_FLOOR on short prompts) are
    recomputed, the most relevant first; where not even that one fits, they move."""
    assert recompute_budget(100) == RECOMPUTE_FLOOR
    assert recompute_budget(10_000) == int(RECOMPUTE_SHARE * 10_000)

    def prompt(bodies: list[list[int]]) -> list[Segment]:
        segments, start = [Segment(SegmentKind.SYS, 0, (9, 9))], 2
        for body in [*bodies, [42, 43]]:
            kind = SegmentKind.QUESTION if body == [42, 43] else SegmentKind.CHUNK
            segments.append(Segment(kind, start, tuple(body)))
            start += len(body)
        return segments

    # Eight chunks of 100 tokens (budget 320); three name 42 and 43, the best of them twice.
    plain = [7] * 100
    best, good = [42, 43, 42, 43, *[7] * 96], [42, 43, *[7] * 98]
    segments = prompt([plain, good, plain, best, plain, good, plain, plain])
    # Three chosen: 300 tokens fit.
    assert chosen(relevant(segments, 3, 100)) == ([2, 4, 6], 3)
    # Twelve chunks of 50 and one of 100, two of 50 relevant: 200 tokens, budget 256 ...
    small, fact = [7] * 50, [42, 43, *[7] * 48]
    segments = prompt([small] * 5 + [fact, small, fact] + [small] * 4 + [[7] * 100])
    assert chosen(relevant(segments, 3, 100)) == ([6, 8], 2)
    # ... and three of 120 with 400 other tokens (budget 304): the best two fit (of the
    # two alike, the later).
    long_fact = [42, 43, *[7] * 118]
    segments = prompt([long_fact, [7] * 200, [42, 43, 42, 43, *[7] * 116], [7] * 200, long_fact])
    assert chosen(relevant(segments, 3, 200)) == ([3, 5], 3)  # all three go last


def test_settings_are_checked() -> None:
    # Nothing is recomputed by default; asked for a count, relevance chooses.
    default = ConnectorConfig()
    assert (default.quality.recompute_chunks, default.quality.recompute_by) == (0, "relevance")
    with pytest.raises(ValueError, match="need inband_isolation"):
        ConnectorConfig.from_extra({"inband_isolation": False, "recompute_chunks": 1})
    assert ConnectorConfig.from_extra({"recompute_by": "relevance"}).quality.recompute_by == (
        "relevance"
    )
    with pytest.raises(ValueError, match="recompute_by must be position or relevance"):
        ConnectorConfig.from_extra({"recompute_by": "attention"})
    with pytest.raises(ValueError, match="counts >= 0"):
        ConnectorConfig.from_extra({"recompute_max_tokens": -1})
    with pytest.raises(ValueError, match="choose one"):
        ConnectorConfig.from_extra({"relevant_last": 2, "recompute_chunks": 1})
    # relevant_last acts without the hook too: relevant chunks standing last go to vLLM.
    hookless = ConnectorConfig.from_extra({"inband_isolation": False, "relevant_last": 1})
    assert hookless.quality.relevant_last == 1
    assert ConnectorConfig.from_extra({"inband_isolation": False}).quality.relevant_last == 3
    with pytest.raises(ValueError, match="counts >= 0"):
        ConnectorConfig.from_extra({"relevant_recompute_tokens": -1})
    assert (default.quality.relevant_last, default.quality.relevant_recompute_tokens) == (3, 384)
    assert default.quality.relevant_span_tokens == 0  # a longer pick is only moved, unless set
    with pytest.raises(ValueError, match="counts >= 0"):
        ConnectorConfig.from_extra({"relevant_span_tokens": -1})
    assert default.quality.relevant_min_score == 0.5
    with pytest.raises(ValueError, match="relevant_min_score"):
        ConnectorConfig.from_extra({"relevant_min_score": 1.5})


def test_bm25_finds_the_document_that_answers_in_the_quality_bench() -> None:
    """On the bench's one-fact and distracted questions (the answer's document among 8
    prose documents of ~500 tokens, with look-alike facts and people sharing last names, in
    a real tokenizer), BM25 over token IDs ranks the document holding the answer first in
    most cases: the relevance signal ``recompute_by: relevance`` relies on. Adjacent token
    pairs count: "Dara Ivanov" beats a document about another Ivanov (measured: 50 of 60
    with pairs, 48 without)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2"))
    cases = generate(90, seed=0, docs_per_case=8, filler=16, prose=True)
    found = 0
    single = [c for c in cases if c.kind != "two"]
    for case in single:
        chunks = [tok.encode(d, add_special_tokens=False) for d in case.documents]
        scores = bm25_scores(tok.encode(case.question, add_special_tokens=False), chunks)
        found += by_score(scores)[0] == case.relevant[0]
    assert found >= 0.83 * len(single), f"{found} of {len(single)}"
