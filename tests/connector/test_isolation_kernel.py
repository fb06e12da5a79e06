"""The isolation hook's chunk rows through one call of vLLM's CPU kernel (``ChunkBatch``) are
the rows its reference path computes: one partial attention per chunk and part, merged by
log-sum-exp (``attention_after_context``), on vLLM's real paged cache layout and kernel.
Shapes a step really has: chunks of different lengths, a chunk's last tokens only (chunked
prefill), no sys (``isolation: none``), requests whose sys parts differ in length, GQA."""

from __future__ import annotations

import pytest
import torch

from chunkstore_vllm.hook.bench import LAYER, HookStep
from chunkstore_vllm.hook.step_split import HookRows, StepSplit

TOLERANCE = 1e-5


def outputs(step: HookStep, rows: list[HookRows], query: torch.Tensor) -> torch.Tensor:
    """(reference, kernel) outputs of ``rows`` (their rows of ``query``; the rest zero)."""
    reference = torch.zeros_like(query)
    step.hook.attention.attend_rows(
        StepSplit([], None), rows, step.call, query, step.cache, reference
    )
    chunks = step.hook.splitter.chunk_batch(rows, step.call)
    assert chunks is not None
    kernel = torch.zeros_like(query)
    split = StepSplit([], None, chunks=chunks)
    step.hook.attention.attend_chunks(split, step.call, query, step.cache, kernel)
    return torch.stack([reference, kernel])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size"),
    [(9, 3, 64), (14, 2, 64), (4, 4, 128)],
    ids=["smollm2", "qwen2.5-0.5b", "mha-128"],
)
def test_every_chunk_token_of_a_step_as_the_reference_computes_it(
    heads, kv_heads, head_size
) -> None:
    step = HookStep(heads, kv_heads, head_size, 24, [150, 143, 1, 129, 70], block_size=128)
    reference, kernel = outputs(step, step.rows, step.query)
    assert (reference - kernel).abs().max() < TOLERANCE
    assert reference.abs().max() > 0.1  # every row computed, not left at zero
    assert step.max_abs_diff() < TOLERANCE


def test_partial_runs_no_sys_and_two_requests_with_other_sys_lengths() -> None:
    """Chunked prefill: a chunk's last tokens, seeing the run's earlier ones; a request
    without sys; and a second request, its sys 10 tokens against the first's 24, whose
    chunks stand at the same shifts (the rotation of each sys is its own length's)."""
    step = HookStep(9, 3, 64, 24, [60, 50, 40], block_size=32)
    first = step.rows[0].block_ids
    # A second request's blocks: the first's in reverse (the same cache, other slots).
    second = first.flip(0)
    rows = [
        HookRows(0, 12, first, 24, 84, 24, 0),  # the first chunk's last 12 of 60 tokens
        HookRows(12, 50, first, 84, 134, 24, 60),
        HookRows(62, 5, first, 134, 160, 0, 110),  # no sys (isolation: none)
        HookRows(67, 30, second, 10, 40, 10, 60),  # the same shift, a shorter sys
        HookRows(97, 1, second, 40, 41, 10, 0),  # one token
    ]
    query = torch.randn(98, 9, 64, generator=torch.Generator().manual_seed(1))
    reference, kernel = outputs(step, rows, query)
    assert (reference - kernel).abs().max() < TOLERANCE
    assert all(reference[r.row : r.row + r.count].abs().max() > 0.1 for r in rows)


def test_the_hooks_cache_is_made_once_a_step_and_reused_by_every_layer() -> None:
    step = HookStep(9, 3, 64, 24, [40, 30], block_size=32)
    chunks = step.hook.splitter.chunk_batch(step.rows, step.call)
    assert chunks is not None
    split = StepSplit([], None, chunks=chunks)
    outs = []
    for _ in range(2):  # two layers of one step (the same cache stands in for both)
        out = torch.zeros_like(step.query)
        step.hook.attention.attend_chunks(split, step.call, step.query, step.cache, out)
        outs.append(out)
    made = split.chunk_cache
    assert made is not None and split.chunk_cache is made
    assert torch.equal(outs[0], outs[1])
    assert step.call.name == LAYER
