"""The fused get (``chunkstore.device.gather_triton``) serves the bytes torch's gather serves
and sums them to today's ``TensorDigest`` integers, so checksums stored before it stay valid:
blocks in and out of order, block sizes above, below and not a multiple of its tile, lengths
that end mid-tile and mid-block, digests already fed, entries of every KV dtype. Run on CPU
tensors by Triton's interpreter (no GPU here); the compiled kernel on a GPU is checked by
tests/device and by its own self-check before the pool uses it."""

from __future__ import annotations

import logging
import sys
from types import ModuleType

import pytest
import torch

from chunkstore.device import device_ipc
from chunkstore.device.device_ipc import (
    TensorDigest,
    gather_tensor,
    scatter_tensors,
    tensor_bytes,
)
from chunkstore.protocol.shm import extents

KERNEL = "chunkstore.device.gather_triton"
TILE = 8192  # the kernel's own tile (gather_triton.TILE), restated: the layouts below straddle it


def random_pool(blocks: int, block_size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (blocks * block_size,), dtype=torch.uint8, generator=g)


def by_torch(
    pool: torch.Tensor, blocks: list[int], block_size: int, nbytes: int, fed: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Today's get on the CPU: a copy per extent, then ``TensorDigest`` of the pool's bytes,
    after ``fed`` (what the digest had seen before this entry)."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    digest = TensorDigest()
    digest.update(fed)
    gather_tensor(pool, blocks, block_size, out, digest)
    return out, digest.intdigest()


def fused(
    kernel: ModuleType,
    pool: torch.Tensor,
    blocks: list[int],
    block_size: int,
    nbytes: int,
    fed: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    out = torch.zeros(nbytes, dtype=torch.uint8)
    digest = TensorDigest()
    digest.update(fed)
    digest.add_gathered(
        nbytes, kernel.gather_with_sums(pool, blocks, block_size, out, digest.length)
    )
    return out, digest.intdigest()


# (block size, the entry's blocks, its length): blocks merged and not, the first of the pool
# and the last, one block part full, a block smaller than a tile, lengths ending mid-tile.
LAYOUTS = {
    "one-byte": (4096, [2], 1),
    "below-a-tile": (4096, [3, 1, 0], 3 * 4096 - 5),
    "tile-blocks-in-order": (TILE, [0, 1, 2, 3], 4 * TILE),
    "tile-blocks-shuffled": (TILE, [3, 0, 2], 2 * TILE + 1),
    "odd-blocks": (12_345, [1, 4, 2, 3], 3 * 12_345 + 6_001),
    "tiles-and-a-tail": (3 * TILE + 64, [4, 2], 2 * (3 * TILE + 64) - 63),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fed", [0, 65_520, 200_003], ids=lambda n: f"fed-{n}")
def test_the_fused_get_serves_torchs_bytes_and_todays_digest(
    kernel: ModuleType, layout: str, fed: int
) -> None:
    """``fed``: bytes the digest had seen before, so the weights start anywhere in their cycle
    (65,520: the last weight of the cycle on the first byte)."""
    block_size, blocks, nbytes = LAYOUTS[layout]
    pool = random_pool(5, block_size)
    before = random_pool(1, fed, seed=1)
    want, want_digest = by_torch(pool, blocks, block_size, nbytes, before)
    got, got_digest = fused(kernel, pool, blocks, block_size, nbytes, before)
    assert torch.equal(got, want)
    assert got_digest == want_digest


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8], ids=str
)
def test_an_entry_put_in_any_dtype_reads_back_checked(
    kernel: ModuleType, dtype: torch.dtype
) -> None:
    """A put's checksum (``scatter_tensors``: TensorDigest of the caller's tensors) is the
    fused get's digest of the same entry: keys and values of an odd token count, in blocks
    not a multiple of the tile."""
    block_size = 5_000
    pool = torch.zeros(12 * block_size, dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(3, 37, 2, 24, generator=g).to(dtype) for _ in "kv")
    parts = [tensor_bytes(keys), tensor_bytes(values)]
    nbytes = sum(p.numel() for p in parts)
    blocks = [6, 1, 3, 4, 0, 11, 7, 2, 9, 10, 5, 8][: -(-nbytes // block_size)]
    put = TensorDigest()
    scatter_tensors(pool, blocks, block_size, parts, put)
    out, digest = fused(kernel, pool, blocks, block_size, nbytes, torch.empty(0, dtype=torch.uint8))
    assert digest == put.intdigest()
    half = keys.numel() * keys.element_size()
    assert torch.equal(out[:half].view(dtype).view(keys.shape), keys)
    assert torch.equal(out[half:].view(dtype).view(values.shape), values)


def test_one_changed_byte_anywhere_changes_the_digest(kernel: ModuleType) -> None:
    block_size, blocks, nbytes = LAYOUTS["tiles-and-a-tail"]
    pool = random_pool(5, block_size)
    nothing = torch.empty(0, dtype=torch.uint8)
    _, clean = fused(kernel, pool, blocks, block_size, nbytes, nothing)
    offsets = [start for start, _ in extents(blocks, block_size, 0, nbytes)]
    for at in (offsets[0], offsets[0] + TILE + 7, offsets[-1] + block_size - 64):
        pool[at] ^= 0x10
        assert fused(kernel, pool, blocks, block_size, nbytes, nothing)[1] != clean
        pool[at] ^= 0x10


def test_more_tiles_than_programs_are_shared_out(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``MAX_PROGRAMS`` tiles each program takes several (every third, here), and small
    tiles make many of them: the same bytes and digest."""
    monkeypatch.setattr(kernel, "MAX_PROGRAMS", 3)
    block_size, blocks, nbytes = LAYOUTS["odd-blocks"]
    pool = random_pool(5, block_size)
    before = random_pool(1, 999, seed=3)
    want = by_torch(pool, blocks, block_size, nbytes, before)
    out = torch.zeros(nbytes, dtype=torch.uint8)
    digest = TensorDigest()
    digest.update(before)
    sums = kernel.gather_with_sums(pool, blocks, block_size, out, digest.length, tile=256)
    digest.add_gathered(nbytes, sums)
    assert torch.equal(out, want[0]) and digest.intdigest() == want[1]
    with pytest.raises(ValueError, match="a multiple of 64"):
        kernel.gather_with_sums(pool, blocks, block_size, out, 0, tile=100)


@pytest.fixture
def fused_on_cpu(kernel: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The pool's registration (``device_ipc.fused_gather_for``), here for CPU pools: CUDA's
    and NPUs' in production, where the compiled kernel runs."""
    monkeypatch.setattr(device_ipc, "FUSED_GATHER_DEVICES", ("cpu",))
    monkeypatch.setattr(device_ipc, "_fused_gathers", {})
    monkeypatch.setattr(device_ipc, "gather_problems", {})
    return kernel


def test_a_get_from_a_pool_on_a_device_with_the_kernel_goes_through_it(
    fused_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gather_tensor`` (what ``DevicePoolTransport.read_entry`` calls) takes the kernel once
    its self-check passed; a byte changed in the pool after the put is caught by the digest,
    so it is never served (docs/tenants.md: importers can write the pool)."""
    launches: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        launches.append(1)
        return fused_on_cpu.gather_with_sums(*args, **kwargs)  # type: ignore[no-any-return]

    assert device_ipc.fused_gather_for("cpu") is fused_on_cpu.gather_with_sums
    monkeypatch.setitem(device_ipc._fused_gathers, "cpu", counted)
    block_size = 4096
    pool = torch.zeros(6 * block_size, dtype=torch.uint8)
    entry = [random_pool(1, 3 * block_size - 11, seed=4)]
    put = TensorDigest()
    scatter_tensors(pool, [4, 0, 5], block_size, entry, put)
    out = torch.empty(entry[0].numel(), dtype=torch.uint8)
    got = TensorDigest()
    gather_tensor(pool, [4, 0, 5], block_size, out, got)
    assert launches == [1]
    assert torch.equal(out, entry[0]) and got.intdigest() == put.intdigest()
    pool[5 * block_size + 100] ^= 0xFF  # a stray write by another importer, after the put
    changed = TensorDigest()
    gather_tensor(pool, [4, 0, 5], block_size, out, changed)
    assert changed.intdigest() != put.intdigest()
    # An out off the pool's device (a CPU buffer for a GPU pool) takes torch's copies.
    assert device_ipc.fused_gather_for("meta") is None


def test_without_triton_or_with_a_failed_self_check_gets_use_torch_said_once(
    fused_on_cpu: ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for why, patch_kernel in (
        ("wrong sums", lambda: monkeypatch.setattr(fused_on_cpu, "self_check", lambda *_: "x")),
        ("triton unavailable", lambda: monkeypatch.setitem(sys.modules, KERNEL, None)),
    ):
        monkeypatch.setattr(device_ipc, "_fused_gathers", {})
        patch_kernel()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=device_ipc.__name__):
            assert device_ipc.fused_gather_for("cpu") is None
            assert device_ipc.fused_gather_for("cpu") is None
        assert len(caplog.records) == 1, why
        assert "copying and hashing with torch ops" in caplog.records[0].getMessage()
        assert device_ipc.gather_problems["cpu"]
        pool = random_pool(2, 4096)
        out, digest = torch.empty(5000, dtype=torch.uint8), TensorDigest()
        gather_tensor(pool, [1, 0], 4096, out, digest)  # still served, by torch ops
        assert torch.equal(out, torch.cat((pool[4096:], pool[:4096]))[:5000])


def test_the_self_check_catches_a_kernel_that_sums_wrong(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert kernel.self_check("cpu", TensorDigest) is None
    real = kernel.gather_with_sums

    def weights_from_zero(pool, blocks, block_size, out, phase, tile=TILE):  # type: ignore[no-untyped-def]
        return real(pool, blocks, block_size, out, 0, tile)  # forgets what the digest had fed

    monkeypatch.setattr(kernel, "gather_with_sums", weights_from_zero)
    assert "another TensorDigest" in str(kernel.self_check("cpu", TensorDigest))

    def off_by_one_block(pool, blocks, block_size, out, phase, tile=TILE):  # type: ignore[no-untyped-def]
        return real(pool, [b + 1 for b in blocks[:-1]] + blocks[-1:], block_size, out, phase, tile)

    monkeypatch.setattr(kernel, "gather_with_sums", off_by_one_block)
    assert "other bytes" in str(kernel.self_check("cpu", TensorDigest))
