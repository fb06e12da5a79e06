"""Pre-warm a corpus: have vLLM (with the connector) compute each chunk once under a sys
prompt, so later RAG prompts load it instead of computing it.

Each chunk goes to vLLM as an ingest prompt, ``sys SEP chunk SEP`` built in the shape the
app sends (text, or chat messages rendered by the model's template: ``chunkstore.prompts``),
or ``chunk SEP`` in ``isolation: none``, where a chunk sees nothing but itself; the connector
stores what vLLM computed. Chunks already in the store are skipped; after sending, the store
is asked again, so the summary counts what really got stored.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import split_prompt
from chunkstore.prompts import RagPrompts


class Backend(Protocol):
    def prefill(self, prompts: list[list[int]], cache_salt: str = "") -> None:
        """Run the prompts through vLLM (one generated token each), with ``cache_salt``."""


class ServerBackend:
    """A running ``vllm serve`` with the connector: its OpenAI-compatible completions API."""

    def __init__(self, url: str, model: str, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.timeout = timeout

    def prefill(self, prompts: list[list[int]], cache_salt: str = "") -> None:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompts,
                "max_tokens": 1,
                "temperature": 0.0,
                **({"cache_salt": cache_salt} if cache_salt else {}),
            }
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

    def prefill(self, prompts: list[list[int]], cache_salt: str = "") -> None:
        from vllm import SamplingParams

        salted = {"cache_salt": cache_salt} if cache_salt else {}
        batch: Any = [{"prompt_token_ids": p, **salted} for p in prompts]
        self.llm.generate(batch, SamplingParams(max_tokens=1), use_tqdm=False)


@dataclass
class IngestSummary:
    chunks: int = 0
    tokens: int = 0
    stored: int = 0
    already_present: int = 0
    failed: int = 0


@dataclass
class Refused:
    """A document ingest did not send: it does not tokenize stably beside the separator."""

    index: int
    why: str


def ingest(
    backend: Backend,
    client: ChunkStoreClient,
    prompts: RagPrompts,
    chunks: Sequence[str],
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    refused: Callable[[Refused], None] | None = None,
) -> IngestSummary:
    """Store each chunk as ``prompts`` builds it (shape, separator, sys, isolation, gap and
    cache salt as the connector and the app see them: they make the keys). A chunk whose
    tokens would differ in a request (``RagPrompts.check``) is not sent: it counts as failed
    and ``refused`` hears why."""
    work: list[tuple[bytes, list[int]]] = []  # chunk key, ingest prompt
    summary = IngestSummary(chunks=len(chunks))
    for index, text in enumerate(chunks):
        why = prompts.check(text)
        found = None if why else prompts.ingest_prompt(text)
        if found is None:
            summary.failed += 1
            if refused:
                refused(Refused(index, why or "it does not segment as one chunk"))
            continue
        ids, segment, key = found
        work.append((key, ids))
        summary.tokens += len(segment)
    present = _present(client, [k for k, _ in work])
    todo = [w for w, p in zip(work, present, strict=True) if not p]
    summary.already_present = len(work) - len(todo)
    if prompts.isolation is Isolation.NONE:  # sys alone is an entry there too
        sys_ids = prompts.sys_prompt()
        sys_key = prompts.keys(split_prompt(sys_ids, prompts.sep_ids))[0]
        if sys_key is not None and not _present(client, [sys_key])[0]:
            backend.prefill([sys_ids], prompts.cache_salt)
    for start in range(0, len(todo), batch_size):
        backend.prefill([p for _, p in todo[start : start + batch_size]], prompts.cache_salt)
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
