"""The KV math on the device it serves from, against the CPU fp32 reference: RoPE remap of
every rotary variant (fp32, fp16, bf16), each cache layout's rotated write read back by the
layout's own indexing (vLLM >= 0.32's packed flash layout in NHD and HND order, the stacked
layouts of older vLLM, vllm-ascend's split pair, MLA's latent), the chunk writer (and the fused
Triton writer against the torch one, bit for bit, where triton runs on the device), the
isolation attention, ``TensorDigest`` (device pools' checksum) against the same digest of the
same bytes on the host, and the fused get (gather + digest in one Triton kernel, where triton
runs on the device) against a gather and digest on the host. ``accelerator`` is the device
(conftest.py); tests/kv proves the math itself against HF transformers on CPU tensors."""

from __future__ import annotations

import random

import pytest
import torch

from chunkstore.device import device_ipc
from chunkstore.device.device_ipc import DIGEST_PIECE, TensorDigest, gather_tensor
from chunkstore.kv import writer
from chunkstore.kv.attention import KeyBlock, attention_after_context, isolated_attention
from chunkstore.kv.cache_layouts import (
    CacheLayout,
    LatentLayout,
    PackedLayout,
    SplitLayout,
    StackedLayout,
)
from chunkstore.kv.keys import Isolation
from chunkstore.kv.masks import SegmentLayout
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import rotation_table
from chunkstore.kv.segments import SegmentKind
from chunkstore.kv.writer import write_chunk
from chunkstore.protocol.keyed_digest import MODULUS, SumKey, keyed_sums
from chunkstore.testing.devices import DTYPES, ROTARY_VARIANTS, tolerance

BLOCKS, BLOCK_SIZE, HEADS, DIM = 6, 16, 4, 64
SLOTS = torch.tensor([5, 0, 17, 9, 23, 12, 80, 95])

VARIANTS = ROTARY_VARIANTS


@pytest.mark.parametrize("row", [256, 320, 6])  # int64, int32 and int16 words
def test_a_context_parallel_rank_s_part_gathers_on_the_device_as_on_the_host(
    accelerator: str, row: int
) -> None:
    """``gather_runs`` (a context-parallel rank's rows of an entry in a device pool): on the
    device the bytes and the two keyed sums of the host's (torch's int64 ops there, numba's
    loop here); the parts of every rank add up to the whole entry's keyed sums."""
    block_size, blocks = 1 << 12, [5, 1, 7, 3, 0]
    pool = torch.randint(0, 256, (8 * block_size,), dtype=torch.uint8)
    nbytes = len(blocks) * block_size // row * row
    entry = torch.cat([pool[b * block_size : (b + 1) * block_size] for b in blocks])[:nbytes]
    weights = SumKey.fresh().tables(nbytes)
    total = torch.zeros(2, dtype=torch.int64)
    for rank in range(3):  # rows dealt out to three ranks
        starts = torch.arange(rank, nbytes // row, 3) * row
        host = torch.empty(len(starts) * row, dtype=torch.uint8)
        sums = device_ipc.gather_runs(pool, blocks, block_size, starts, row, host, weights)
        runs = (starts[:, None] + torch.arange(row)).flatten()
        assert torch.equal(host, entry[runs])
        out = torch.empty(len(host), dtype=torch.uint8, device=accelerator)
        on_device = device_ipc.gather_runs(
            pool.to(accelerator), blocks, block_size, starts.to(accelerator), row, out, weights
        )
        assert torch.equal(out.cpu(), host) and torch.equal(on_device.cpu(), sums)
        total += sums
    assert (total % MODULUS).tolist() == keyed_sums(entry.numpy(), 0, *weights)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_remap_of_every_rotary_variant_on_the_device(
    accelerator: str, variant: str, dtype: torch.dtype
) -> None:
    cfg = VARIANTS[variant]
    g = torch.Generator().manual_seed(len(variant))
    keys = torch.randn(64, 3, cfg.head_dim, generator=g).to(dtype)
    deltas = torch.randint(-4096, 4096, (64,), generator=g)
    reference = remap_keys(keys.float(), deltas, cfg)  # the CPU fp32 reference
    got = remap_keys(keys.to(accelerator), deltas.to(accelerator), cfg)
    assert got.device.type == accelerator and got.dtype == dtype
    error = float((got.cpu().float() - reference).abs().max())
    assert error <= tolerance(dtype, float(reference.abs().max())), (variant, error)


def caches(device: str, dtype: torch.dtype = torch.float32) -> list[tuple[CacheLayout, object]]:
    """One cache of each layout, zeroed; physical orders given by the allocation, logical
    order by the view the back end hands over."""
    zeros = {"device": device, "dtype": dtype}
    nhd = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, 2 * DIM, **zeros).transpose(1, 2)  # type: ignore[arg-type]
    hnd = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM, **zeros)  # type: ignore[arg-type]
    stacked_hnd = torch.zeros(2, BLOCKS, HEADS, BLOCK_SIZE, DIM, **zeros).transpose(2, 3)  # type: ignore[arg-type]
    return [
        (PackedLayout(DIM), nhd),
        (PackedLayout(DIM), hnd),
        (StackedLayout(0), torch.zeros(2, BLOCKS, BLOCK_SIZE, HEADS, DIM, **zeros)),  # type: ignore[arg-type]
        (StackedLayout(0), stacked_hnd),
        (StackedLayout(1), torch.zeros(BLOCKS, 2, BLOCK_SIZE, HEADS, DIM, **zeros)),  # type: ignore[arg-type]
        (
            SplitLayout(),
            tuple(torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM, **zeros) for _ in "kv"),  # type: ignore[arg-type]
        ),
    ]


