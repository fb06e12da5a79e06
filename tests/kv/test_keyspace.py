"""The key space: one object makes every key the connector, the router and ingest use, and
the keys are those of ``chunkstore.kv.keys`` for its settings, byte for byte."""

from __future__ import annotations

from chunkstore.kv.fingerprint import ModelFingerprint
from chunkstore.kv.keys import (
    Isolation,
    KVLayout,
    prefix_keys,
    prefix_tail_key,
    segment_keys,
)
from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import SegmentKind, split_prompt

ROTARY = RotaryConfig(head_dim=64, rotary_dim=64, theta=100000.0)
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64)
FP = ModelFingerprint.of("weights-a", "float32", ROTARY, LAYOUT)
SEP = (0,)
CHUNKED = [1, 2, 0, 5, 5, 0, 7, 7, 7, 0, 9]  # sys, two chunks, a question


def test_a_chunked_prompt_has_a_piece_per_sys_and_chunk_keyed_as_the_segments_are() -> None:
    for isolation in Isolation:
        for gap in (0, 4):
            space = KeySpace(FP, SEP, isolation, gap)
            plan = space.plan(CHUNKED, "alice")
            segments = split_prompt(CHUNKED, SEP)
            expected = segment_keys(segments, FP.model_fp, FP.layout_fp, isolation, gap, "alice")
            assert plan.chunked
            assert [p.key for p in plan.pieces] == expected[:-1]  # the question is never kept
            assert [p.tokens for p in plan.pieces] == [3, 3, 4]
            assert space.segment_keys(segments, "alice") == expected


def test_each_piece_carries_the_prompt_that_stores_it_alone() -> None:
    """``sys SEP c SEP`` in isolation sys (sys is stored by the request itself); ``c SEP``,
    and sys by ``sys SEP``, in isolation none."""
    sys_piece, *chunks = KeySpace(FP, SEP, Isolation.SYS).plan(CHUNKED).pieces
    assert sys_piece.alone is None
    assert [c.alone for c in chunks] == [(1, 2, 0, 5, 5, 0), (1, 2, 0, 7, 7, 7, 0)]
    pieces = KeySpace(FP, SEP, Isolation.NONE).plan(CHUNKED).pieces
    assert [p.alone for p in pieces] == [(1, 2, 0), (5, 5, 0), (7, 7, 7, 0)]


def test_a_plain_prompt_has_a_piece_per_whole_prefix_block() -> None:
    space = KeySpace(FP, SEP, prefix_block_tokens=3)
    plain = [1, 2, 3, 4, 5, 6, 7]
    plan = space.plan(plain, "bob")
    assert not plan.chunked
    assert [p.key for p in plan.pieces] == prefix_keys(FP.model_fp, FP.layout_fp, plain, 3, "bob")
    assert [(p.segment.kind, p.segment.start, p.tokens) for p in plan.pieces] == [
        (SegmentKind.PREFIX, 0, 3),
        (SegmentKind.PREFIX, 3, 3),
    ]
    tail = space.prefix_tail(plain, "bob")
    assert tail is not None and tail.segment.token_ids == (7,)
    assert tail.key == prefix_tail_key(FP.model_fp, FP.layout_fp, plain, 3, "bob")
    assert space.prefix_tail(plain[:6]) is None
    # the connector's block size (rounded up to vLLM's) is given per call
    assert [p.tokens for p in space.prefix_pieces(plain, "bob", block_tokens=2)] == [2, 2, 2]
    assert KeySpace(FP, SEP, prefix_block_tokens=0).plan(plain) == space.plan([], "bob")


def test_keys_are_pinned() -> None:
    """Keys stored by one release are found by the next: a change here invalidates every
    stored entry (and the router's and ingest's view of them), so it is never silent."""
    space = KeySpace(FP, SEP, Isolation.SYS, virtual_gap=4, prefix_block_tokens=3)
    chunked = space.plan([1, 2, 0, 5, 5, 0, 9], "alice")
    assert [p.key.hex() for p in chunked.pieces] == [
        "231e60d3152c84b6d38e5a73f30c2004",
        "a9a16fd372d11125f3e281eb97619854",
    ]
    plain = [1, 2, 3, 4, 5, 6, 7]
    assert [p.key.hex() for p in space.plan(plain).pieces] == [
        "7fd040cbcf5c49ad5cb961ef46b3b233",
        "23133f1e5fb996efe04793f0650ced6b",
    ]
    tail = space.prefix_tail(plain)
    assert tail is not None and tail.key.hex() == "840235119f74e5fd6c9e7babd85a1405"
