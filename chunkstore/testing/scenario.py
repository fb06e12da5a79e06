"""Chunked prompts for the connector's end-to-end tests and benches, and the checks their
answers must pass against the HF reference or another vLLM run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import ChunkedPrompt, Segment, build_chunked_prompt
from chunkstore.prompts import AUTO, separator_ids

if TYPE_CHECKING:
    from chunkstore.testing.reference import Forward, HFReference

SYS = "You are a careful assistant. Answer only from the documents below."
OTHER_SYS = "You are a poet. Answer in rhyme."
DOCS = [
    "The Eiffel Tower stands in Paris, the capital of France. It was finished in 1889.",
    "Berlin is the capital of Germany. The river Spree flows through the city centre.",
    "Mount Everest, on the border of Nepal and China, is the highest mountain on Earth.",
]
# Short documents, as the README quickstart has them, for the tests of ingest and RAG apps.
RAG_SYS = "Answer from the documents."
RAG_DOCS = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "The Danube flows through ten countries.",
    "Mount Everest is the highest mountain on Earth.",
]
QUESTIONS = ["Which city is the Eiffel Tower in?", "What is the highest mountain on Earth?"]
TOLERANCE = 1e-3  # on first-token logprobs, against the fp32 reference


class Scenario:
    """A model's tokenizer and the connector's default separator ("auto": ``<file_sep>``
    for SmolLM2, ``##`` for the tiny model), to build chunked prompts with."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        self.model = model
        self.tok = AutoTokenizer.from_pretrained(model)
        self.sep = separator_ids(self.tok, AUTO)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, sys_text: str, docs: list[str], question: str | None) -> ChunkedPrompt:
        return build_chunked_prompt(self.encode, sys_text, docs, question, self.sep)


def default_treatment(
    segments: tuple[Segment, ...] | list[Segment],
    isolation: Isolation,
    virtual_gap: int = 0,
    recompute: bool = True,
) -> tuple[dict[int, range], dict[int, int], int]:
    """What the connector's defaults do with a prompt's chunks (``relevant_last``: at most
    three BM25 ranks highest attended last, and recomputed there, whole when short, a longer
    one in part with ``relevant_span_tokens``, where the workers can (``recompute``: not
    under tensor parallelism)): segment
    index -> the offsets recomputed in it, segment index -> positions how far each chunk
    moves, and how many first
    tokens of every other chunk are recomputed with them (``relevant_first_tokens``, where
    chunks are), computed by the connector's own selection for the HF reference of a
    served prompt."""
    from chunkstore_vllm.config import ConnectorConfig
    from chunkstore_vllm.selection import relevant

    first_is_causal = isolation is Isolation.SYS and not virtual_gap
    defaults = ConnectorConfig()
    recomputed, shifts, _ = relevant(
        segments,
        defaults.relevant_last,
        defaults.relevant_recompute_tokens if recompute else 0,
        first_is_causal=first_is_causal,
        min_score=defaults.relevant_min_score,
        span_tokens=defaults.relevant_span_tokens,
    )
    return recomputed, shifts, defaults.relevant_first_tokens if recomputed else 0


def default_reference(
    ref: HFReference,
    segments: tuple[Segment, ...] | list[Segment],
    isolation: Isolation,
    virtual_gap: int = 0,
    recompute: bool = True,
) -> Forward:
    """The HF reference of a prompt the connector serves with its defaults: the assembled
    cache with the chunks ``default_treatment`` moves attended where it moves them (the
    prompt with them put last), those it recomputes blended there (and every other chunk's
    first tokens), the question on top. The KV is returned in the served prompt's order,
    each chunk's keys rotated to where it is attended, as the connector's cache holds it."""
    recomputed, shifts, first = default_treatment(segments, isolation, virtual_gap, recompute)
    if not recomputed:
        return ref.assembled_cache(segments, isolation, virtual_gap=virtual_gap, shifts=shifts)
    return blended_where_attended(ref, segments, isolation, shifts, recomputed, first, virtual_gap)


def blended_where_attended(
    ref: HFReference,
    segments: tuple[Segment, ...] | list[Segment],
    isolation: Isolation,
    shifts: dict[int, int],
    recomputed: Sequence[int] | Mapping[int, range],
    first_tokens: int,
    virtual_gap: int = 0,
) -> Forward:
    """The HF reference of chunks attended ``shifts`` (segment index -> positions) from
    where they stand, the ``recomputed`` ones (segment indices, or segment index -> offsets)
    blended there with every
    other chunk's first ``first_tokens``: ``HFReference.blended_cache`` of the prompt as
    attended (``reordered``), its KV returned in the served prompt's order (each chunk's
    keys rotated to where it is attended), as the connector's cache holds it."""
    attended, order = reordered(segments, shifts)
    if not isinstance(recomputed, Mapping):
        recomputed = {i: range(len(segments[i])) for i in recomputed}
    blended = ref.blended_cache(
        attended,
        isolation,
        first_tokens,
        virtual_gap,
        recompute_chunks={order.index(i): r for i, r in recomputed.items()},
    )
    # Position p of the served prompt is attended at p + its chunk's shift.
    at = [p + shifts.get(i, 0) for i, seg in enumerate(segments) for p in range(seg.start, seg.end)]
    at += range(len(at), blended.kv.num_tokens)  # what the question's forward added
    index = torch.tensor(at)
    kv = type(blended.kv)(blended.kv.keys[:, index], blended.kv.values[:, index])
    return type(blended)(blended.logits, kv)


def reordered(
    segments: tuple[Segment, ...] | list[Segment], shifts: dict[int, int]
) -> tuple[list[Segment], list[int]]:
    """The prompt as the connector attends it where chunks move (segment index -> shift):
    each segment at its start plus its shift, in that order; and the served segment index
    of each."""
    order = sorted(range(len(segments)), key=lambda i: segments[i].start + shifts.get(i, 0))
    moved = [
        Segment(segments[i].kind, segments[i].start + shifts.get(i, 0), segments[i].token_ids)
        for i in order
    ]
    return moved, order


def assert_logprobs_match(served: dict[str, Any], logits: torch.Tensor) -> float:
    """The served first token is the reference's argmax, and its top-20 logprobs are the
    reference's within TOLERANCE; returns the worst difference."""
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert served["token"] == int(reference.argmax())
    assert len(served["logprobs"]) >= 20
    worst = max(abs(lp - float(reference[int(t)])) for t, lp in served["logprobs"].items())
    assert worst <= TOLERANCE, worst
    return worst


def first_token(choice: Any) -> dict[str, Any]:
    """The first generated token and its top logprobs from a choice of an ``openai`` reply
    (chat or completions, asked with ``return_tokens_as_token_ids``), in the form
    ``assert_logprobs_match`` takes."""

    def token_id(text: str) -> int:
        return int(text.removeprefix("token_id:"))

    logprobs = choice.logprobs
    if getattr(logprobs, "content", None):  # chat
        first = logprobs.content[0]
        top = {token_id(t.token): t.logprob for t in first.top_logprobs}
        return {"token": token_id(first.token), "logprobs": top}
    top = {token_id(t): lp for t, lp in logprobs.top_logprobs[0].items()}
    return {"token": token_id(logprobs.tokens[0]), "logprobs": top}


def assert_same_answer(a: dict[str, Any], b: dict[str, Any], tolerance: float = TOLERANCE) -> None:
    """The same generated tokens, and first-token logprobs within ``tolerance``."""
    assert a["generated"] == b["generated"]
    for token, logprob in b["logprobs"].items():
        assert abs(a["logprobs"][token] - logprob) <= tolerance, (token, a, b)
