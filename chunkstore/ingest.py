"""Pre-warm a corpus: have vLLM (with the connector) compute each chunk once under a sys
prompt, so later RAG prompts load it instead of computing it.

Each chunk goes to vLLM as an ingest prompt, ``sys SEP chunk SEP`` (``chunk SEP`` in
``isolation: none``, where a chunk sees nothing but itself); the connector stores what vLLM
computed. Chunks already in the store are skipped; after sending, the store is asked again,
so the summary counts what really got stored.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import SegmentationError
from chunkstore.kv.fingerprint import ModelFingerprint
from chunkstore.kv.keys import Isolation, segment_keys
from chunkstore.kv.segments import Segment, build_chunked_prompt


class Backend(Protocol):
    def prefill(self, prompts: list[list[int]]) -> None:
        """Run the prompts through vLLM (one generated token each)."""


class ServerBackend:
    """A running ``vllm serve`` with the connector: its OpenAI-compatible completions API."""

    def __init__(self, url: str, model: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout = timeout

    def prefill(self, prompts: list[list[int]]) -> None:
        body = json.dumps(
            {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0}
        ).encode()
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            response.read()


class LLMBackend:
    """An in-process ``vllm.LLM`` built with the connector."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def prefill(self, prompts: list[list[int]]) -> None:
        from vllm import SamplingParams

        batch: Any = [{"prompt_token_ids": p} for p in prompts]
        self.llm.generate(batch, SamplingParams(max_tokens=1), use_tqdm=False)


@dataclass
class IngestSummary:
    chunks: int = 0
    tokens: int = 0
    stored: int = 0
    already_present: int = 0
    failed: int = 0


def ingest(
    backend: Backend,
    client: ChunkStoreClient,
    model: ModelFingerprint,
    encode: Callable[[str], Sequence[int]],
    sys_text: str,
    chunks: Sequence[str],
    separator: Sequence[int],
    isolation: Isolation = Isolation.SYS,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    virtual_gap: int = 0,
) -> IngestSummary:
    """``isolation`` and ``virtual_gap`` as the connector is configured: they are part of
    the keys the chunks are stored under."""
    sep = list(separator)

    def keys(segments: Sequence[Segment]) -> list[bytes | None]:
        return segment_keys(segments, model.model_fp, model.layout_fp, isolation, virtual_gap)

    sys_prompt = build_chunked_prompt(encode, sys_text, [], None, sep)
    [sys_key] = keys(sys_prompt.segments)
    work: list[tuple[bytes, list[int]]] = []  # chunk key, ingest prompt
    summary = IngestSummary(chunks=len(chunks))
    for text in chunks:
        try:
            if isolation is Isolation.SYS:  # sys SEP chunk SEP: the chunk right after sys
                prompt = build_chunked_prompt(encode, sys_text, [text], None, sep)
            else:  # chunk SEP: a chunk that sees nothing but itself
                prompt = build_chunked_prompt(encode, text, [], None, sep)
        except SegmentationError:
            summary.failed += 1  # would split in the wrong place: never ingested
            continue
        key = keys(prompt.segments)[-1]
        assert key is not None
        work.append((key, list(prompt.token_ids)))
        summary.tokens += len(prompt.segments[-1])
    present = _present(client, [k for k, _ in work])
    todo = [w for w, p in zip(work, present, strict=True) if not p]
    summary.already_present = len(work) - len(todo)
    assert sys_key is not None
    if isolation is Isolation.NONE and not _present(client, [sys_key])[0]:
        backend.prefill([list(sys_prompt.token_ids)])  # sys alone is an entry there too
    for start in range(0, len(todo), batch_size):
        backend.prefill([p for _, p in todo[start : start + batch_size]])
        if progress:
            progress(min(start + batch_size, len(todo)), len(todo))
    stored = _present(client, [k for k, _ in todo])
    summary.stored = sum(stored)
    summary.failed += len(todo) - summary.stored
    return summary


def _present(client: ChunkStoreClient, keys: list[bytes]) -> list[bool]:
    found: list[bool] = []
    for start in range(0, len(keys), 4096):
        found += [n is not None for n in client.lookup(keys[start : start + 4096])]
    return found


def read_corpus(path: str) -> list[str]:
    """One chunk per line: plain text, or JSON lines with a "text" field (or a JSON string)."""
    chunks = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith(("{", '"')):
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{number}: not JSON: {err}") from None
                text = value.get("text") if isinstance(value, dict) else value
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: no text")
                chunks.append(text)
            else:
                chunks.append(line)
    return chunks


def print_progress(done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\ringest [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()
