"""A context-parallel rank's part of an entry from host memory (``shm.gather_runs_summed``,
numba's loop), the same sums in torch (a device pool's) and the daemon's pass over a whole
entry at a summed lease (``shm.keyed_and_checksum``), against ``keyed_digest``'s reference
over the entry's bytes in order: the parts that hold every byte once add up to the whole's
keyed sums, whatever the runs' length, the blocks they cross and the threads; a change that
keeps any sums with public weights (``TensorDigest``'s) changes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkstore.device.device_ipc import (
    TensorDigest,
    gather_runs,
    keyed_run_sums,
    keyed_run_sums_torch,
)
from chunkstore.protocol import shm
from chunkstore.protocol.keyed_digest import MODULUS, NO_LANES, SPAN, SumKey, keyed_sums

BLOCK = 1000  # not a multiple of any run below: runs cross blocks


def entry(seed: int) -> tuple[np.ndarray, list[int], int, np.ndarray]:
    """A pool region, an entry's blocks in no order, its length and its bytes in order."""
    rng = np.random.default_rng(seed)
    region = rng.integers(0, 256, size=BLOCK * 300, dtype=np.uint8)
    blocks = [int(b) for b in rng.permutation(300)[:250]]
    nbytes = BLOCK * 249 + 77
    whole = np.concatenate([region[b * BLOCK : (b + 1) * BLOCK] for b in blocks])[:nbytes]
    return region, blocks, nbytes, whole


@pytest.mark.parametrize("length", [3, 96, 768, 5000])  # the last: runs cross spans
@pytest.mark.parametrize("threads", [1, 2])
def test_three_readers_parts_make_the_entry_s_keyed_sums(length: int, threads: int) -> None:
    region, blocks, nbytes, whole = entry(length)
    key = SumKey.fresh()
    weights = key.tables(nbytes)
    runs = torch.arange(0, nbytes - length + 1, length)
    owner = torch.from_numpy(np.random.default_rng(threads).integers(0, 3, size=len(runs)))
    total = torch.zeros(2, dtype=torch.int64)
    for reader in range(3):
        starts = runs[owner == reader]
        out = torch.empty(len(starts) * length, dtype=torch.uint8)
        args = (region, blocks, BLOCK, starts.numpy(), length, out.numpy(), weights)
        sums = torch.tensor(shm.gather_runs_summed(*args, threads=threads))
        expected = [torch.from_numpy(whole[at : at + length]) for at in starts.tolist()]
        assert torch.equal(out, torch.cat(expected) if expected else out)
        assert torch.equal(sums, keyed_run_sums(out, starts, length, weights))  # the stream's
        assert torch.equal(sums, keyed_run_sums_torch(out, starts, length, weights))  # a GPU's
        total += sums
    tail = len(runs) * length  # the bytes no whole run holds: one more reader
    if tail < nbytes:
        out = torch.empty(nbytes - tail, dtype=torch.uint8)
        pool = torch.from_numpy(region)
        total += gather_runs(pool, blocks, BLOCK, torch.tensor([tail]), nbytes - tail, out, weights)
    assert (total % MODULUS).tolist() == keyed_sums(whole, 0, *weights)
    shifted = weights[0], np.roll(weights[1], 1, axis=1)  # a span's weight at another
    assert keyed_sums(whole, 0, *shifted) != keyed_sums(whole, 0, *weights)


def test_the_daemon_s_pass_checks_and_sums_the_same_copy() -> None:
    """At a summed lease the daemon's pass gives the entry's checksum and its keyed sums;
    a copy alone (``NO_LANES``) gathers the same bytes."""
    region, blocks, nbytes, whole = entry(7)
    weights = SumKey.fresh().tables(nbytes)
    checksum, sums = shm.keyed_and_checksum(region, blocks, BLOCK, nbytes, weights)
    assert checksum == shm.checksum(region, blocks, BLOCK, nbytes)
    assert list(sums) == keyed_sums(whole, 0, *weights)
    out = np.empty(nbytes, dtype=np.uint8)
    shm.gather_runs_summed(region, blocks, BLOCK, np.array([0]), nbytes, out, NO_LANES)
    assert np.array_equal(out, whole)
    region[blocks[3] * BLOCK + 5] ^= 1
    changed, other = shm.keyed_and_checksum(region, blocks, BLOCK, nbytes, weights)
    assert changed != checksum and other != sums


def forgeries(data: np.ndarray) -> dict[str, np.ndarray]:
    """Changes that keep the bytes' plain sum and their sum weighted by position mod 65521
    (``TensorDigest``'s): +1 at p and -1 at p + 65521; and +1, -1, -1, +1 at p, p + 1, q,
    q + 1, which keeps any sum weighted by position, whatever the modulus."""
    two, four = data.copy(), data.copy()
    p, q = 1000, 90_000
    assert data[p] < 255 and data[p + 65521] > 0  # the test's seed keeps these in range
    two[p] += 1
    two[p + 65521] -= 1
    assert data[p] < 255 and data[p + 1] > 0 and data[q] > 0 and data[q + 1] < 255
    four[p] += 1
    four[p + 1] -= 1
    four[q] -= 1
    four[q + 1] += 1
    return {"two bytes": two, "four bytes": four}


def test_forgeries_that_keep_public_sums_change_the_keyed_ones() -> None:
    data = np.random.default_rng(3).integers(0, 256, size=200_000, dtype=np.uint8)
    original = TensorDigest()
    original.update(torch.from_numpy(data))
    for name, forged in forgeries(data).items():
        public = TensorDigest()
        public.update(torch.from_numpy(forged))
        assert public.intdigest() == original.intdigest(), name  # the old check passes it
        for _ in range(20):  # each fresh key: both lanes change (odds of either: 2^-30)
            weights = SumKey.fresh().tables(len(data))
            old, new = keyed_sums(data, 0, *weights), keyed_sums(forged, 0, *weights)
            assert old[0] != new[0] and old[1] != new[1], name


def test_a_key_s_weights_are_the_same_everywhere() -> None:
    """The weights are a key's (splitmix64, exact integers: every host and numpy draws the
    same), in [1, MODULUS), and a longer entry's outer table starts with a shorter's."""
    key = SumKey((1, 2**64 - 1))
    inner, outer = key.tables(3 * SPAN + 1)
    assert inner.shape == (2, SPAN) and outer.shape == (2, 4)
    assert inner[:, :2].tolist() == [[1294668924, 1631396600], [785052171, 41313400]]
    assert ((inner >= 1) & (inner < MODULUS)).all() and ((outer >= 1) & (outer < MODULUS)).all()
    assert np.array_equal(key.outer(10 * SPAN)[:, :4], outer)
    assert not np.array_equal(SumKey((2, 2**64 - 1)).inner()[0], inner[0])
