"""Chunked prompts for the connector's end-to-end tests and benches, and the checks their
answers must pass against the HF reference or another vLLM run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chunkstore.kv.segments import ChunkedPrompt, build_chunked_prompt
from chunkstore.prompts import AUTO, separator_ids

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
