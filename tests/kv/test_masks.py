"""The isolation mask in every form, and its cache."""

from __future__ import annotations

import torch

from chunkstore.kv.keys import Isolation
from chunkstore.kv.masks import (
    IsolationMaskBuilder,
    MaskForm,
    SegmentLayout,
    isolation_mask,
    visible_ranges,
)
from chunkstore.kv.segments import SegmentKind

S, C, Q = SegmentKind.SYS, SegmentKind.CHUNK, SegmentKind.QUESTION
LAYOUT = SegmentLayout((S, C, C, Q), (2, 2, 1, 2))


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in mask.tolist()]


def test_isolation_sys_matches_the_rules_by_hand() -> None:
    assert rows(isolation_mask(LAYOUT, Isolation.SYS, MaskForm.BOOL)) == [
        "x......",  # sys: causal among themselves
        "xx.....",
        "xxx....",  # chunk 1: sys + its own earlier tokens
        "xxxx...",
        "xx..x..",  # chunk 2: sys + itself, never chunk 1
        "xxxxxx.",  # question: everything before it
        "xxxxxxx",
    ]


def test_isolation_none_chunks_see_only_themselves() -> None:
    assert rows(isolation_mask(LAYOUT, Isolation.NONE, MaskForm.BOOL)) == [
        "x......",
        "xx.....",
        "..x....",
        "..xx...",
        "....x..",
        "xxxxxx.",
        "xxxxxxx",
    ]


def test_forms_agree() -> None:
    ok = isolation_mask(LAYOUT, Isolation.SYS, MaskForm.BOOL)
    additive = isolation_mask(LAYOUT, Isolation.SYS, MaskForm.ADDITIVE, dtype=torch.float16)
    int8 = isolation_mask(LAYOUT, Isolation.SYS, MaskForm.INT8)
    assert additive.dtype == torch.float16 and int8.dtype == torch.int8
    assert torch.equal(additive == 0, ok)
    assert torch.equal(torch.isinf(additive), ~ok)
    assert torch.equal(int8 == 1, ~ok)  # vLLM-Ascend: 1 = masked


def test_compact_form_describes_the_same_mask() -> None:
    for isolation in Isolation:
        dense = torch.zeros(LAYOUT.num_tokens, LAYOUT.num_tokens, dtype=torch.bool)
        for index, (start, end) in enumerate(LAYOUT.bounds()):
            for r in visible_ranges(LAYOUT, isolation, index):
                block = torch.ones(end - start, r.end - r.start, dtype=torch.bool)
                dense[start:end, r.start : r.end] = block.tril() if r.causal else block
        assert torch.equal(dense, isolation_mask(LAYOUT, isolation, MaskForm.BOOL))
    assert LAYOUT.segment_ids().tolist() == [0, 0, 1, 1, 2, 3, 3]


def test_ordinary_prompt_is_causal() -> None:
    layout = SegmentLayout((Q,), (4,))
    expected = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(isolation_mask(layout, Isolation.SYS, MaskForm.BOOL), expected)


def test_builder_caches_by_shape_and_dtype() -> None:
    builder = IsolationMaskBuilder(capacity=2)
    a = builder.get(LAYOUT, Isolation.SYS, MaskForm.ADDITIVE, torch.float32)
    assert builder.get(LAYOUT, Isolation.SYS, MaskForm.ADDITIVE, torch.float32) is a
    assert builder.builds == 1
    b = builder.get(LAYOUT, Isolation.SYS, MaskForm.ADDITIVE, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and builder.builds == 2
    builder.get(LAYOUT, Isolation.NONE, MaskForm.INT8)  # evicts the least recent (float32)
    builder.get(LAYOUT, Isolation.SYS, MaskForm.ADDITIVE, torch.float32)
    assert builder.builds == 4
