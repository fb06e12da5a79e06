"""The worker's load and save paths on the device, without vLLM (issue 76): the code vLLM's
workers run (``chunkstore_vllm.loads.Loads``, ``saves.Saves``, the cache access they write
through) against a real daemon whose pool is on the device, into a paged cache in vLLM's
flash layout (``PackedLayout``, [blocks, heads, block_size, K + V]) on the accelerator; on
Ascend its pair of caches (``SplitLayout``) through torch_npu's own write.

The GPU machine has no vLLM, so what the worker gets from vLLM is restated here: the
metadata its connector hands it each step (``ChunkStoreMetadata``, as the scheduler side
builds it), its layers by name, and vLLM's CUDA write op ``reshape_and_cache_flash``
(``flash_reshape_and_cache``: vllm 0.32 flash_attn.py ``do_kv_cache_update``, the
[B, H, N, 2D] view split as ``kv_cache.transpose(1, 2).split(head_size, -1)``, key[t] to
key_cache[slot // N, slot % N]), which the cache's start-up probe writes through.

Checked against the CPU in fp32, as tests/device checks the KV math: the cache after a
load holds the entry's keys rotated from where they were computed to where they stand
(within ``tolerance``) and its values as stored (exact); attention of random queries over
the loaded cache, on the device, is the attention over the reference KV on the CPU; a
computed chunk written into the cache and saved is stored byte for byte. With
``CHUNKSTORE_TEST_DEVICE=cpu`` (CI, ``tests/test_device_check.py``) the same runs on the CPU
with the fake device pool."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.attention import partial_attention
from chunkstore.kv.cache_layouts import PackedLayout, SplitLayout
from chunkstore.kv.fingerprint import ModelFingerprint
from chunkstore.kv.keys import KVLayout
from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore.testing.device_check import FORBIDDEN_IMPORTS
from chunkstore.testing.devices import tolerance
from chunkstore.testing.entries import entry_key, random_kv
from chunkstore_vllm.client_holder import DaemonLink
from chunkstore_vllm.common import ChunkStoreMetadata, LoadItem, RequestPlan, SaveItem
from chunkstore_vllm.device_layout import DeviceKVLayout, ascend_write
from chunkstore_vllm.heads import RankHeads
from chunkstore_vllm.keys import ModelKeys
from chunkstore_vllm.loads import Loads
from chunkstore_vllm.metrics import ConnectorStats
from chunkstore_vllm.registered_cache import RegisteredCache
from chunkstore_vllm.saves import Saves

BLOCK, BLOCKS, HEADS, DIM, LAYERS = 16, 12, 2, 64, 2
ROTARY = RotaryConfig(DIM, DIM, 10000.0)
TOKENS, STORED_AT, START = 70, 5, 37  # computed at 5, loaded at 37: rotated by 32
TABLE = [7, 2, 9, 4, 11, 1, 5, 3]  # the request's blocks, in no order (block 0: vLLM's null)
POOL_DEVICE = {"cpu": "fake", "cuda": "cuda", "npu": "npu"}


@pytest.mark.skipif(
    any(importlib.util.find_spec(name) for name in FORBIDDEN_IMPORTS),
    reason="where vLLM, transformers or Redis is installed, the connector uses what is there",
)
def test_the_workers_device_path_imports_no_vllm() -> None:
    """What the workers run on the device (the cache access, loads, saves) imports none of
    vLLM, transformers and Redis, which the GPU machine does not have (the device check's
    ``imports`` part checks chunkstore's side); in a fresh interpreter, as that part does."""
    code = (
        "import sys, chunkstore_vllm.device_layout, chunkstore_vllm.loads, chunkstore_vllm.saves\n"
        f"print(sorted(m for m in {FORBIDDEN_IMPORTS!r} if m in sys.modules))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.splitlines()[-1] == "[]", run.stdout


def flash_reshape_and_cache(cache: Any, keys: Any, values: Any, slots: Any) -> None:
    """vLLM's ``reshape_and_cache_flash``, restated (module docstring)."""
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)
    block, offset = slots // BLOCK, slots % BLOCK
    key_cache[block, offset] = keys.to(key_cache.dtype)
    value_cache[block, offset] = values.to(value_cache.dtype)


def device_cache(device: str) -> RegisteredCache:
    """The worker's registered cache, as it is after vLLM hands over its layers and the
    probe passed: two layers in the back end's layout on ``device``, empty."""
    if device == "npu":
        access = DeviceKVLayout(SplitLayout(), ascend_write, BLOCK)
        layers: dict[str, Any] = {
            f"model.layers.{i}.self_attn.attn": tuple(
                torch.zeros(BLOCKS, BLOCK, HEADS, DIM, device=device) for _ in range(2)
            )
            for i in range(LAYERS)
        }
    else:
        access = DeviceKVLayout(PackedLayout(DIM), flash_reshape_and_cache, BLOCK)
        layers = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(
                BLOCKS, HEADS, BLOCK, 2 * DIM, device=device
            )
            for i in range(LAYERS)
        }
    cache = RegisteredCache(access, RankHeads(0, 1, HEADS, HEADS), BLOCK)
    cache.set_layers(layers)
    assert all(access.probe(name, layer) for name, layer in cache.layers)
    cache.readable = True
    return cache


