"""``chunkstore bench e2e --slope COUNTS``: full hits of 1..N stored chunks, TTFT fitted to
the tokens loaded (the cost of a loaded token), against vLLM's own floor (e2e.py says more)."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.processes.vllm_probe import run_probe

from .e2e_shapes import QUESTIONS, SYS, bench_daemon, documents, prompt_of, scaled


def fit(
    rows: list[dict[str, Any]], repeats: int
) -> tuple[list[float], list[float], float | None, float | None]:
    """Medians per group of ``repeats`` rows (tokens reused, TTFT) and the line through them:
    slope in seconds per token, intercept in seconds (None if every group reused as much)."""
    groups = [rows[i : i + repeats] for i in range(0, len(rows), repeats)]
    x = [statistics.median(r["cached_tokens"] for r in group) for group in groups]
    y = [statistics.median(r["seconds"] for r in group) for group in groups]
    if len(set(x)) < 2:
        return x, y, None, None
    slope, intercept = statistics.linear_regression(x, y)
    return x, y, slope, intercept


def run_slope(args: argparse.Namespace, model: Path, encode: Any, sep: list[int]) -> dict[str, Any]:
    """Full hits of 1..N stored chunks in one vLLM: TTFT against the tokens loaded, fitted
    to a line (least squares): its slope is what each loaded token costs. The floor, in
    the same run: vLLM alone (no connector) answering the same prompts after a prefix-cache
    hit on their context (primed by the same context under another question), fitted the
    same way: what the question's own forward costs per token of context it attends to."""
    p = _slope_prompts(args, encode, sep)
    rows, floor_rows = _runs(args, model, p)
    lengths = p.lengths
    loaded = [r["cached_tokens"] for r in rows]
    if any(n < length - 32 for n, length in zip(loaded, lengths, strict=True)):
        raise RuntimeError(f"not every prompt was a full hit: {loaded} of {lengths} tokens")
    x, y, slope, intercept = fit(rows, args.repeats)
    floor_x, floor_y, floor_slope, floor_intercept = fit(floor_rows, args.repeats)
    assert slope is not None  # distinct counts load distinct token counts
    return {
        "bench": "e2e.slope",
        "model": model.name,
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "load_threads": args.load_threads,
        "load_cpus": args.load_cpus,
        "loaded_tokens": [int(t) for t in x],
        "ttft_s": [round(t, 4) for t in y],
        "us_per_loaded_token": scaled(slope),
        "fixed_ms": scaled(intercept, 1e3, 1),
        "floor_cached_tokens": [int(t) for t in floor_x],
        "floor_ttft_s": [round(t, 4) for t in floor_y],
        "floor_us_per_token": scaled(floor_slope),
        "floor_fixed_ms": scaled(floor_intercept, 1e3, 1),
        "slope_vs_floor": None if not floor_slope else round(slope / floor_slope, 2),
    }


@dataclass(frozen=True)
class _SlopePrompts:
    warmup: list[int]
    ingest: list[list[int]]  # each document after sys, stored before the hits
    measured: list[list[int]]  # per chunk count, --repeats prompts of that many chunks
    primers: list[list[int]]  # each measured prompt's context under another question
    lengths: list[int]  # the measured prompts'


def _slope_prompts(args: argparse.Namespace, encode: Any, sep: list[int]) -> _SlopePrompts:
    """Per chunk count, ``--repeats`` prompts of that many stored chunks in a shuffled
    order, each with a primer of the same context under another question."""
    counts = [int(c) for c in args.slope.split(",")]
    if len(set(counts)) < 2:
        raise ValueError(f"--slope needs two chunk counts or more, not {args.slope!r}")
    sys_ids = encode(SYS)
    docs = documents(encode, max(counts), args.chunk_tokens, sep, seed=1)
    rng = random.Random(0)
    measured, primers, lengths = [], [], []
    for count in counts:
        for i in range(args.repeats):
            order = docs[:count]
            rng.shuffle(order)
            measured.append(prompt_of(sys_ids, order, encode(QUESTIONS[i % len(QUESTIONS)]), sep))
            primers.append(
                prompt_of(sys_ids, order, encode(QUESTIONS[(i + 1) % len(QUESTIONS)]), sep)
            )
            lengths.append(len(measured[-1]))
    ingest = [sys_ids + sep + doc + sep for doc in docs]
    warmup = encode("Hello, how are you today?")
    return _SlopePrompts(warmup, ingest, measured, primers, lengths)


def _runs(
    args: argparse.Namespace, model: Path, p: _SlopePrompts
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The measured prompts' rows as full hits through the connector (every chunk ingested
    first), and the floor's: vLLM alone, each after its primer."""
    ingest, measured, warmup = p.ingest, p.measured, p.warmup
    max_len = max(4096, 1 << (max(p.lengths) + 64).bit_length())
    with tempfile.TemporaryDirectory(prefix="chunkstore-e2e-") as tmp:
        work = Path(tmp)
        with bench_daemon(work, 3 << 30) as daemon:
            rows = run_probe(
                model,
                [warmup, *ingest, *measured],
                work / "slope",
                {
                    "address": daemon.unix,
                    "load_threads": args.load_threads,
                    "load_cpus": args.load_cpus,
                },
                max_model_len=max_len,
            )[1 + len(ingest) :]
        paired = [q for pair in zip(p.primers, measured, strict=True) for q in pair]
        floor_rows = run_probe(
            model,
            [warmup, *paired],
            work / "floor",
            max_model_len=max_len,
            extra=("--prefix-caching",),
        )[2::2]
    return rows, floor_rows