CACHE_NAMES = ["packed-NHD", "packed-HND", "stacked0", "stacked0-HND", "stacked1", "split"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotated_writes_into_every_layout_on_the_device_match_the_cpu(
    accelerator: str, dtype: torch.dtype
) -> None:
    rotary = VARIANTS["default"]
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(len(SLOTS), HEADS, DIM, generator=g).to(dtype)
    values = torch.randn(len(SLOTS), HEADS, DIM, generator=g).to(dtype)
    cos, sin = rotation_table(rotary, 123, len(SLOTS))
    pairs = zip(caches("cpu"), caches(accelerator, dtype), CACHE_NAMES, strict=True)
    for (layout, on_cpu), (_, on_device), name in pairs:
        layout.write(on_cpu, keys.float(), values.float(), SLOTS, (cos, sin), rotary)
        layout.write(
            on_device,
            keys.to(accelerator),
            values.to(accelerator),
            SLOTS.to(accelerator),
            (cos.to(accelerator), sin.to(accelerator)),
            rotary,
        )
        want_k, want_v = layout.read(on_cpu, SLOTS)
        got_k, got_v = layout.read(on_device, SLOTS.to(accelerator))
        assert got_v is not None and want_v is not None
        error = float((got_k.cpu().float() - want_k).abs().max())
        assert error <= tolerance(dtype, float(want_k.abs().max())), (name, error)
        assert torch.equal(got_v.cpu().float(), values.float()), name  # values copied as stored
        # Nothing but the slots written: every other row of the device cache is still zero.
        key_view, _ = layout.views(on_device)
        assert int((key_view != 0).any(-1).any(-1).sum()) == len(SLOTS), name


def test_mla_latent_rotates_on_the_device_as_on_the_cpu(accelerator: str) -> None:
    rotary = VARIANTS["mla-offset"]
    latent = torch.randn(len(SLOTS), 1, rotary.head_dim)
    rotation = rotation_table(rotary, 9, len(SLOTS))
    on_cpu = torch.zeros(BLOCKS, BLOCK_SIZE, rotary.head_dim)
    on_device = on_cpu.to(accelerator)
    LatentLayout().write(on_cpu, latent, None, SLOTS, rotation, rotary)
    LatentLayout().write(
        on_device,
        latent.to(accelerator),
        None,
        SLOTS.to(accelerator),
        (rotation[0].to(accelerator), rotation[1].to(accelerator)),
        rotary,
    )
    assert float((on_device.cpu() - on_cpu).abs().max()) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_chunk_writer_on_the_device_matches_the_cpu_writer(
    accelerator: str, dtype: torch.dtype
) -> None:
    """``write_chunk``: every layer of a stored chunk into a paged cache, keys re-rotated by
    the chunk's move, padded slots skipped (the device's torch writer against the CPU's
    fused kernel)."""
    layers, tokens, rotary = 3, 40, VARIANTS["gptj-partial"]
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(layers, tokens, HEADS, DIM, generator=g).to(dtype)
    values = torch.randn(layers, tokens, HEADS, DIM, generator=g).to(dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    slots[7] = -1  # a token another rank owns
    shape = (layers, BLOCKS, BLOCK_SIZE, HEADS, DIM)
    cpu_k, cpu_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    write_chunk(keys, values, cpu_k, cpu_v, slots, 300, rotary)
    dev_k, dev_v = cpu_k.new_zeros(shape).to(accelerator), cpu_v.new_zeros(shape).to(accelerator)
    write_chunk(keys.to(accelerator), values.to(accelerator), dev_k, dev_v, slots, 300, rotary)
    error = float((dev_k.cpu().float() - cpu_k.float()).abs().max())
    assert error <= tolerance(dtype, float(cpu_k.float().abs().max())), error
    assert torch.equal(dev_v.cpu(), cpu_v)


@pytest.mark.parametrize("isolation", list(Isolation))
def test_isolated_attention_on_the_device_matches_the_cpu(
    accelerator: str, isolation: Isolation
) -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    for _ in range(4):
        kinds = [SegmentKind.SYS] + [SegmentKind.CHUNK] * rng.randint(1, 4)
        kinds.append(SegmentKind.QUESTION)
        layout = SegmentLayout(tuple(kinds), tuple(rng.randint(3, 40) for _ in kinds))
        n = layout.num_tokens
        q, k, v = torch.randn(n, 8, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
        want = isolated_attention(q, k, v, layout, isolation)
        got = isolated_attention(*(t.to(accelerator) for t in (q, k, v)), layout, isolation)
        assert float((got.cpu() - want).abs().max()) <= 1e-4


def test_attention_after_context_on_the_device_matches_the_cpu(accelerator: str) -> None:
    """The isolation hook's chunk rows: queries over their own causal run and context
    blocks seen whole (APE's temperature and weight), merged by log-sum-exp."""
    torch.manual_seed(3)
    q, own_k, own_v = torch.randn(20, 8, 64), torch.randn(50, 2, 64), torch.randn(50, 2, 64)
    context = [KeyBlock(torch.randn(30, 2, 64), torch.randn(30, 2, 64), 1.2, -0.3)]
    want = attention_after_context(q, own_k, own_v, context, 0.125)
    moved = [
        KeyBlock(b.keys.to(accelerator), b.values.to(accelerator), b.temperature, b.log_weight)
        for b in context
    ]
    got = attention_after_context(
        q.to(accelerator), own_k.to(accelerator), own_v.to(accelerator), moved, 0.125
    )
    assert float((got.cpu() - want).abs().max()) <= 1e-4


@pytest.mark.parametrize("length", [1, 4095, DIGEST_PIECE + 12345])
def test_tensor_digest_on_the_device_equals_the_host_digest(accelerator: str, length: int) -> None:
    """The device pool's checksum over the same bytes, computed where they lie, fed in the
    pieces a gather feeds: the same integer as on the host; one changed byte changes it."""
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator())
    host, device = TensorDigest(), TensorDigest()
    host.update(data)
    on_device = data.to(accelerator)
    for lo in range(0, length, 1 << 20):
        device.update(on_device[lo : lo + (1 << 20)])
    assert device.intdigest() == host.intdigest()
    on_device[length // 2] ^= 0x5A
    changed = TensorDigest()
    changed.update(on_device)
    assert changed.intdigest() != host.intdigest()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_triton_writer_writes_the_torch_writers_bits_on_the_device(
    accelerator: str, dtype: torch.dtype
) -> None:
    """Where triton runs on the device (CUDA; an NPU with triton-ascend), ``write_chunk`` and
    every cache layout write through the fused kernel (its self-check passed on this
    machine) and write what torch ops write on the same device, bit for bit, for every rotary
    variant. The CPU has no Triton writer: its chunk writer is numba's, its layouts torch's."""
    if accelerator == "cpu":
        assert writer.layer_writer_for("cpu") is None
        return
    problem = writer.triton_problem(accelerator)
    if accelerator == "npu" and problem and problem.startswith("triton unavailable"):
        assert writer.writer_for("npu") is writer.write_torch
        return
    assert problem is None, problem
    assert writer.writer_for(accelerator) is not writer.write_torch
    from chunkstore.kv.writer_triton import write_triton

    layers, tokens = 2, 40
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    slots[3] = -1  # a token another rank owns
    for variant, rotary in VARIANTS.items():
        shape = (layers, tokens, HEADS, rotary.head_dim)
        keys = torch.randn(shape, generator=g).to(dtype).to(accelerator)
        values = torch.randn(shape, generator=g).to(dtype).to(accelerator)
        deltas = torch.randint(-4096, 4096, (tokens,), generator=g)
        cache_shape = (layers, BLOCKS, BLOCK_SIZE, HEADS, rotary.head_dim)
        written = [torch.zeros(cache_shape, dtype=dtype, device=accelerator) for _ in range(4)]
        write_chunk(keys, values, *written[:2], slots, deltas, rotary, writer=write_triton)
        write_chunk(keys, values, *written[2:], slots, deltas, rotary, writer=writer.write_torch)
        assert torch.equal(written[0], written[2]) and torch.equal(written[1], written[3]), variant

    rotary = VARIANTS["default"]
    keys = torch.randn(len(SLOTS), HEADS, DIM, generator=g).to(dtype).to(accelerator)
    values = torch.randn(len(SLOTS), HEADS, DIM, generator=g).to(dtype).to(accelerator)
    rotation = tuple(t.to(accelerator) for t in rotation_table(rotary, 123, len(SLOTS)))
    on = SLOTS.to(accelerator)
    fused_caches, torch_caches = caches(accelerator, dtype), caches(accelerator, dtype)
    for (layout, fused), (_, by_torch), name in zip(
        fused_caches, torch_caches, CACHE_NAMES, strict=True
    ):
        layout.write(fused, keys, values, on, rotation, rotary)
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(writer._layer_writers, accelerator, None)  # torch ops
            layout.write(by_torch, keys, values, on, rotation, rotary)
        for a, b in zip(layout.views(fused), layout.views(by_torch), strict=True):
            assert a is not None and b is not None and torch.equal(a, b), name


@pytest.mark.parametrize(
    "block_size, blocks, nbytes",
    [(1 << 20, [3, 0, 2, 1], 3 * (1 << 20) + 12_345), (12_345, [7, 2, 5, 0], 3 * 12_345 + 1)],
    ids=["MiB-blocks", "odd-blocks"],
)
def test_the_fused_get_on_the_device_serves_the_hosts_bytes_and_digest(
    accelerator: str, block_size: int, blocks: list[int], nbytes: int
) -> None:
    """Where triton runs on the device (CUDA; an NPU with triton-ascend), a get from a pool
    there (``gather_tensor`` into a tensor on the pool's device) goes through the fused kernel
    (its self-check passed on this machine) and gives the bytes and the ``TensorDigest`` that
    a gather on the host gives, after a digest already fed; one changed byte changes it. The
    CPU (the fake device's pools) gathers with torch ops."""
    if accelerator == "cpu":
        assert device_ipc.fused_gather_for("cpu") is None
        return
    fused = device_ipc.fused_gather_for(accelerator)
    problem = device_ipc.gather_problems.get(accelerator, "")
    if accelerator == "npu" and problem.startswith("triton unavailable"):
        assert fused is None
        return
    assert fused is not None, problem
    g = torch.Generator().manual_seed(6)
    host_pool = torch.randint(0, 256, (8 * block_size,), dtype=torch.uint8, generator=g)
    fed = torch.randint(0, 256, (DIGEST_PIECE + 7,), dtype=torch.uint8, generator=g)
    host, device = TensorDigest(), TensorDigest()
    host.update(fed)
    want = torch.empty(nbytes, dtype=torch.uint8)
    gather_tensor(host_pool, blocks, block_size, want, host)
    pool = host_pool.to(accelerator)
    device.update(fed.to(accelerator))
    out = torch.zeros(nbytes, dtype=torch.uint8, device=accelerator)
    gather_tensor(pool, blocks, block_size, out, device)
    assert device.intdigest() == host.intdigest()
    assert torch.equal(out.cpu(), want)
    pool[blocks[-1] * block_size] ^= 0x01
    changed = TensorDigest()
    changed.update(fed.to(accelerator))
    gather_tensor(pool, blocks, block_size, out, changed)
    assert changed.intdigest() != host.intdigest()