def model_keys() -> ModelKeys:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM)
    return ModelKeys(KeySpace(ModelFingerprint.of("on-device", "float32", ROTARY, layout), (0,)))


def worker(cache: RegisteredCache, address: str) -> tuple[Loads, Saves, DaemonLink, ConnectorStats]:
    """The worker's loads and saves over one link to the daemon, as the connector's worker
    side makes them."""
    config = ConnectorConfig(address=address, overlap_layers=False, load_cpus="all")
    stats = ConnectorStats()
    link = DaemonLink(config, "on-device", stats)
    loads, saves = (
        Loads(cache, model_keys(), config, link, stats),
        Saves(cache, model_keys(), link, stats),
    )
    return loads, saves, link, stats


def test_the_worker_loads_and_saves_a_chunk_in_a_device_cache(serve, accelerator: str) -> None:
    daemon = serve("--device", POOL_DEVICE[accelerator], pool_bytes=32 << 20, block_size=1 << 16)
    keys, values = random_kv(TOKENS, seed=11, heads=HEADS)  # computed at STORED_AT
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(1), keys, values, STORED_AT)
    cache = device_cache(accelerator)
    loads, saves, link, stats = worker(cache, daemon.unix)
    with ChunkStoreClient(daemon.unix) as scheduler:  # the scheduler side leases, as vLLM's
        [lease] = scheduler.acquire([entry_key(1)])
        assert lease is not None
        item = LoadItem(lease.key, 0, START, TOKENS, lease, scheduler.session)
        loads.start(ChunkStoreMetadata([RequestPlan("r", TABLE, loads=[item])]))
        for name, _ in cache.layers:
            loads.wait(name)  # the forward's wait before each layer's attention
        loads.finish()
        assert not loads.failed_blocks()
        scheduler.release([lease.lease_id])
    assert stats.data["loaded_tokens"] == TOKENS

    # The cache holds the keys rotated to START, the values as stored.
    cos, sin = rotation_table(ROTARY, START - STORED_AT, TOKENS)
    slots = cache.slots(TABLE, START, TOKENS)
    queries = torch.randn(8, 2 * HEADS, DIM, generator=torch.Generator().manual_seed(12))
    for layer, (_, paged) in enumerate(cache.layers):
        expected_keys = rotate_keys(keys[layer], cos, sin, ROTARY)
        got_keys, got_values = cache.access.read(paged, slots)
        assert got_values is not None
        scale = float(expected_keys.abs().max())
        assert (got_keys.cpu() - expected_keys).abs().max() <= tolerance(torch.float32, scale)
        assert torch.equal(got_values.cpu(), values[layer])
        # Attention over the loaded cache on the device, as over the reference on the CPU.
        on_device, _ = partial_attention(queries.to(accelerator), got_keys, got_values, DIM**-0.5)
        reference, _ = partial_attention(queries, expected_keys, values[layer], DIM**-0.5)
        assert (on_device.cpu() - reference).abs().max() <= 1e-4

    # A chunk vLLM computed at START, written into the cache by its op, saved: stored as is.
    computed_keys, computed_values = random_kv(TOKENS, seed=13, heads=HEADS)
    for layer, (_, paged) in enumerate(cache.layers):
        target = slots.to(accelerator)
        cache.access.backend_write(
            paged,
            computed_keys[layer].to(accelerator),
            computed_values[layer].to(accelerator),
            target,
        )
    plan = RequestPlan("r", TABLE, saves=[SaveItem(entry_key(2), START, TOKENS)])
    saves.save(ChunkStoreMetadata([plan]), None)
    assert stats.data["saved_segments"] == 1
    with ChunkStoreClient(daemon.unix) as client:
        stored = client.get(entry_key(2))
    assert stored is not None and stored.layout.virtual_start == START
    assert torch.equal(stored.keys, computed_keys) and torch.equal(stored.values, computed_values)
    loads.shutdown()
    link.close()  # the pool's import: the daemon frees it at its stop
