"""Chunked prompts for the connector's end-to-end tests and benches, and the checks their
answers must pass against the HF reference or another vLLM run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chunkstore.kv.segments import ChunkedPrompt, build_chunked_prompt

SYS = "You are a careful assistant. Answer only from the documents below."
OTHER_SYS = "You are a poet. Answer in rhyme."
DOCS = [
    "The Eiffel Tower stands in Paris, the capital of France. It was finished in 1889.",
    "Berlin is the capital of Germany. The river Spree flows through the city centre.",
    "Mount Everest, on the border of Nepal and China, is the highest mountain on Earth.",
]
QUESTIONS = ["Which city is the Eiffel Tower in?", "What is the highest mountain on Earth?"]
TOLERANCE = 1e-3  # on first-token logprobs, against the fp32 reference


class Scenario:
    """A model's tokenizer and the ``##`` separator, to build chunked prompts with."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoTokenizer

        self.model = model
        self.tok = AutoTokenizer.from_pretrained(model)
        self.sep = self.encode("##")

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


def assert_same_answer(a: dict[str, Any], b: dict[str, Any], tolerance: float = TOLERANCE) -> None:
    """The same generated tokens, and first-token logprobs within ``tolerance``."""
    assert a["generated"] == b["generated"]
    for token, logprob in b["logprobs"].items():
        assert abs(a["logprobs"][token] - logprob) <= tolerance, (token, a, b)
