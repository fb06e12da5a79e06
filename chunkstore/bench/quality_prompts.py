"""The prompts of ``chunkstore bench quality``: a case written for a model (``PromptFormat``:
a ChatML chat turn or a base model's completion), the cases of a document length, and the
prompts each method sends (``Prompts``: in the router's order where it asks for it)."""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import dataclass
from typing import Any

import xxhash

from chunkstore.bench import qa_cases
from chunkstore.bench.quality_methods import (
    ORACLE,
    ORDER,
    RELEVANT,
    REQUEST,
    SCORES,
    connector_settings,
    oracle_ranking,
    probe_entry,
    transfer_params,
)
from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.keys import length_prefixed
from chunkstore.kv.segments import (
    build_chunked_prompt,
    chunk_places,
    reordered_ids,
    split_prompt,
)

# A chat prompt (ChatML): the documents are the user's message, the question closes it.
SYS_TEXT = "<|im_start|>system\n" + qa_cases.SYS + "<|im_end|>\n<|im_start|>user\nDocuments:\n"
QUESTION_TEXT = "\nQuestion: {}<|im_end|>\n<|im_start|>assistant\n"
# A completion prompt, for a base model (no chat template): the answer follows "Answer:".
COMPLETION_SYS_TEXT = qa_cases.SYS + "\n\nDocuments:\n"
COMPLETION_QUESTION_TEXT = "\nQuestion: {}\nAnswer:"
CHATML, COMPLETION, AUTO = "chatml", "completion", "auto"
PROMPT_FORMATS = (AUTO, CHATML, COMPLETION)
# The separator of docs/benchmarks.md's table (Answer quality), from before "auto" was the default.
SEPARATOR = "##"


def cases_digest(tok: Any, cases: list[qa_cases.Case], fmt: PromptFormat | None = None) -> str:
    """What two runs must share for their ``per_case`` to compare: the cases' prompts as the
    model reads them (xxh3-64 over their token IDs; a prompt format other than ChatML's and
    its first tokens too). The prose comes from the machine's license texts, so another
    machine's base-files could draw other documents at one seed."""
    h = xxhash.xxh3_64()
    if fmt is not None and (fmt.name != CHATML or fmt.prefix):
        h.update(length_prefixed(f"{fmt.name}:{list(fmt.prefix)}".encode()))
    for case in cases:
        for text in (*case.documents, case.question, *case.answers):
            h.update(length_prefixed(",".join(map(str, encode(tok, text))).encode()))
    return h.hexdigest()


def cases_of_length(
    args: argparse.Namespace, tok: Any, doc_tokens: int | None, split: str
) -> tuple[list[qa_cases.Case], float]:
    """``args.cases`` generated cases (``--docs``, ``--prose``, ``--seed``) whose documents
    are ``doc_tokens`` long in ``tok`` (``--filler`` sentences where None), and that mean."""
    filler = args.filler if doc_tokens is None else qa_cases.filler_for(doc_tokens, args.prose)
    for _ in range(4):  # --doc-tokens: the filler that length takes in this tokenizer
        cases = qa_cases.generate(
            args.cases,
            seed=args.seed,
            docs_per_case=args.docs,
            filler=filler,
            prose=args.prose,
            split=split,
        )
        mean_doc = statistics.mean(len(encode(tok, d)) for c in cases for d in c.documents)
        if doc_tokens is None:
            break
        per_sentence = max(1.0, (mean_doc - qa_cases.FACT_TOKENS) / filler)
        better = max(1, round((doc_tokens - qa_cases.FACT_TOKENS) / per_sentence))
        if better == filler:
            break
        filler = better
    return cases, mean_doc


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class PromptFormat:
    """How a case becomes a prompt for a model, and which part of its reply is the answer."""

    name: str  # CHATML or COMPLETION
    sys_text: str
    question_text: str  # "{}": the question
    # The IDs the tokenizer puts before a text (Gemma's <bos>: without it Gemma writes
    # nonsense), which the segments, tokenized without special tokens, lack.
    prefix: tuple[int, ...]

    def answer(self, generated: str) -> str:
        """The answer in a reply: a chat model's whole turn; a base model's first line (it
        goes on with questions and answers of its own, which may name other cases' facts)."""
        if self.name == CHATML:
            return generated
        return generated.lstrip().split("\n", 1)[0]


