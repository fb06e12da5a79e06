"""The disk tier's files (chunkstore.daemon.disk): entries read back byte-exact and checked,
found again by a new tier on the same directory (a restart), torn leftovers removed at start
or at their first read, a kill -9 in the middle of writes leaving nothing that reads wrong,
and a full disk refused with a typed error that leaves the tier as it was."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from chunkstore.daemon.disk import (
    HEADER,
    MARKER,
    DiskError,
    DiskTier,
    decode_header,
    encode_header,
    foreign_top_level,
)
from chunkstore.errors import ChecksumMismatch, InvalidRequest, NotFound
from chunkstore.kv.entry import EntryLayout
from chunkstore.protocol.shm import EntryDigest, Pieces

LAYOUT = EntryLayout(30, 3, 64, "float32", "kv", 17, 5, "prefix", "vllm-cpu/0.32.0/vec/128")


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def body_of(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def checksum(data: np.ndarray) -> int:
    digest = EntryDigest()
    digest.update(data)
    return digest.intdigest()


def put(tier: DiskTier, i: int, nbytes: int, cuts: int = 3) -> np.ndarray:
    data = body_of(i, nbytes)
    tier.write(key_of(i), LAYOUT, np.array_split(data, cuts), checksum(data))
    return data


def read(tier: DiskTier, i: int) -> np.ndarray:
    entry = tier.lookup(key_of(i))
    assert entry is not None
    out = np.empty(entry.nbytes, np.uint8)
    tier.read_into(key_of(i), out)
    return out


def test_an_entry_reads_back_byte_exact_into_an_array_or_pieces(tmp_path) -> None:
    tier = DiskTier(tmp_path, 64 << 20)
    data = put(tier, 1, 3_000_001, cuts=7)  # not a multiple of a page, stripes, or cuts
    assert np.array_equal(read(tier, 1), data)
    pieces = Pieces([np.empty(n, np.uint8) for n in (1, 4095, 2_000_000, 995_905)])
    entry = tier.read_into(key_of(1), pieces)
    assert np.array_equal(np.concatenate(pieces.parts), data)
    assert (entry.layout, entry.nbytes) == (LAYOUT, len(data))
    assert entry.path.stat().st_size == HEADER + len(data)
    with pytest.raises(InvalidRequest):
        tier.read_into(key_of(1), np.empty(len(data) - 1, np.uint8))
    with pytest.raises(NotFound):
        tier.read_into(key_of(2), np.empty(1, np.uint8))


def test_the_header_round_trips_and_refuses_any_changed_byte() -> None:
    header = encode_header(key_of(7), LAYOUT, 123, 456)
    assert len(header) == HEADER
    assert decode_header(header) == (key_of(7), LAYOUT, 123, 456, "")
    # A tenant's entry keeps its tenant; a header without one is the shared namespace's.
    assert decode_header(encode_header(key_of(7), LAYOUT, 1, 2, "alice"))[4] == "alice"  # type: ignore[index]
    length = int.from_bytes(header[8:12], "little")
    for at in range(length):  # every byte the header's own checksum covers, and it
        changed = bytearray(header)
        changed[at] ^= 0x10
        assert decode_header(bytes(changed)) is None, at
    assert decode_header(header[:40]) is None


def test_a_new_tier_on_the_directory_finds_every_entry_oldest_first(tmp_path) -> None:
    tier = DiskTier(tmp_path, 64 << 20)
    written = {i: put(tier, i, 10_000 + 997 * i) for i in range(20)}
    for i in range(20):
        os.utime(tier.lookup(key_of(i)).path, (1000 + i, 1000 + i))  # type: ignore[union-attr]
    again = DiskTier(tmp_path, 64 << 20)
    assert again.lru_order() == [key_of(i) for i in range(20)]  # by modification time
    assert again.used == tier.used
    for i, data in written.items():
        assert np.array_equal(read(again, i), data)
    assert again.removed_at_start == []
    # Whose each entry is survives the restart too (tenants.py): read from its header.
    data = body_of(99, 5000)
    tier.write(key_of(99), LAYOUT, [data], checksum(data), tenant="alice")
    assert [DiskTier(tmp_path, 64 << 20).lookup(key_of(i)).tenant for i in (1, 99)] == ["", "alice"]  # type: ignore[union-attr]
    smaller = DiskTier(tmp_path, 10 * (HEADER + 30_000))  # a budget cut since: oldest go
    assert smaller.used <= smaller.capacity
    assert smaller.lru_order()[-1] == key_of(99)  # the newest
    assert smaller.lru_order()[:-1] == [key_of(i) for i in range(21 - len(smaller), 20)]


def test_torn_and_stray_files_are_removed_at_start(tmp_path) -> None:
    tier = DiskTier(tmp_path, 64 << 20)
    for i in range(6):
        put(tier, i, 50_000)
    paths = {i: tier.lookup(key_of(i)).path for i in range(6)}  # type: ignore[union-attr]
    leftover = paths[0].with_name(paths[0].name + ".tmp-1234abcd")
    leftover.write_bytes(paths[0].read_bytes()[:9000])  # a write a kill cut short
    with paths[1].open("r+b") as f:
        f.truncate(HEADER + 100)  # body cut short
    with paths[2].open("r+b") as f:
        f.truncate(100)  # header cut short
    with paths[3].open("r+b") as f:
        f.seek(20)
        f.write(b"\xff")  # header changed
    renamed = paths[4].with_name(key_of(4 + 256).hex() + ".entry")  # a name not its key's
    paths[4].rename(renamed)
    again = DiskTier(tmp_path, 64 << 20)
    assert sorted(again.lru_order()) == [key_of(0), key_of(5)]  # 0's own file is whole
    assert again.used == 2 * (HEADER + 50_000)
    assert sorted(p.name for p in again.removed_at_start) == sorted(
        [leftover.name, paths[1].name, paths[2].name, paths[3].name, renamed.name]
    )
    assert sorted(p.name for p in tmp_path.glob("*/*")) == sorted([paths[0].name, paths[5].name])
    assert again.foreign == []


LINKED = 0xAB  # key_of(LINKED)'s subdirectory, "ab", is planted as a symlink leading outside
LINK_NAMED = 4 + 512  # its file's name in subdirectory "04" is planted as a symlink


def entry_name(i: int) -> str:
    return key_of(i).hex() + ".entry"


def plant_foreign(tier_dir: Path, outside: Path) -> dict[Path, bytes]:
    """Beside a tier's entries (``tier_dir/04`` one of its subdirectories), what the tier
    did not write: a README; "ab", a symlink leading outside; a symlink named like an entry;
    a file of another name in "04"; entry-named files in a folder the tier does not use and
    in a subdirectory of another key's digits. Returns each file with what it must read."""
    outside.mkdir()
    (outside / entry_name(LINKED)).write_bytes(b"not an entry: reached only through a link")
    (outside / "data.txt").write_bytes(b"someone's data")
    (outside / "target").write_bytes(b"a symlink's target")
    (tier_dir / "ab").symlink_to(outside, target_is_directory=True)
    (tier_dir / "04" / entry_name(LINK_NAMED)).symlink_to(outside / "target")
    (tier_dir / "zz").mkdir()
    planted = {
        tier_dir / "README": b"read me",
        tier_dir / "04" / "notes.txt": b"notes",
        tier_dir / "zz" / entry_name(7): b"in a folder the tier does not use",
        tier_dir / "04" / entry_name(5): b"in another key's subdirectory",
    }
    for path, data in planted.items():
        path.write_bytes(data)
    return {**planted, **{path: path.read_bytes() for path in outside.iterdir()}}


