"""Segmentation: sys SEP chunk SEP ... SEP question, the separator ending its segment."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkstore.errors import SegmentationError
from chunkstore.kv.segments import (
    SegmentKind,
    build_chunked_prompt,
    chunk_places,
    find_separators,
    reordered_ids,
    split_prompt,
)

tokens = st.lists(st.integers(0, 5), max_size=60)
separators = st.lists(st.integers(0, 5), min_size=1, max_size=3)


@given(tokens, separators)
def test_segments_concatenate_back_to_the_prompt(prompt: list[int], sep: list[int]) -> None:
    segments = split_prompt(prompt, sep)
    assert [t for s in segments for t in s.token_ids] == prompt
    position = 0
    for seg in segments:
        assert seg.start == position
        position = seg.end


@given(tokens, separators)
def test_separator_is_never_split_and_ends_its_segment(prompt: list[int], sep: list[int]) -> None:
    segments = split_prompt(prompt, sep)
    ends = find_separators(prompt, sep)
    separated = [s for s in segments if s.kind is not SegmentKind.QUESTION]
    assert [s.end for s in separated] == ends
    for seg in separated:
        assert list(seg.token_ids[-len(sep) :]) == sep
        # No separator match starts inside a segment and ends outside it.
        inner = find_separators(seg.token_ids, sep)
        assert inner and inner[-1] == len(seg)
    for seg in segments:
        if seg.kind is SegmentKind.QUESTION:
            assert not find_separators(seg.token_ids, sep)


@given(tokens, separators)
def test_kinds_follow_the_grammar(prompt: list[int], sep: list[int]) -> None:
    segments = split_prompt(prompt, sep)
    kinds = [s.kind for s in segments]
    if not find_separators(prompt, sep):
        assert kinds == ([SegmentKind.QUESTION] if prompt else [])
        return
    assert kinds[0] is SegmentKind.SYS
    body = kinds[1:-1] if kinds[-1] is SegmentKind.QUESTION else kinds[1:]
    assert all(k is SegmentKind.CHUNK for k in body)
    assert kinds.count(SegmentKind.QUESTION) <= 1


def test_worked_example() -> None:
    sep = [9, 9]
    prompt = [1, 2, 9, 9, 3, 4, 5, 9, 9, 6, 9, 9, 7, 8]
    segs = split_prompt(prompt, sep)
    assert [(s.kind.value, s.start, s.token_ids) for s in segs] == [
        ("sys", 0, (1, 2, 9, 9)),
        ("chunk", 4, (3, 4, 5, 9, 9)),
        ("chunk", 9, (6, 9, 9)),
        ("question", 12, (7, 8)),
    ]
    # Overlapping candidates are taken left to right, like str.split.
    assert find_separators([9, 9, 9, 1], sep) == [2]


def test_ingest_shape_has_no_question() -> None:
    segs = split_prompt([1, 0, 2, 2, 0], [0])
    assert [s.kind for s in segs] == [SegmentKind.SYS, SegmentKind.CHUNK]


def test_empty_separator_is_refused() -> None:
    with pytest.raises(SegmentationError):
        split_prompt([1, 2], [])


def fake_tokenize(text: str) -> list[int]:
    """One token per character: '#' is 35; enough to exercise the joining rules."""
    return [ord(c) for c in text]


def test_build_chunked_prompt_tokenizes_each_segment_alone() -> None:
    prompt = build_chunked_prompt(
        fake_tokenize, "sys", ["ab", "c"], "q?", separator=[0], prefix=[1]
    )
    assert prompt.token_ids == (1, *b"sys", 0, *b"ab", 0, *b"c", 0, *b"q?")
    assert [s.kind for s in prompt.segments] == ["sys", "chunk", "chunk", "question"]
    assert prompt.segments[1].token_ids == (*b"ab", 0)
    same_chunk = build_chunked_prompt(fake_tokenize, "other", ["x", "ab"], None, separator=[0])
    assert same_chunk.segments[2].token_ids == prompt.segments[1].token_ids


def test_build_refuses_text_that_holds_or_merges_with_the_separator() -> None:
    sep = fake_tokenize("##")
    with pytest.raises(SegmentationError, match="chunk 0 contains"):
        build_chunked_prompt(fake_tokenize, "sys", ["a##b"], "q", sep)
    with pytest.raises(SegmentationError, match="merge"):
        build_chunked_prompt(fake_tokenize, "sys#", ["a"], "q", sep)


def test_build_with_a_real_tokenizer(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sep = tok.encode("##", add_special_tokens=False)
    prompt = build_chunked_prompt(
        lambda s: tok.encode(s, add_special_tokens=False),
        "The system prompt.",
        ["First document.", "Second document."],
        "Which?",
        sep,
    )
    assert [s.kind for s in prompt.segments] == ["sys", "chunk", "chunk", "question"]
    assert tok.decode(list(prompt.segments[1].token_ids)) == "First document.##"


def test_a_reordered_prompt_moves_whole_chunks_and_keeps_sys_and_the_question() -> None:
    sep = [9]
    segments = split_prompt([1, 9, 2, 2, 9, 3, 9, 4, 4, 4, 9, 5], sep)  # sys c0 c1 c2 question
    assert reordered_ids(segments, [3, 1, 2]) == [1, 9, 4, 4, 4, 9, 2, 2, 9, 3, 9, 5]
    assert chunk_places([3, 1, 2]) == {2: 0, 0: 1, 1: 2}
    for wrong in ([1, 2], [1, 1, 2], [0, 1, 2], [1, 2, 4], [1, 2, 3, 9], [-1, 2, 3]):
        with pytest.raises(SegmentationError):
            reordered_ids(segments, wrong)
