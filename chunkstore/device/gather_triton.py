"""The fused get from a device pool: one Triton kernel gathers an entry's blocks into the
caller's tensor and computes its ``TensorDigest`` sums from the same loaded bytes.

Today's gather (``device_ipc.gather_tensor`` on torch ops) copies each extent, then hashes it
again from the pool in three passes (widen to int32, multiply by the weights, two sums): an
IPC get ran at 33-46 GB/s on an H200 against 1,270-1,480 for a device-to-device copy
(docs/device-check.md). Here every byte is read from the pool once, stored once into the
caller's tensor, and added to the two sums in registers: the traffic of a copy.

Why a digest in the same pass, and not "checked once at put, trusted after" (issue 76): the
device pool is not read-only to its importers. Every same-node client opens it read-write
through its IPC handle (a put copies into it from the client's process), and
docs/tenants.md promises that a write into the pool by any of them after a put "is caught by
the entry's checksum on the next read and the entry evicted, never served". A check only at
put would serve such bytes (a stray or stale write of a buggy worker, a torn write into a
reused block), so a get still hashes what it serves. It now hashes exactly what it served:
the digest is of the bytes stored into ``out``, not of a second read of the pool.

The sums are ``TensorDigest``'s, the same integers, so stored checksums stay valid: the sum
of the bytes and their sum weighted by ``(position % 65521) + 1``, positions counted from the
digest's length before this call. Each program takes tiles of ``TILE`` bytes that never
cross a pool block (a tile's source is one block's, found by one load of the block table);
a whole tile moves unmasked, so the compiler uses 16-byte loads and stores where the pool's
block size is a multiple of 16 (checked in PTX for sm_90), and only an entry's last tile in
a block is masked. It sums each row of ``COLUMNS`` bytes in int32 (at most 64 x 255 x 65521
< 2^31) and the rows in int64, and writes its two partial sums; torch adds the partials on
the device and ``TensorDigest`` keeps them there until ``intdigest``: one wait on the
device a get. Programs loop over tiles with a stride of their count, so the grid stays
bounded for any entry (triton-ascend limits grids). Plain masked loads and stores, no
atomics, nothing CUDA-only, so triton-ascend can build the same source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

MODULUS = 65521  # TensorDigest's weight cycle (device_ipc._MODULUS)
COLUMNS = 64  # bytes summed in int32 before widening: 64 x 255 x 65521 < 2^31
TILE = 8192  # bytes a program moves per step; < MODULUS, so a tile's weights wrap once
MAX_PROGRAMS = 4096  # more tiles than this: each program takes several


@triton.jit
def _gather_digest(
    pool,
    table,
    out,
    partials,
    nbytes,
    block_size,
    tiles_per_block,
    tiles,
    phase,
    modulus,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """out[p] = pool[table[p // block_size] * block_size + p % block_size] for p < nbytes;
    partials[0, program] and partials[1, program]: the sum of the bytes it moved and their
    sum weighted by ((phase + p) % modulus) + 1."""
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    within = tl.arange(0, ROWS)[:, None] * COLUMNS + tl.arange(0, COLUMNS)[None, :]
    plain = tl.zeros([ROWS], dtype=tl.int64)
    weighted = tl.zeros([ROWS], dtype=tl.int64)
    for tile in range(program, tiles, programs):
        index = (tile // tiles_per_block).to(tl.int64)
        tile_start = (tile % tiles_per_block).to(tl.int64) * (ROWS * COLUMNS)
        block = tl.load(table + index)
        source = pool + block * block_size + tile_start
        target = out + index * block_size + tile_start
        # The entry's bytes in this block past the tile's start. A whole tile moves unmasked,
        # so the compiler may use wide loads whatever the entry's length.
        left = tl.minimum(nbytes - index * block_size, block_size) - tile_start
        if left >= ROWS * COLUMNS:
            byte = tl.load(source + within)
            tl.store(target + within, byte)
        else:
            live = within < left
            byte = tl.load(source + within, mask=live, other=0)
            tl.store(target + within, byte, mask=live)
        # The weight of the tile's first byte, once per tile; the others add their offset,
        # wrapping at most once (a tile is shorter than the cycle).
        first = ((phase + index * block_size + tile_start) % modulus).to(tl.int32)
        weight = first + within
        weight = tl.where(weight >= modulus, weight - modulus, weight) + 1
        wide = byte.to(tl.int32)
        plain += tl.sum(wide, axis=1).to(tl.int64)
        weighted += tl.sum(wide * weight, axis=1).to(tl.int64)
    tl.store(partials + program, tl.sum(plain, axis=0))
    tl.store(partials + programs + program, tl.sum(weighted, axis=0))


def gather_with_sums(
    pool: torch.Tensor,
    blocks: list[int],
    block_size: int,
    out: torch.Tensor,
    phase: int,
    tile: int = TILE,
) -> torch.Tensor:
    """Copy the entry in ``blocks`` of ``pool`` (flat uint8) into ``out`` (flat contiguous
    uint8 on the pool's device, the entry's length) and return ``TensorDigest``'s plain and
    weighted sums of those bytes, int64 [plain, weighted] on the device, positions counted
    from ``phase`` (the digest's length so far). Nothing waits on the device."""
    if tile % COLUMNS or not COLUMNS <= tile < MODULUS:
        raise ValueError(f"a tile of {tile} bytes: a multiple of {COLUMNS} below {MODULUS}")
    nbytes = out.numel()
    device = pool.device
    if nbytes == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    used = -(-nbytes // block_size)
    table = torch.tensor(blocks[:used], dtype=torch.int64).to(device, non_blocking=True)
    tiles_per_block = -(-block_size // tile)
    tiles = used * tiles_per_block
    programs = min(tiles, MAX_PROGRAMS)
    partials = torch.empty(2, programs, dtype=torch.int64, device=device)
    _gather_digest[(programs,)](
        pool,
        table,
        out,
        partials,
        nbytes,
        block_size,
        tiles_per_block,
        tiles,
        phase % MODULUS,
        MODULUS,
        ROWS=tile // COLUMNS,
        COLUMNS=COLUMNS,
    )
    return partials.sum(dim=1)


def self_check(device_type: str, new_digest: Callable[[], Any]) -> str | None:
    """None where the kernel, on this device, gathers the bytes torch's slicing gathers and
    sums them to ``TensorDigest``'s integers on the host (blocks out of order, a block size
    not a multiple of the tile, a last block part full, a digest already fed); else what
    went wrong. ``new_digest`` makes ``device_ipc``'s, passed in (it imports this module). A
    gather that fails it is not used (``device_ipc.fused_gather_for``)."""
    block_size, blocks, nbytes = TILE + 1000, [3, 0, 2], 2 * (TILE + 1000) + 777
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (4 * block_size,), dtype=torch.uint8, generator=g)
    lead = torch.randint(0, 256, (70_001,), dtype=torch.uint8, generator=g)
    want = torch.cat([pool[b * block_size : (b + 1) * block_size] for b in blocks])[:nbytes]
    reference = new_digest()
    reference.update(lead)
    reference.update(want)
    try:
        there = pool.to(device_type)
        out = torch.zeros(nbytes, dtype=torch.uint8, device=there.device)
        fused = new_digest()
        fused.update(lead.to(device_type))
        fused.add_gathered(out.numel(), gather_with_sums(there, blocks, block_size, out, 70_001))
        got, digest = out.cpu(), fused.intdigest()
    except Exception as exc:  # the compiler or the driver refused it: torch ops serve
        return f"the kernel failed on {device_type}: {exc!r}"
    if not torch.equal(got, want):
        return f"the kernel gathered other bytes than torch on {device_type}"
    if digest != reference.intdigest():
        return f"the kernel summed to another TensorDigest than the host's on {device_type}"
    return None