def unchanged(planted: dict[Path, bytes]) -> bool:
    return all(path.read_bytes() == data for path, data in planted.items())


def test_what_the_tier_did_not_write_is_left_alone_and_never_followed(tmp_path, caplog) -> None:
    tier_dir, outside = tmp_path / "tier", tmp_path / "outside"
    data = put(DiskTier(tier_dir, 64 << 20), 4, 5000)
    planted = plant_foreign(tier_dir, outside)
    with caplog.at_level("WARNING", logger="chunkstore.daemon.disk"):
        again = DiskTier(tier_dir, 64 << 20)
    assert again.lru_order() == [key_of(4)] and np.array_equal(read(again, 4), data)
    assert again.removed_at_start == [] and unchanged(planted)
    assert (tier_dir / "ab").is_symlink() and (
        tier_dir / "04" / entry_name(LINK_NAMED)
    ).is_symlink()
    foreign = ["README", "ab", "zz", "notes.txt", entry_name(5), entry_name(LINK_NAMED)]
    assert sorted(p.name for p in again.foreign) == sorted(foreign)
    [warning] = [r.getMessage() for r in caplog.records]  # once, with a count and an example
    assert "left alone 6 files or folders" in warning and str(again.foreign[0]) in warning
    # Writes never go through them: not into the linked folder, not over the link.
    for i in (LINKED, LINK_NAMED):
        with pytest.raises(DiskError, match="not the tier's own"):
            put(again, i, 1000)
    assert unchanged(planted) and len(again) == 1 and again.used == HEADER + 5000
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        [entry_name(LINKED), "data.txt", "target"]
    )


