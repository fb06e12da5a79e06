"""A context-parallel rank's part of an entry from host memory (``shm.gather_runs_summed``,
numba's loop) and the daemon's summed checksum of a whole entry (``shm.summed``), against
``TensorDigest`` over the entry's bytes in order: the parts that hold every byte once add
up to the whole's digest, whatever the runs' length, the blocks they cross and the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkstore.protocol import shm
from chunkstore.protocol.device_ipc import TensorDigest, gather_runs, run_sums

BLOCK = 1000  # not a multiple of any run below: runs cross blocks


def entry(seed: int) -> tuple[np.ndarray, list[int], int, torch.Tensor]:
    """A pool region, an entry's blocks in no order, its length and its bytes in order."""
    rng = np.random.default_rng(seed)
    region = rng.integers(0, 256, size=BLOCK * 300, dtype=np.uint8)
    blocks = [int(b) for b in rng.permutation(300)[:250]]
    nbytes = BLOCK * 249 + 77
    whole = np.concatenate([region[b * BLOCK : (b + 1) * BLOCK] for b in blocks])[:nbytes]
    return region, blocks, nbytes, torch.from_numpy(whole)


def digest(data: torch.Tensor) -> int:
    whole = TensorDigest()
    whole.update(data)
    return whole.intdigest()


@pytest.mark.parametrize("length", [3, 96, 768, 70_000])  # the last: past the weights' cycle
@pytest.mark.parametrize("threads", [1, 2])
def test_three_readers_parts_make_the_entry_s_digest(length: int, threads: int) -> None:
    region, blocks, nbytes, whole = entry(length)
    runs = torch.arange(0, nbytes - length + 1, length)
    owner = torch.from_numpy(np.random.default_rng(threads).integers(0, 3, size=len(runs)))
    total = torch.zeros(2, dtype=torch.int64)
    for reader in range(3):
        starts = runs[owner == reader]
        out = torch.empty(len(starts) * length, dtype=torch.uint8)
        args = (region, blocks, BLOCK, starts.numpy(), length, out.numpy())
        sums = torch.tensor(shm.gather_runs_summed(*args, threads=threads))
        expected = [whole[at : at + length] for at in starts.tolist()]
        assert torch.equal(out, torch.cat(expected) if expected else out)
        assert torch.equal(sums, run_sums(out, starts, length))  # the stream's sums alike
        total += sums
    tail = len(runs) * length  # the bytes no whole run holds: one more reader
    if tail < nbytes:
        out = torch.empty(nbytes - tail, dtype=torch.uint8)
        total += gather_runs(
            torch.from_numpy(region), blocks, BLOCK, torch.tensor([tail]), nbytes - tail, out
        )
    assert shm.digest_of_sums(nbytes, *total.tolist()) == digest(whole)
    total[1] += 1  # one weight off
    assert shm.digest_of_sums(nbytes, *total.tolist()) != digest(whole)


def test_the_pool_s_summed_checksum_is_the_entry_s_digest() -> None:
    region, blocks, nbytes, whole = entry(7)
    assert shm.summed(region, blocks, BLOCK, nbytes) == digest(whole)
    region[blocks[3] * BLOCK + 5] ^= 1
    assert shm.summed(region, blocks, BLOCK, nbytes) != digest(whole)
