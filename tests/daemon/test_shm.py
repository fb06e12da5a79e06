"""The entry checksum and the copies in and out of the pool (chunkstore/protocol/shm.py): the
checksum is the same however the bytes are fed, in pieces or by stripes hashed apart on two
threads, from any block layout; a changed byte anywhere changes it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.protocol import streamcopy
from chunkstore.protocol.shm import (
    STRIPE,
    EntryDigest,
    Pieces,
    checksum,
    gather,
    gather_many,
    scatter,
    scatter_parts,
)


def _reference(data: np.ndarray) -> int:
    """The definition, written out: xxh3-64 over each 1 MiB stripe's xxh3-64, little-endian."""
    digests = b"".join(
        xxhash.xxh3_64_intdigest(data[lo : lo + STRIPE].data).to_bytes(8, "little")
        for lo in range(0, data.shape[0], STRIPE)
    )
    return xxhash.xxh3_64_intdigest(digests)


@settings(max_examples=25, deadline=None)
@given(
    nbytes=st.sampled_from([1, 1000, STRIPE - 1, STRIPE, STRIPE + 1, 3 * STRIPE + 12345]),
    block_size=st.sampled_from([4096, 65536, STRIPE, 4 * STRIPE]),
    cut=st.integers(1, 3 * STRIPE),
    seed=st.integers(0, 2**16),
)
def test_every_path_computes_the_same_checksum(nbytes, block_size, cut, seed) -> None:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    count = -(-nbytes // block_size)
    region = np.zeros((count * 2 + 1) * block_size, dtype=np.uint8)
    blocks = [int(b) for b in rng.permutation(count * 2)[:count]]  # scattered, out of order
    expected = _reference(data)

    fed = EntryDigest()
    for lo in range(0, nbytes, cut):  # pieces of any size
        fed.update(data[lo : lo + cut].data)
    assert fed.intdigest() == expected

    half = nbytes // 2  # two parts, as keys then values
    for threads in (1, 2):
        region[:] = 0
        written = EntryDigest()
        scatter_parts(region, blocks, block_size, [data[:half], data[half:]], written, threads)
        assert written.intdigest() == expected
        assert checksum(region, blocks, block_size, nbytes) == expected
    region[:] = 0  # the daemon's Write: pieces at offsets, hashed in place at commit
    for lo in range(0, nbytes, cut):
        scatter(region, blocks, block_size, data[lo : lo + cut], lo)
    assert checksum(region, blocks, block_size, nbytes) == expected

    for threads in (1, 2):
        out = np.zeros(nbytes, dtype=np.uint8)
        read = EntryDigest()
        gather(region, blocks, block_size, out, read, threads)
        assert np.array_equal(out, data) and read.intdigest() == expected


@pytest.mark.parametrize("threads", [1, 2])
def test_entries_read_together_report_how_far_every_one_is_read(threads: int) -> None:
    """``progress(n)``: a cache's layers are used as soon as it says they are in, so at
    each call every entry's first n bytes must be there already, whatever its size, and
    the entries' checksums still come out whole at the end."""
    rng = np.random.default_rng(7)
    sizes = [3 * STRIPE + 5000, STRIPE, 5 * STRIPE, 1000]
    block_size = 65536
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    counts = [-(-n // block_size) for n in sizes]
    region = np.zeros((sum(counts) + 1) * block_size, dtype=np.uint8)
    order = [int(b) for b in rng.permutation(sum(counts))]  # scattered, out of order
    blockss = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(sizes))]
    for data, blocks in zip(datas, blockss, strict=True):
        scatter(region, blocks, block_size, data)
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes[:-1]]
    cut = sizes[-1] // 3  # the last entry in pieces, as a cache's blocks
    tail = [np.zeros(cut, dtype=np.uint8), np.zeros(sizes[-1] - cut, dtype=np.uint8)]
    targets: list[np.ndarray | Pieces] = [*outs, Pieces(tail)]
    seen: list[int] = []

    def progress(done: int) -> None:
        seen.append(done)
        for data, out in zip(datas, [*outs, np.concatenate(tail)], strict=True):
            lo = min(done, data.shape[0])
            assert np.array_equal(out[:lo], data[:lo]), f"bytes before {done} not in yet"

    digests = [EntryDigest() for _ in sizes]
    reads = list(zip(blockss, targets, strict=True))
    gather_many(region, block_size, reads, digests, threads, progress=progress)
    assert seen == [STRIPE * k for k in range(1, 6)]  # stripe by stripe, to the longest
    assert [d.intdigest() for d in digests] == [_reference(d) for d in datas]
    assert all(np.array_equal(o, d) for o, d in zip(outs, datas, strict=False))


@pytest.mark.parametrize("where", [0, STRIPE - 1, STRIPE, 2 * STRIPE + 7])
def test_a_changed_byte_changes_the_checksum(where: int) -> None:
    data = np.random.default_rng(1).integers(0, 256, 3 * STRIPE, dtype=np.uint8)
    before = checksum(data, [0], data.shape[0], data.shape[0])
    data[where] ^= 0x01
    assert checksum(data, [0], data.shape[0], data.shape[0]) != before


def test_a_stripe_cannot_be_added_in_the_middle_of_one() -> None:
    digest = EntryDigest()
    digest.update(b"abc")
    with pytest.raises(ValueError):
        digest.add_stripe(1)


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(0, 5000),
    dst_at=st.integers(0, 15),
    src_at=st.integers(0, 15),
    seed=st.integers(0, 2**16),
)
def test_the_streaming_copy_copies_exactly_the_bytes_at_any_alignment(
    nbytes, dst_at, src_at, seed
) -> None:
    source = np.random.default_rng(seed).integers(0, 256, nbytes + 16, dtype=np.uint8)
    target = np.zeros(nbytes + 32, dtype=np.uint8)
    streamcopy.copy(target[dst_at : dst_at + nbytes], source[src_at : src_at + nbytes])
    assert np.array_equal(target[dst_at : dst_at + nbytes], source[src_at : src_at + nbytes])
    assert not target[:dst_at].any() and not target[dst_at + nbytes :].any()  # nothing beside


def test_the_streaming_copy_is_the_compiled_kernel_loaded_at_first_use() -> None:
    """numba is a dependency: the fallback (numpy's copy) must not be what runs silently. And
    it is not imported with the client: vLLM 0.32 trips on llvmlite loaded before its worker
    starts (an in-process engine)."""
    code = (
        "import sys, numpy as np\n"
        "import chunkstore.client\n"
        "from chunkstore.protocol import streamcopy\n"
        "assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules, 'imported early'\n"
        "streamcopy.copy(np.zeros(64, np.uint8), np.ones(64, np.uint8))\n"
        "assert streamcopy.kernel() is not np.copyto\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
    with pytest.raises(ValueError, match="into"):
        streamcopy.copy(np.zeros(3, np.uint8), np.zeros(4, np.uint8))
