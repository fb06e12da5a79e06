"""The command line of ``chunkstore bench quality``: the cases it asks and the methods it
runs them with."""

from __future__ import annotations

import argparse

from chunkstore.bench import qa_cases
from chunkstore.bench.quality_methods import DEFAULT_METHODS, KNOBS, parse_methods
from chunkstore.bench.quality_prompts import AUTO, PROMPT_FORMATS


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--doc-tokens wants lengths like 50,200: {text!r}")
    return lengths


def _splits(text: str) -> list[str]:
    splits = text.split(",")
    wrong = [s for s in splits if s not in qa_cases.SPLITS]
    if wrong:
        raise argparse.ArgumentTypeError(
            f"unknown split {wrong}: use {' or '.join(qa_cases.SPLITS)}, comma-separated"
        )
    return splits


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the cases it is asked: how many, how long, which split and seed."""
    parser.add_argument(
        "--model",
        default="qwen2.5-0.5b",
        help="a model of `chunkstore models` (qwen2.5-0.5b, qwen2.5-1.5b, gemma3-270m: a base "
        "model, asked in completion prompts; smollm2 and tiny for speed, not for quality) or a "
        "model folder (default qwen2.5-0.5b)",
    )
    parser.add_argument("--cases", type=int, default=60, help="QA cases, a third of each kind (60)")
    parser.add_argument(
        "--prose",
        action="store_true",
        help="documents of real prose (Debian's license texts) around their facts, instead of "
        "templated sentences; --filler 16 makes them ~500 tokens",
    )
    parser.add_argument(
        "--docs", type=int, default=8, help="documents per case (8, as the TTFT prompt)"
    )
    parser.add_argument(
        "--filler",
        type=int,
        default=2,
        help="sentences that answer nothing per document, beside its two facts (2: documents "
        "of ~38 tokens; 48: ~500, the TTFT prompt's chunk length; with --prose, 16: ~500)",
    )
    parser.add_argument(
        "--doc-tokens",
        type=_lengths,
        default=None,
        help="comma-separated document lengths in tokens, e.g. 50,100,200,300,500: the cases "
        "of each length are run in turn (the filler sentences each takes, --filler ignored; "
        "with --prose, the lengths RAG retrieves)",
    )
    parser.add_argument(
        "--split",
        type=_splits,
        default=[qa_cases.TUNE],
        help="comma-separated: tune (the cases settings were chosen on) and/or heldout "
        "(other people, filler sentences and seeds, never tuned on); default tune",
    )
    parser.add_argument("--seed", type=int, default=0, help="the cases' seed (0)")
    parser.add_argument("--max-tokens", type=int, default=24, help="answer tokens (24)")


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """The methods the cases are answered with, how they are written, and the TTFT repeats."""
    parser.add_argument(
        "--methods",
        type=parse_methods,
        default=",".join(DEFAULT_METHODS),
        help="comma-separated: full (vLLM alone), isolated (chunks isolated), default (the "
        "connector's defaults), router (through a router process: --router), or connector "
        "settings KNOB=VALUE joined by '+' "
        f"(KNOB: {', '.join(KNOBS)}; request=N: the request's kv_transfer_params name an "
        "oracle ranking's first N chunks; scores=oracle: they give that ranking as "
        "chunk_scores; order=relevant: prompts sent with their relevant documents last, as "
        "the router sends them, so inband_isolation=0+order=relevant is what a CUDA or "
        "Ascend back end answers behind it); default: the curve of each knob",
    )
    parser.add_argument(
        "--router",
        action="store_true",
        help="add the method router: the cases through a real `chunkstore router` before "
        "`vllm serve` with the hook off (a CUDA / Ascend back end), over an empty daemon, "
        "each asked twice (cold, then warm)",
    )
    parser.add_argument(
        "--prompt-format",
        choices=PROMPT_FORMATS,
        default=AUTO,
        help="how a case is written: chatml (a chat turn, SmolLM2's and Qwen's template), "
        "completion (a base model's: the documents, then 'Question: ...' and 'Answer:'; the "
        "answer scored is the reply's first line); auto (the default): chatml for a model "
        "whose chat template is ChatML, completion for one without a chat template (e.g. "
        "gemma3-270m), an error for another template. The tokenizer's <bos> goes first "
        "where it adds one",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="TTFT: the first N cases asked again, their documents reversed (3)",
    )