@pytest.mark.parametrize("umask", [0o000, 0o277], ids=["umask-000", "umask-277"])
def test_what_the_tier_makes_is_its_users_alone_whatever_the_umask(tmp_path, umask) -> None:
    """Directories 0700 and files 0600: a umask of 0 would make them world-writable, one of
    0277 unwritable (mkdir's and open's modes go through it; the tier sets them after)."""
    where = tmp_path / "made" / "tier"
    old = os.umask(umask)
    try:
        tier = DiskTier(where, 64 << 20)
        put(tier, 1, 5000)
        put(tier, 2, 3 * 4096, cuts=1)  # whole pages: O_DIRECT where the file system takes it
    finally:
        os.umask(old)
    made = [tmp_path / "made", where, *where.glob("*/")]
    assert {stat.S_IMODE(p.stat().st_mode) for p in made} == {0o700} and len(made) == 4
    files = [where / MARKER, *where.glob("*/*")]
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600} and len(files) == 3
    assert "chunkstore disk tier" in (where / MARKER).read_text()
    assert foreign_top_level(where) == [] and foreign_top_level(tmp_path / "none") == []


def test_a_changed_body_is_refused_and_the_entry_removed(tmp_path) -> None:
    tier = DiskTier(tmp_path, 64 << 20)
    put(tier, 1, 2_500_000)
    data2 = put(tier, 2, 1000)
    path = tier.lookup(key_of(1)).path  # type: ignore[union-attr]
    with path.open("r+b") as f:
        f.seek(HEADER + 1_700_000)
        byte = f.read(1)
        f.seek(HEADER + 1_700_000)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumMismatch):
        read(tier, 1)
    assert key_of(1) not in tier and not path.exists()
    assert tier.used == HEADER + 1000
    with pytest.raises(NotFound):
        tier.read_into(key_of(1), np.empty(2_500_000, np.uint8))
    # cut short after the start-up check: refused at its first read, and removed
    path2 = tier.lookup(key_of(2)).path  # type: ignore[union-attr]
    with path2.open("r+b") as f:
        f.truncate(HEADER + 10)
    with pytest.raises(ChecksumMismatch):
        tier.read_into(key_of(2), np.empty(len(data2), np.uint8))
    assert len(tier) == 0 and not path2.exists()


def test_the_least_recently_used_entries_make_room(tmp_path) -> None:
    size = HEADER + 100_000
    tier = DiskTier(tmp_path, 3 * size)
    for i in range(3):
        put(tier, i, 100_000)
    tier.lookup(key_of(0))  # used: 1 is now the oldest
    assert tier.write(key_of(3), LAYOUT, [body_of(3, 100_000)], 0) == [key_of(1)]
    assert tier.lru_order() == [key_of(2), key_of(0), key_of(3)]
    assert not any(key_of(1).hex() in p.name for p in tmp_path.glob("*/*"))
    assert tier.write(key_of(0), LAYOUT, [body_of(0, 100_000)], 0) == []  # held already
    with pytest.raises(InvalidRequest):
        tier.write(key_of(9), LAYOUT, [body_of(9, 3 * size)], 0)
    assert tier.used == 3 * size


def test_a_full_disk_is_a_typed_error_and_leaves_the_tier_as_it_was(small_disk) -> None:
    tier = DiskTier(small_disk, 64 << 20)  # a budget larger than the device
    data = put(tier, 1, 400_000)
    with pytest.raises(DiskError) as err:
        put(tier, 2, 900_000)
    assert err.value.errno == 28  # ENOSPC
    assert tier.lru_order() == [key_of(1)] and tier.used == HEADER + 400_000
    assert [p.name for p in small_disk.glob("*/*")] == [key_of(1).hex() + ".entry"]  # no tmp
    assert np.array_equal(read(tier, 1), data)
    put(tier, 3, 100_000)  # room is still usable
    assert len(tier) == 2