def prompt_format(tok: Any, name: str = AUTO) -> PromptFormat:
    """``--prompt-format``: ``auto`` is ChatML for a model whose chat template is ChatML
    (SmolLM2, Qwen2.5), a completion prompt for one without a chat template (a base model:
    Gemma 3 270M, the random test models); a ValueError for another chat template, which
    the bench does not write."""
    template = getattr(tok, "chat_template", None)
    if name == AUTO:
        if template is None:
            name = COMPLETION
        elif isinstance(template, str) and "<|im_start|>" in template:
            name = CHATML
        else:
            raise ValueError(
                "the model's chat template is not ChatML, and bench quality writes ChatML or "
                "completion prompts only: pass --prompt-format completion (or chatml)"
            )
    probe = encode(tok, "a")
    with_special = list(tok.encode("a", add_special_tokens=True))
    at = next((i for i in range(len(with_special)) if with_special[i : i + len(probe)] == probe), 0)
    prefix = tuple(int(t) for t in with_special[:at])
    if name == CHATML:
        return PromptFormat(CHATML, SYS_TEXT, QUESTION_TEXT, prefix)
    if name == COMPLETION:
        return PromptFormat(COMPLETION, COMPLETION_SYS_TEXT, COMPLETION_QUESTION_TEXT, prefix)
    raise ValueError(f"unknown prompt format {name!r}: use {', '.join(PROMPT_FORMATS)}")


@dataclass(frozen=True)
class Prompts:
    """The cases' prompts and their oracle rankings: ``qa`` asked for answers, ``timed`` the
    first cases again with their documents reversed (stored by then, in a new order: TTFT)."""

    qa: list[list[int]]
    qa_rankings: list[list[int]]
    timed: list[list[int]]
    timed_rankings: list[list[int]]

    def entries(self, settings: dict[str, Any] | None, max_tokens: int) -> list[Any]:
        """The probe's prompts for a method (``_entry``): the QA ones, then the timed ones."""
        requested = (settings or {}).get(REQUEST, 0)
        scores = (settings or {}).get(SCORES) == ORACLE
        qa = zip(self.qa, self.qa_rankings, strict=True)
        timed = zip(self.timed, self.timed_rankings, strict=True)
        return [
            *(probe_entry(p, max_tokens, r, requested, scores) for p, r in qa),
            *(probe_entry(p, None, r, requested, scores) for p, r in timed),
        ]

    def ordered(self, settings: dict[str, Any] | None, sep: list[int]) -> Prompts:
        """The prompts a method sends: with ``order=relevant`` each with its relevant
        documents last, as the router sends them (their rankings renamed with them)."""
        if not settings or settings.get(ORDER) != RELEVANT:
            return self
        policy = ConnectorConfig.from_extra(connector_settings(settings)).policy
        scores = settings.get(SCORES) == ORACLE

        def one(prompt: list[int], ranking: list[int]) -> tuple[list[int], list[int]]:
            segments = split_prompt(prompt, sep)
            params = transfer_params(ranking, 0, scores)
            order = policy.order(segments, params)
            if order is None:
                return prompt, ranking
            place = chunk_places(order)
            return reordered_ids(segments, order), [place[c] for c in ranking]

        qa = [one(p, r) for p, r in zip(self.qa, self.qa_rankings, strict=True)]
        timed = [one(p, r) for p, r in zip(self.timed, self.timed_rankings, strict=True)]
        return Prompts(
            [p for p, _ in qa], [r for _, r in qa], [p for p, _ in timed], [r for _, r in timed]
        )

    def pool_bytes(self, token_bytes: int, segments: int, block: int) -> int:
        """A pool that holds every segment these prompts can store whole (a prompt's
        ``segments`` each in its own ``block``-rounded entry; ``token_bytes`` of KV a token),
        a quarter more for slack, from 256 MiB to 4 GiB: a tiny model's run needs no 4 GiB of
        shared memory or disk."""
        prompts = [*self.qa, *self.timed]
        need = sum(len(p) * token_bytes + segments * block for p in prompts)
        return min(4 << 30, max(256 << 20, -(-need * 5 // 4 // block) * block))


def build_prompts(
    tok: Any, sep: list[int], cases: list[qa_cases.Case], repeats: int, fmt: PromptFormat
) -> Prompts:
    def prompt(documents: list[str], question: str) -> list[int]:
        text = fmt.question_text.format(question)
        tokens = functools.partial(encode, tok)
        built = build_chunked_prompt(tokens, fmt.sys_text, documents, text, sep, fmt.prefix)
        return list(built.token_ids)

    rankings = [oracle_ranking(c.relevant, len(c.documents)) for c in cases]
    timed_cases = cases[:repeats]
    return Prompts(
        [prompt(list(c.documents), c.question) for c in cases],
        rankings,
        [prompt(list(reversed(c.documents)), c.question) for c in timed_cases],
        [
            [len(c.documents) - 1 - i for i in ranking]
            for c, ranking in zip(timed_cases, rankings, strict=False)
        ],
    )
