"""``bench workload``'s trace: a corpus of generated documents and requests that retrieve
``k`` of them by Zipf popularity, arriving by Poisson (``make_trace``); each request as the
connector's chunked prompt (``prompt_text``), and the whole as a dataset ``vllm bench serve``
replays (``write_dataset``)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from chunkstore.models import WORDS

SYS = "You are a helpful assistant. Answer the question using only the documents below."
QUESTION = "Question {n}: which of these documents says the most about {word}?"


@dataclass(frozen=True)
class Request:
    docs: tuple[int, ...]  # corpus indices, in the order the retriever returned them
    question: str
    at: float  # seconds after the start (Poisson arrivals; 0 for all under a concurrency)


@dataclass(frozen=True)
class Trace:
    docs: list[str]
    requests: list[Request]


def make_trace(
    docs: int,
    doc_words: tuple[int, int],
    requests: int,
    k: int,
    skew: float,
    rate: float,
    seed: int = 0,
) -> Trace:
    """The corpus (texts of ``doc_words`` words, a range) and the requests: ``k`` distinct
    documents each, drawn with Zipf weights 1 / rank^``skew`` (the popular ones shuffled
    through the corpus), shuffled; Poisson arrivals at ``rate`` (0: all at once)."""
    rng = random.Random(seed)
    corpus = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(*doc_words))).capitalize() + "."
        for _ in range(docs)
    ]
    popularity = list(range(docs))
    rng.shuffle(popularity)
    weights = [0.0] * docs
    for rank, doc in enumerate(popularity, start=1):
        weights[doc] = 1.0 / rank**skew
    out, at = [], 0.0
    for n in range(requests):
        chosen: list[int] = []
        while len(chosen) < k:
            doc = rng.choices(range(docs), weights)[0]
            if doc not in chosen:
                chosen.append(doc)
        if rate:
            at += rng.expovariate(rate)
        out.append(Request(tuple(chosen), QUESTION.format(n=n, word=rng.choice(WORDS)), at))
    return Trace(corpus, out)


def prompt_text(trace: Trace, request: Request, separator: str) -> str:
    """``sys SEP doc SEP doc ... SEP question``: the connector's chunked prompt, as text."""
    parts = [SYS, *(trace.docs[d] for d in request.docs), request.question]
    return separator.join(parts)


def write_dataset(path: Path, prompts: list[str], output_tokens: int) -> None:
    """The trace as ``vllm bench serve --dataset-name custom --dataset-path PATH`` reads it
    (one JSON object a line: prompt, output_tokens); replay it with --disable-shuffle to
    keep the trace's order."""
    with path.open("w") as out:
        for prompt in prompts:
            out.write(json.dumps({"prompt": prompt, "output_tokens": output_tokens}) + "\n")