WRITER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from daemon.test_disk import put
from chunkstore.daemon.disk import DiskTier
tier = DiskTier({where!r}, {capacity})
i = {start}
while True:
    put(tier, i, 200_000 + 7919 * (i % 50))
    print(i, flush=True)
    i += 1
"""


def test_a_kill_in_the_middle_of_writes_leaves_nothing_that_reads_wrong(tmp_path) -> None:
    """A writer process is killed (SIGKILL) at a different moment 8 times; after each, a new
    tier on the directory serves only whole entries, byte-exact, and leaves no stray file."""
    tests = str(Path(__file__).resolve().parents[1])
    capacity = 40 * (HEADER + 600_000)  # small enough that writes also evict
    start = 0
    for round_ in range(8):
        code = WRITER.format(tests=tests, where=str(tmp_path), capacity=capacity, start=start)
        writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None
        for _ in range(3 + round_):  # a few whole writes, then a kill at some point of another
            assert writer.stdout.readline(), "the writer died on its own"
        time.sleep(0.003 * round_)
        writer.send_signal(signal.SIGKILL)
        written = [int(line) for line in writer.stdout.read().split()]
        writer.wait()
        tier = DiskTier(tmp_path, capacity)
        assert tier.used <= capacity
        assert not [p for p in tmp_path.glob("*/*") if not p.name.endswith(".entry")]
        for key in tier.lru_order():
            i = int.from_bytes(key[:4], "little")
            assert np.array_equal(read(tier, i), body_of(i, 200_000 + 7919 * (i % 50)))
        start = max([start, *written]) + 10
    assert len(tier) > 0


def test_past_the_high_watermark_a_write_evicts_down_to_the_low_one(tmp_path) -> None:
    size = HEADER + 1000
    tier = DiskTier(tmp_path, 10 * size, high_watermark=0.8, low_watermark=0.5)
    for i in range(8):
        assert put(tier, i, 1000) is not None
    assert len(tier) == 8  # at 80%: not past it
    put(tier, 8, 1000)  # 90%: down to 50%, the newest kept
    assert tier.lru_order() == [key_of(i) for i in range(4, 9)] and tier.used == 5 * size
    assert sorted(p.name for p in tmp_path.glob("*/*")) == sorted(
        key_of(i).hex() + ".entry" for i in range(4, 9)
    )


def test_a_tenants_disk_quota_evicts_its_own_entries_only(tmp_path) -> None:
    """Per-tenant disk quotas: past its quota a tenant's spill evicts its own least recently
    used files, never another tenant's; an entry larger than its quota is not written (it
    stays in memory); a tenant without a quota is bounded by the tier alone."""
    nbytes = 1000
    tier = DiskTier(tmp_path / "tier", 100 * (HEADER + nbytes))
    tier.quotas = {"alice": 3 * (HEADER + nbytes)}

    def write(i: int, tenant: str) -> list[bytes]:
        data = body_of(i, nbytes)
        return tier.write(key_of(i), LAYOUT, [data], checksum(data), tenant)

    for i in range(4):
        assert write(100 + i, "bob") == []
    for i in range(5):
        write(i, "alice")
    alice = [e.key for e in tier._entries.values() if e.tenant == "alice"]
    assert alice == [key_of(2), key_of(3), key_of(4)]  # the oldest two went
    assert all(key_of(100 + i) in tier for i in range(4))  # bob's untouched
    assert tier.used_by["alice"] == 3 * (HEADER + nbytes) and tier.used_by["bob"] == 4 * (
        HEADER + nbytes
    )
    big = body_of(9, 3 * (HEADER + nbytes))
    with pytest.raises(DiskError, match="disk quota"):
        tier.write(key_of(9), LAYOUT, [big], checksum(big), "alice")
    assert key_of(9) not in tier and tier.used_by["alice"] == 3 * (HEADER + nbytes)
    for i in range(3):
        assert (read(tier, 2 + i) == body_of(2 + i, nbytes)).all()
