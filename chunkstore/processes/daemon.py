"""Start a real ``chunkstore serve`` process on free ports, for benches and tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNIX_PATH_MAX = 107  # sun_path's 108 bytes, its terminating NUL left out
MEMORY_POOL_BYTES = 64 << 20  # pools from this size up go in /dev/shm (serve_command)
MEMORY_HEADROOM = 4 << 30  # memory left beside such a pool, for the vLLM a test starts
SHM = Path("/dev/shm")  # where a node keeps its pool: memory, mapped by its clients


@dataclass
class RunningDaemon:
    process: subprocess.Popen[str]
    ready: dict[str, Any]
    workdir: Path

    @property
    def unix(self) -> str:
        return f"unix:{self.ready['socket']}"

    @property
    def tcp(self) -> str:
        return str(self.ready["tcp"])

    @property
    def metrics_url(self) -> str:
        return f"http://{self.ready['metrics']}/metrics"

    def __enter__(self) -> RunningDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills it if it will not stop, after a
        SIGUSR1 has had it write every thread's stack to its log). The pool file a killed
        daemon leaves is removed: in /dev/shm it would hold memory."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGUSR1)  # faulthandler's, in C: no GIL
                time.sleep(2.0)
                self.process.kill()
                self.process.wait()
        if self.ready.get("shm_path"):
            Path(self.ready["shm_path"]).unlink(missing_ok=True)
        return int(self.process.returncode)

    def scrape(self) -> dict[str, float]:
        """The daemon's /metrics as {'name{labels}': value}, the node label left out (and
        checked to be on every series)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        values = {}
        node = f'node="{self.ready["node"]}"'
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                assert node in name, f"{name} lacks its node label"
                base, _, labels = name.partition("{")
                rest = [x for x in labels.rstrip("}").split(",") if x and x != node]
                values[base + ("{" + ",".join(rest) + "}" if rest else "")] = float(value)
        return values

    def rss_kib(self) -> int:
        """The daemon process's resident memory, KiB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return next(int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS:"))

    def settled_rss_kib(self, within_kib: int = 256, timeout: float = 15.0) -> int:
        """The resident memory once it stops moving (two readings 0.25 s apart within
        ``within_kib``): what a growth is measured from. A started pool loads its numba
        kernel in a thread (~10 MiB, up to seconds on a busy host)."""
        deadline, last = time.monotonic() + timeout, self.rss_kib()
        while True:
            time.sleep(0.25)
            now = self.rss_kib()
            if abs(now - last) <= within_kib or time.monotonic() > deadline:
                return now
            last = now

    def log(self) -> str:
        path = self.workdir / "daemon.log"
        return path.read_text() if path.exists() else ""


def serve_command(
    workdir: Path,
    *args: str,
    pool_bytes: int = 64 << 20,
    block_size: int = 1 << 16,
    launcher: tuple[str, ...] = ("chunkstore.cli",),
    shm_dir: Path | None = None,
) -> list[str]:
    """``chunkstore serve`` on free loopback ports with its socket and pool in ``workdir``
    (the socket in a new private directory under /tmp where ``workdir`` is too deep for a
    unix socket's path, as a test's temporary directory can be); ``args`` come last, so they
    override any of these. The pool goes in ``shm_dir`` if given, else, from
    ``MEMORY_POOL_BYTES`` up, in /dev/shm where memory can hold it (``memory_dir``): a pool is
    preallocated, and on a disk a few such pools can take the last GiB a CI machine has left
    (they did). Smaller pools stay in ``workdir``, beside the files tests look at.
    ``launcher``: the module (and its own flags) that runs ``serve``, e.g.
    ``("chunkstore.testing.dying_daemon", "--die-on", "Read", "--armed-by", path)``."""
    if shm_dir is None and pool_bytes >= MEMORY_POOL_BYTES:
        shm_dir = memory_dir(pool_bytes)
    return [
        sys.executable,
        "-m",
        *launcher,
        "serve",
        "--socket",
        str(socket_path(workdir)),
        "--tcp",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
        "--shm-dir",
        str(shm_dir or workdir),
        "--pool-bytes",
        str(pool_bytes),
        "--block-size",
        str(block_size),
        *args,
    ]


def socket_path(workdir: Path) -> Path:
    """Where a daemon in ``workdir`` listens: ``workdir/chunkstore.sock``, unless that path
    (and the fast path's, ``.fast`` after it) exceeds a unix socket's 107 bytes."""
    path = workdir / "chunkstore.sock"
    if len(os.fsencode(f"{path}.fast")) <= UNIX_PATH_MAX:
        return path
    return Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp")) / "chunkstore.sock"


def memory_dir(nbytes: int) -> Path | None:
    """/dev/shm when it can hold a pool of ``nbytes`` (``pool_room``) with ``MEMORY_HEADROOM``
    of memory left for the vLLM a test starts beside it: where a deployed daemon keeps its pool
    (the default ``--shm-dir``), so a bench reads memory, not a file of a disk's page cache (a
    test's temporary directory may be either). None where it cannot."""
    if pool_room(nbytes):
        return None
    available = _memory_available()
    return SHM if available is None or available > nbytes + MEMORY_HEADROOM else None


def pool_room(nbytes: int, directory: Path = SHM) -> str:
    """Why a pool of ``nbytes`` cannot be kept in ``directory`` (shared memory), '' where it
    can: the directory missing or read-only, its free space short of the pool, or the memory
    available (/proc/meminfo) short of it (the daemon takes the pool's pages at start)."""
    try:
        free = os.statvfs(directory)
    except OSError as err:
        return f"{directory} cannot hold it: {err.strerror or err}"
    if not os.access(directory, os.W_OK):
        return f"{directory} is not writable by this user"
    room = free.f_bavail * free.f_frsize
    if room < nbytes:
        return f"{directory} has {_mib(room)} free, the pool needs {_mib(nbytes)}"
    available = _memory_available()
    if available is not None and available < nbytes:
        return f"the memory available is {_mib(available)}, the pool needs {_mib(nbytes)}"
    return ""


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB"


def _memory_available() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def serve_env() -> dict[str, str]:
    """The caller's environment without CHUNKSTORE_* settings, which would override flags."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_")}


def start_daemon(
    workdir: Path,
    *args: str,
    pool_bytes: int = 64 << 20,
    block_size: int = 1 << 16,
    timeout: float = 60.0,
    launcher: tuple[str, ...] = ("chunkstore.cli",),
    shm_dir: Path | None = None,
    own_session: bool = False,
) -> RunningDaemon:
    """Start ``serve_command`` and wait for its ready line (its log: ``workdir/daemon.log``).
    ``own_session``: not in the caller's process group (a terminal's Ctrl-C goes to the
    caller alone, which stops it in its turn). Tests use the ``serve`` fixture
    (tests/conftest.py), which stops what it started."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = serve_command(
        workdir,
        *args,
        pool_bytes=pool_bytes,
        block_size=block_size,
        launcher=launcher,
        shm_dir=shm_dir,
    )
    log = (workdir / "daemon.log").open("w")
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=serve_env(),
        start_new_session=own_session,
    )
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    ready = None
    try:
        while ready is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            said = json.loads(line) if line.startswith("{") else {}
            ready = said if said.get("event") == "ready" else None
    finally:  # not ready, or a signal's exception while it starts: nothing left running
        if ready is None:
            process.kill()
            process.wait()
    if ready is not None:
        return RunningDaemon(process, ready, workdir)
    raise RuntimeError(
        f"chunkstore serve did not become ready: {(workdir / 'daemon.log').read_text()}"
    )
