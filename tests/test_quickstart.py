"""The README's quickstart, run as a new user runs it: its shell block pasted whole into bash
in the repository. `make serve` (chunkstore up) starts the daemon, vLLM with the connector and
the router; the stock openai client asks twice over the same documents; `kill %1` stops it
all. It must finish, the second request must load the documents from the store, and nothing
it started may be left: no process, socket, folder or shared-memory pool."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from chunkstore.processes.vllm_server import stop_group

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


def quickstart() -> str:
    """The first ```sh block under "## Quickstart" in README.md, as written."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quickstart\n", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, "README: no shell block under ## Quickstart"
    return match.group(1)


def left_behind() -> tuple[set[str], set[str], list[str]]:
    """What `chunkstore up` leaves if it leaves anything: its folders, pools and processes
    (each names its folder, chunkstore-up-*, in its command line)."""
    folders = {p.name for p in Path("/tmp").glob("chunkstore-up-*")}
    # A pool is chunkstore-<tenant>-<daemon's pid>-...: one whose daemon is gone is left.
    pools = {p.name for p in SHM.glob("chunkstore-*") if not _alive(p.name.split("-")[2])}
    found = subprocess.run(["pgrep", "-af", "chunkstore-up-"], capture_output=True, text=True)
    return folders, pools, found.stdout.splitlines()


def _alive(pid: str) -> bool:
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


@dataclass
class DaemonFacts:
    tcp: list[str]  # the TCP ports it listens on, as /proc/net/tcp{,6} write them
    unix: list[str]  # the unix socket paths it listens on
    modes: dict[str, int]  # theirs and their folder's permission bits
    pools: list[str]  # the pool files it maps


def daemon_facts(up_pid: int) -> DaemonFacts:
    """What others on the host can reach of the daemon `chunkstore up` (``up_pid``) started:
    the TCP ports it listens on (/proc/net/tcp and tcp6 rows of its own sockets), the unix
    socket paths it listens on, their modes and their folder's, and its pool's file."""
    children = [
        pid
        for task in Path(f"/proc/{up_pid}/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "chunkstore.cli" in argv and "serve" in argv:
            break
    else:
        raise AssertionError(f"no daemon among {up_pid}'s children {children}")
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    tcp = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            field = row.split()
            if field[3] == "0A" and field[9] in inodes:  # 0A: LISTEN
                tcp.append(f"{table} {field[1]}")
    unix = {  # Flags 00010000: listening
        field[7]
        for field in map(str.split, Path("/proc/net/unix").read_text().splitlines()[1:])
        if len(field) > 7 and field[3] == "00010000" and field[6] in inodes
    }
    modes = {path: stat.S_IMODE(os.stat(path).st_mode) for path in unix}
    modes |= {
        str(Path(path).parent): stat.S_IMODE(os.stat(Path(path).parent).st_mode) for path in unix
    }
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    pools = sorted({path for *_, path in map(str.split, maps) if "/chunkstore-" in path})
    return DaemonFacts(tcp, sorted(unix), modes, pools)


@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(tmp_path: Path, smollm2_dir: Path) -> None:
    script = quickstart()
    folders, pools, processes = left_behind()
    assert not processes, processes
    log = tmp_path / "quickstart.log"
    with log.open("w") as sink:  # a file: a server left running would keep a pipe open
        run = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=ROOT,
            # as a user's shell has it: vLLM's engine in its own processes (tests/conftest.py)
            env={k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its background jobs share its process group
        )
        try:
            run.wait(timeout=900)
        finally:
            if run.poll() is None:
                run.kill()
            stop_group(run)
    out = log.read_text()
    assert run.returncode == 0, out[-6000:]
    assert "chunkstore up: stopped: nothing left running" in out, out[-3000:]
    loaded = [int(n) for n in re.findall(r"\| loaded: .*?cached_tokens=(\d+)", out)]
    assert len(loaded) == 2, out[-3000:]
    # The second request holds the same documents in another order: vLLM computed neither
    # (the store supplied them), so at least their tokens were not computed.
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    documents = ["The Danube flows through ten countries.", "Paris is the capital of France."]
    tokens = sum(len(tokenizer.encode(d, add_special_tokens=False)) for d in documents)
    assert loaded[1] >= tokens > 0, (loaded, out[-3000:])
    # Nothing left: every process stopped, its pool and its folder removed.
    now_folders, now_pools, now_processes = left_behind()
    assert not now_processes, now_processes
    assert now_folders <= folders and now_pools <= pools, (now_folders, now_pools)


@pytest.mark.slow
def test_ctrl_c_while_starting_stops_what_started(smollm2_dir: Path) -> None:
    """Ctrl-C (SIGINT) while `chunkstore up` waits for vLLM: it stops at once (exit 130),
    not minutes later, and leaves nothing (the daemon, already up, stopped too). The daemon,
    up by then, was this user's alone: no TCP port (any local user could write KV vLLM
    serves), its unix sockets and their folder owner-only, its pool in /dev/shm. That the
    connector and the router reach it over its socket: the quickstart above."""
    folders, pools, _ = left_behind()
    up = subprocess.Popen(
        [sys.executable, "-m", "chunkstore.cli", "up", "--model", str(smollm2_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stderr is not None
        for line in up.stderr:  # progress: the daemon, then vLLM starting
            if "vllm serve 1 of 1" in line:
                break
        daemon = daemon_facts(up.pid)  # asserted once up is stopped: nothing left either way
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 130, err
    assert "stopped: nothing left running" in err, err
    now_folders, now_pools, now_processes = left_behind()
    assert not now_processes, now_processes
    assert now_folders <= folders and now_pools <= pools, (now_folders, now_pools)
    assert daemon.tcp == [], daemon
    assert len(daemon.unix) == 2, daemon  # gRPC's socket and the fast path's
    assert all(mode & 0o077 == 0 for mode in daemon.modes.values()), daemon
    assert [Path(pool).parent for pool in daemon.pools] == [SHM], daemon
