"""The disk tier's files: one entry per file, under a directory the daemon owns (issue 32).

The on-disk half (format, crash consistency, its own LRU and byte budget). The index
queues every committed entry for the daemon's spill thread, which writes it here; a memory
miss this tier holds is read back into the pool (``Index.acquire``).

A file is a 4 KiB header, then the entry's bytes (at 4 KiB, where a direct read can land):

    magic "CSDISK01" | header length u32 | key | nbytes u64 | checksum u64 |
    layout (EntryLayout protobuf) | xxh3-64 of everything before it

``checksum`` is the pool's (``shm.EntryDigest``) of the entry's bytes, so an entry read back
is checked exactly as a pool read is. A file appears under its name only once whole: it is
written as ``<name>.tmp-<random>``, flushed to the device, then renamed. So after a kill -9
at any moment, what ``DiskTier`` finds at start is either a whole entry or a leftover to
remove (a temporary file; a header that does not check out; a size that is not header +
nbytes); a body changed after that fails its checksum on the read that finds it, and the
file goes then. An I/O error is raised as ``DiskError`` and leaves the tier as it was.

The tier touches its own names only, so that a ``--disk-dir`` given by mistake loses nothing:
a marker file (``MARKER``), subdirectories of two hex digits, and in each the files
``<key hex>.entry`` (and their temporaries) whose key starts with those two digits. Anything
else (a README, a symlink, even one named like an entry) is never read, followed, renamed
over or removed: it is listed in ``DiskTier.foreign`` and logged once. What the tier makes is
its user's alone: directories 0700, files 0600, whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from chunkstore.errors import ChecksumMismatch, ChunkStoreError, InvalidRequest, NotFound
from chunkstore.kv.entry import EntryLayout
from chunkstore.kv.keys import KEY_BYTES
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.convert import layout_from_proto, layout_to_proto
from chunkstore.protocol.shm import EntryDigest, Pieces

MAGIC = b"CSDISK01"
HEADER = 4096  # the body starts here: aligned for direct I/O
_FIXED = struct.Struct(f"<8sI{KEY_BYTES}sQQ")  # magic, header length, key, nbytes, checksum
_IOV_MAX = 512  # buffers per preadv / pwritev call (Linux allows 1024)
SUFFIX = ".entry"
NAMESPACE_SECRET = "namespace.secret"  # tenants.namespace_secret's key, kept with the entries
MARKER = "chunkstore-disk-tier"  # says, to a person and to a later start, whose directory it is
_MARKER_TEXT = (
    b"This directory is a chunkstore disk tier (chunkstore serve --disk-dir). The daemon\n"
    b"reads, writes and removes <2 hex>/<32 hex>.entry files here, and nothing else.\n"
)
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_FILE = re.compile(rf"([0-9a-f]{{{2 * KEY_BYTES}}}){re.escape(SUFFIX)}(\.tmp-[0-9a-f]{{8}})?")
DIR_MODE = 0o700
FILE_MODE = 0o600

log = logging.getLogger(__name__)


class DiskError(ChunkStoreError):
    """The disk tier could not write or read a file (disk full, read-only, gone, I/O
    error): ``errno`` says which. Nothing else in the tier changed."""

    def __init__(self, what: str, err: OSError) -> None:
        self.errno = err.errno
        super().__init__(f"disk tier: {what}: {err.strerror or err}")


@dataclass
class DiskEntry:
    key: bytes
    layout: EntryLayout
    nbytes: int
    checksum: int
    path: Path
    tenant: str = ""  # whose namespace (tenants.py); "" shared

    @property
    def file_bytes(self) -> int:
        return HEADER + self.nbytes


def encode_header(
    key: bytes, layout: EntryLayout, nbytes: int, checksum: int, tenant: str = ""
) -> bytes:
    """The fixed fields, the layout (length-prefixed), the tenant's name where it has one
    (length-prefixed: a header without it is the shared namespace's), and their digest."""
    body = layout_to_proto(layout).SerializeToString()
    if tenant:
        name = tenant.encode()
        body = struct.pack("<I", len(body)) + body + struct.pack("<I", len(name)) + name
    else:
        body = struct.pack("<I", len(body)) + body
    length = _FIXED.size + len(body) + 8
    if length > HEADER:
        raise InvalidRequest(f"an entry layout of {len(body)} bytes does not fit a disk header")
    head = _FIXED.pack(MAGIC, length, key, nbytes, checksum) + body
    return (head + xxhash.xxh3_64_digest(head)).ljust(HEADER, b"\0")


def decode_header(data: bytes) -> tuple[bytes, EntryLayout, int, int, str] | None:
    """(key, layout, nbytes, checksum, tenant), or None where the header is not a whole
    one."""
    if len(data) < _FIXED.size + 12 or not data.startswith(MAGIC):
        return None
    _, length, key, nbytes, checksum = _FIXED.unpack_from(data)
    if length > HEADER or length > len(data):
        return None
    head, digest = data[: length - 8], data[length - 8 : length]
    if xxhash.xxh3_64_digest(head) != digest:
        return None
    (size,) = struct.unpack_from("<I", data, _FIXED.size)
    end = _FIXED.size + 4 + size
    tenant = ""
    if end + 4 <= len(head):
        (name,) = struct.unpack_from("<I", head, end)
        if end + 4 + name != len(head):
            return None
        tenant = head[end + 4 :].decode(errors="replace")
    elif end != len(head):
        return None
    msg = pb.EntryLayout()
    msg.ParseFromString(head[_FIXED.size + 4 : end])
    return key, layout_from_proto(msg), nbytes, checksum, tenant


class DiskTier:
    """Entries on disk, by key, with an LRU of their own within ``capacity`` bytes (file
    bytes, headers included; a write takes its room before it starts, and one that leaves
    the tier past ``high_watermark`` of it evicts down to ``low_watermark``). At start it finds
    what a previous daemon left (oldest first in the LRU, by modification time) and removes
    what of its own cannot be read; what is not its own it leaves alone (``foreign``). The
    lock guards the index only: files are written and read outside it, so a lookup never
    waits for the disk; a write blocks its caller, so one that must not wait (a Reserve)
    hands it to a thread of its own."""

    def __init__(
        self,
        directory: str | Path,
        capacity: int,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
    ) -> None:
        if capacity < HEADER:
            raise InvalidRequest(f"a disk tier of {capacity} bytes cannot hold one entry")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise InvalidRequest("watermarks need 0 < low <= high <= 1")
        self.directory = Path(directory)
        self.capacity = capacity
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.used = 0
        self.used_by: Counter[str] = Counter()  # file bytes by tenant, writes in flight too
        self.quotas: dict[str, int] = {}  # tenant -> file bytes it may hold (absent: no limit)
        self.removed_at_start: list[Path] = []
        self.foreign: list[Path] = []  # what the directory holds that the tier did not write
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()
        self._writing: set[bytes] = set()  # keys whose files are being written
        self._lock = threading.Lock()
        try:
            _make_directories(self.directory)
            _write_marker(self.directory / MARKER)
            own = self._own_files()
        except OSError as err:
            raise DiskError(f"cannot use {self.directory}", err) from err
        self._scan(own)
        if self.foreign:
            log.warning(
                "disk tier %s: left alone %d files or folders it did not write (e.g. %s)",
                self.directory,
                len(self.foreign),
                self.foreign[0],
            )

    # Start-up ------------------------------------------------------------------------------

    def _own_files(self) -> list[Path]:
        """The tier's files, one level down; what else the directory holds goes to
        ``foreign``, not looked into (symlinks are never followed)."""
        own: list[Path] = []
        with os.scandir(self.directory) as top:
            for sub in top:
                if _is_kept(sub):
                    continue
                if not _is_own_subdir(sub):
                    self.foreign.append(Path(sub.path))
                    continue
                with contextlib.suppress(OSError), os.scandir(sub.path) as files:
                    for file in files:
                        listed = own if _is_own_file(sub.name, file) else self.foreign
                        listed.append(Path(file.path))
        return own

    def _scan(self, own: list[Path]) -> None:
        found: list[tuple[float, DiskEntry]] = []
        for path in own:
            entry = self._open_file(path) if path.name.endswith(SUFFIX) else None
            if entry is None:
                self._remove_leftover(path)
                continue
            found.append((path.lstat().st_mtime, entry))
        for _, entry in sorted(found, key=lambda pair: pair[0]):
            self._entries[entry.key] = entry  # one path per key: no two files for one
            self.used += entry.file_bytes
            self.used_by[entry.tenant] += entry.file_bytes
        while self.used > self.capacity and self._entries:  # the budget shrank since
            self._drop(next(iter(self._entries.values())))

    def _open_file(self, path: Path) -> DiskEntry | None:
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                header = f.read(HEADER)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return None
        decoded = decode_header(header)
        if decoded is None:
            return None
        key, layout, nbytes, checksum, tenant = decoded
        if size != HEADER + nbytes or path != self._path(key):
            return None
        return DiskEntry(key, layout, nbytes, checksum, path, tenant)

    def _remove_leftover(self, path: Path) -> None:
        """One of the tier's own files (``_own_files``), torn or stray."""
        try:
            path.unlink()
            self.removed_at_start.append(path)
        except OSError:
            pass  # a file we cannot remove is left alone; it is not in the index

    def _path(self, key: bytes) -> Path:
        return self.directory / key.hex()[:2] / _name(key)

    # Queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, key: bytes) -> DiskEntry | None:
        """The entry, made the most recently used; None where the tier lacks it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def keys(self) -> set[bytes]:
        with self._lock:
            return set(self._entries)

    def lru_order(self) -> list[bytes]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._entries)

    # Writes --------------------------------------------------------------------------------

    def write(
        self,
        key: bytes,
        layout: EntryLayout,
        parts: Sequence[np.ndarray],
        checksum: int,
        tenant: str = "",
    ) -> list[bytes]:
        """Store ``tenant``'s entry whose bytes are ``parts`` (uint8 arrays, in order: e.g. its pool
        blocks), evicting this tier's least recently used entries for room first; the keys
        it evicted. The bytes are not hashed here: ``checksum`` is the pool's, checked on
        every read. An entry the tier holds, or is writing, is left as it is. The file is
        written outside the lock: lookups and reads of other entries go on meanwhile."""
        nbytes = sum(int(part.nbytes) for part in parts)
        size = HEADER + nbytes
        if len(key) != KEY_BYTES:
            raise InvalidRequest(f"keys are {KEY_BYTES} bytes, not {len(key)}")
        if size > self.capacity:
            raise InvalidRequest(f"an entry of {nbytes} bytes is larger than the disk tier")
        with self._lock:
            if key in self._entries or key in self._writing:
                return []
            evicted = self._fit_quota(tenant, size)
            while self.used + size > self.capacity and self._entries:
                victim = next(iter(self._entries.values()))
                self._drop(victim)
                evicted.append(victim.key)
            if self.used + size > self.capacity:  # the rest is being written
                raise DiskError("no room", OSError(errno.ENOSPC, "the tier is full of writes"))
            self.used += size
            self.used_by[tenant] += size
            self._writing.add(key)
        path = self._path(key)
        temporary = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
        try:
            _make_subdir(path.parent)
            header = encode_header(key, layout, nbytes, checksum, tenant)
            _write_file(temporary, header, parts)
            _refuse_foreign(path)
            os.rename(temporary, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
            with self._lock:
                self.used -= size
                self.used_by[tenant] -= size
                self._writing.discard(key)
            raise DiskError(f"cannot write {path.name}", err) from err
        with self._lock:
            self._writing.discard(key)
            self._entries[key] = DiskEntry(key, layout, nbytes, checksum, path, tenant)
            if self.used > self.high_watermark * self.capacity:  # room ahead of the next writes
                while self.used > self.low_watermark * self.capacity and len(self._entries) > 1:
                    victim = next(iter(self._entries.values()))
                    self._drop(victim)
                    evicted.append(victim.key)
        return evicted

    def remove(self, key: bytes) -> bool:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._drop(entry)
            return entry is not None

    def _fit_quota(self, tenant: str, size: int) -> list[bytes]:
        """Room within ``tenant``'s disk quota for a file of ``size``: its own least recently
        used entries go first (nobody else's); the keys evicted. DiskError where its quota
        cannot hold the file (the entry stays in memory only)."""
        quota = self.quotas.get(tenant, 0)
        if not quota:
            return []
        if size > quota:
            raise DiskError(
                "over quota", OSError(errno.EDQUOT, f"tenant {tenant}'s disk quota is {quota}")
            )
        evicted = []
        while self.used_by[tenant] + size > quota:
            victim = next((e for e in self._entries.values() if e.tenant == tenant), None)
            if victim is None:  # the rest is being written
                raise DiskError("over quota", OSError(errno.EDQUOT, f"tenant {tenant}'s writes"))
            self._drop(victim)
            evicted.append(victim.key)
        return evicted

    def _drop(self, entry: DiskEntry) -> None:
        """Out of the index and off the disk (a read that has the file open finishes it)."""
        del self._entries[entry.key]
        self.used -= entry.file_bytes
        self.used_by[entry.tenant] -= entry.file_bytes
        with contextlib.suppress(OSError):
            entry.path.unlink(missing_ok=True)

    def _drop_if_current(self, entry: DiskEntry) -> None:
        with self._lock:
            if self._entries.get(entry.key) is entry:
                self._drop(entry)

    # Reads ---------------------------------------------------------------------------------

    def read_into(self, key: bytes, out: np.ndarray | Pieces) -> DiskEntry:
        """Copy the entry's bytes into ``out`` (uint8, its length, or its Pieces) and check
        them: ``NotFound`` where the tier lacks it (or its file went: evicted meanwhile);
        ``ChecksumMismatch`` where its bytes changed on disk or the file was cut short (the
        entry is removed; ``out`` holds garbage); ``DiskError`` for an I/O error (the entry
        stays: the next read may succeed). Read outside the lock."""
        entry = self.lookup(key)
        if entry is None:
            raise NotFound(f"no entry {key.hex()} on disk")
        parts = out.parts if isinstance(out, Pieces) else [out]
        if sum(int(part.nbytes) for part in parts) != entry.nbytes:
            raise InvalidRequest(f"entry {key.hex()} is {entry.nbytes} bytes")
        try:
            whole = _read_file(entry.path, parts)
        except FileNotFoundError:
            self._drop_if_current(entry)
            raise NotFound(f"entry {key.hex()}'s file is gone") from None
        except OSError as err:
            raise DiskError(f"cannot read {entry.path.name}", err) from err
        digest = EntryDigest()
        for part in parts:
            digest.update(part)
        if not whole or digest.intdigest() != entry.checksum:
            self._drop_if_current(entry)
            raise ChecksumMismatch(f"entry {key.hex()} changed on disk; removed")
        return entry


def _name(key: bytes) -> str:
    return key.hex() + SUFFIX


def _is_own_subdir(sub: os.DirEntry[str]) -> bool:
    return bool(_SUBDIR.fullmatch(sub.name)) and sub.is_dir(follow_symlinks=False)


def _is_own_file(subdir: str, file: os.DirEntry[str]) -> bool:
    """A regular file named as the tier names an entry (or its temporary) of a key that
    starts with ``subdir``'s two digits."""
    named = _FILE.fullmatch(file.name)
    return named is not None and named[1][:2] == subdir and file.is_file(follow_symlinks=False)


def foreign_top_level(directory: Path) -> list[Path]:
    """What ``directory`` holds at its top level that is not the tier's (its subdirectories
    and marker); empty where it does not exist. Serve refuses a ``--disk-dir`` that holds
    any unless told otherwise: pointed at the wrong directory, the tier would mix its files
    with someone else's."""
    try:
        with os.scandir(directory) as top:
            return sorted(
                Path(sub.path) for sub in top if not _is_own_subdir(sub) and not _is_kept(sub)
            )
    except FileNotFoundError:
        return []
    except OSError as err:
        raise DiskError(f"cannot use {directory}", err) from err


def _make_directories(directory: Path) -> None:
    """``directory`` and its missing parents, each 0700 (chmod after mkdir: mkdir's mode
    goes through the umask); one that exists is left as it is."""
    missing = []
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        _make_subdir(path)


def _make_subdir(path: Path) -> None:
    """A directory of the tier's, made 0700 where missing. Where its name is taken by what
    the tier did not make (a symlink, a file), an error: it never writes through them."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OSError(errno.ENOTDIR, f"{path.name} is not the tier's own directory") from None
        return
    os.chmod(path, DIR_MODE)


def _write_marker(path: Path) -> None:
    """The marker, once (a marker that cannot be written costs nothing but the note)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    except OSError:
        return  # there already (or a read-only directory: writes will say so)
    try:
        os.fchmod(fd, FILE_MODE)
        os.write(fd, _MARKER_TEXT)
    finally:
        os.close(fd)


def _refuse_foreign(path: Path) -> None:
    """Refuse to rename a file over ``path`` where something the tier did not write (a
    symlink, a directory) holds its name."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise OSError(errno.EEXIST, f"{path.name} is taken by what is not the tier's own")


def _write_file(path: Path, header: bytes, parts: Sequence[np.ndarray]) -> None:
    """Write the file whole and flush it to the device before it is renamed into view: a
    crash leaves a temporary file or a whole one, never a named torn one. Where the bytes lie
    aligned (pool blocks of a multiple of 4 KiB) they go straight from the pool to the
    device (``O_DIRECT``: no copy into the page cache, nothing to evict from it after);
    elsewhere, or on a file system without direct I/O (tmpfs), through the page cache, whose
    pages are dropped after the flush (entries are read back into the pool, never twice)."""
    if all(_aligned(part) for part in parts):
        try:
            _write_direct(path, header, parts)
            return
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            with contextlib.suppress(OSError):
                path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        _pwrite_all(fd, [memoryview(header), *(part.data.cast("B") for part in parts)], 0)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


ALIGN = 4096  # direct I/O's unit for addresses, lengths and offsets


def _aligned(part: np.ndarray) -> bool:
    return int(part.ctypes.data) % ALIGN == 0


def _write_direct(path: Path, header: bytes, parts: Sequence[np.ndarray]) -> None:
    """The header and every whole 4 KiB of the body with ``O_DIRECT`` (the parts start
    aligned, and all but the last are whole 4 KiB), the last part's tail (under 4 KiB)
    through the page cache, then one flush of both."""
    head = mmap.mmap(-1, HEADER)  # page-aligned memory for the header
    head[:] = header
    views = [memoryview(head), *(part.data.cast("B") for part in parts)]
    last = views[-1]
    cut = len(last) - len(last) % ALIGN
    if any(len(view) % ALIGN for view in views[:-1]):
        raise OSError(errno.EINVAL, "a part that is not whole 4 KiB")
    views[-1], tail = last[:cut], last[cut:]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        body_end = _pwrite_all(fd, [view for view in views if len(view)], 0)
        if len(tail):
            with open(path, "r+b", buffering=0) as buffered:
                _pwrite_all(buffered.fileno(), [tail], body_end)
                os.posix_fadvise(buffered.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.fdatasync(fd)
    finally:
        os.close(fd)  # (the header's map goes with its last view)


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Write ``views`` from ``offset`` on, whatever short writes happen; the end offset."""
    for at in range(0, len(views), _IOV_MAX):
        batch = views[at : at + _IOV_MAX]
        while batch:
            done = os.pwritev(fd, batch, offset)
            offset += done
            batch = _advance(batch, done)
    return offset


def _read_file(path: Path, parts: Sequence[np.ndarray]) -> bool:
    """Fill ``parts`` from the file's body; False where the file ends before they are full."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        views = [part.data.cast("B") for part in parts]
        offset = HEADER
        for at in range(0, len(views), _IOV_MAX):
            batch = views[at : at + _IOV_MAX]
            while batch:
                done = os.preadv(fd, batch, offset)
                if done == 0:
                    return False
                offset += done
                batch = _advance(batch, done)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The buffers left after a short read or write of ``done`` bytes."""
    while views and done >= len(views[0]):
        done -= len(views[0])
        views = views[1:]
    if views and done:
        views = [views[0][done:], *views[1:]]
    return views


def _is_kept(sub: os.DirEntry[str]) -> bool:
    """The files the tier keeps beside its entries: its marker and the namespace secret."""
    return sub.name in (MARKER, NAMESPACE_SECRET) and sub.is_file(follow_symlinks=False)
