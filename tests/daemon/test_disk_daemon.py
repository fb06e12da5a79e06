"""The disk tier in a running daemon (``serve --disk-dir``): entries that outlive a SIGTERM and
a SIGKILL, a working set four times the pool served from both tiers, a flipped byte on disk
refused, a full disk that leaves memory puts working, repeated kill -9 during spills that
never serves a wrong byte, and a directory shared with files the tier did not write that
keeps every one of them as it was. Every read is checked against what its key must hold."""

from __future__ import annotations

import random
import shutil
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.disk import HEADER, MARKER, SUFFIX
from chunkstore.errors import StoreError
from chunkstore.processes.daemon import RunningDaemon, serve_command, serve_env
from chunkstore.testing.entries import entry_key, random_kv, wait_for


def content(i: int, tokens: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """What key ``i`` must hold (``tokens`` x 3 KiB)."""
    return random_kv(tokens, seed=i)


def holds(client: ChunkStoreClient, i: int, tokens: int = 10) -> bool:
    """Key ``i`` is served, byte-exact (a wrong byte fails the test, not just this check)."""
    got = client.get(entry_key(i))
    if got is None:
        return False
    k, v = content(i, tokens)
    assert torch.equal(got.keys, k) and torch.equal(got.values, v), f"key {i} read wrong"
    return True


def spilled(client: ChunkStoreClient) -> bool:
    """Every committed entry is on disk (none queued or being written)."""
    disk = client.stats().disk
    return disk.spill_queue_bytes == 0 and disk.spills_writing == 0


def kill_9(daemon: RunningDaemon) -> None:
    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait()


def test_200_entries_survive_a_sigterm_and_a_sigkill(serve, tmp_path: Path) -> None:
    disk = str(tmp_path / "disk")
    first = serve("--disk-dir", disk, name="first")
    with ChunkStoreClient(first.unix) as client:
        for i in range(200):
            assert client.put(entry_key(i), *content(i), virtual_start=0)
    assert first.stop() == 0  # a clean stop writes what the spill thread had not yet
    assert "0 memory entries left unwritten" in first.log()

    began = time.monotonic()
    second = serve("--disk-dir", disk, name="second")
    with ChunkStoreClient(second.unix) as client:
        assert client.lookup([entry_key(i) for i in range(200)]) == [10] * 200
        assert all(holds(client, i) for i in range(200))
        served_again = time.monotonic() - began
        disk_stats = client.stats().disk
        assert disk_stats.entries == 200 and disk_stats.counts["promotions"] == 200
        for i in range(200, 400):  # these 200 reach the disk only through the spill thread
            assert client.put(entry_key(i), *content(i), virtual_start=0)
        wait_for(lambda: spilled(client), timeout=30)
    kill_9(second)

    third = serve("--disk-dir", disk, name="third")
    with ChunkStoreClient(third.unix) as client:
        assert all(holds(client, i) for i in range(400))
        assert client.stats().disk.removed_at_start == 0
    print(f"disk tier: 200 entries served again {served_again:.2f} s after a restart began")


def test_read_again_writes_what_is_asked_for_twice_and_a_clean_stop_the_rest(
    serve, tmp_path: Path
) -> None:
    disk = str(tmp_path / "disk")
    first = serve("--disk-dir", disk, "--spill", "read-again", name="first")
    with ChunkStoreClient(first.unix) as client:
        for i in range(10):
            assert client.put(entry_key(i), *content(i), virtual_start=0)
        for round_ in range(2):  # keys 0-2 asked for twice, 3-5 once, 6-9 never
            assert all(holds(client, i) for i in range(3 if round_ else 6))
        wait_for(lambda: spilled(client), timeout=30)  # queued by the Acquire, before its reply
        stats = client.stats().disk
        assert stats.entries == 3 and stats.counts["spill_bytes"] == 3 * 2 * content(0)[0].nbytes
    assert first.stop() == 0  # a clean stop still writes every memory entry
    second = serve("--disk-dir", disk, name="second")
    with ChunkStoreClient(second.unix) as client:
        assert client.stats().disk.entries == 10 and all(holds(client, i) for i in range(10))


def test_a_working_set_four_times_the_pool_all_hits_in_a_second_pass(serve, tmp_path) -> None:
    """64 entries of 256 KiB through a 4 MiB pool, each put once the disk has the last
    (puts faster than the disk are dropped from the spill, by design: counted)."""
    daemon = serve("--disk-dir", str(tmp_path / "disk"), pool_bytes=4 << 20)
    tokens = 85  # 255 KiB
    with ChunkStoreClient(daemon.unix) as client:
        for i in range(64):
            assert client.put(entry_key(i), *content(i, tokens), virtual_start=0)
            wait_for(lambda: spilled(client), timeout=30)
        for i in range(64):
            assert holds(client, i, tokens), f"key {i} missed on the second pass"
        stats = client.stats()
        assert stats.evictions["capacity"] + stats.evictions["watermark"] > 100
        assert stats.disk.counts["promotions"] >= 48  # at most 16 fit in memory at once
        assert stats.disk.counts.get("dropped_queue_full", 0) == 0
        assert stats.disk.counts.get("dropped_evicted", 0) == 0
    metrics = daemon.scrape()
    assert metrics["chunkstore_disk_promotions_total"] == stats.disk.counts["promotions"]
    assert metrics["chunkstore_disk_entries"] == 64


def test_a_flipped_byte_on_disk_is_refused_and_the_entry_removed(serve, tmp_path) -> None:
    disk = tmp_path / "disk"
    first = serve("--disk-dir", str(disk), name="first")
    with ChunkStoreClient(first.unix) as client:
        for i in range(3):
            assert client.put(entry_key(i), *content(i), virtual_start=0)
    assert first.stop() == 0
    [victim] = disk.glob(f"*/{entry_key(1).hex()}{SUFFIX}")
    with victim.open("r+b") as f:
        f.seek(HEADER + 5000)
        byte = f.read(1)[0]
        f.seek(HEADER + 5000)
        f.write(bytes([byte ^ 1]))

    second = serve("--disk-dir", str(disk), name="second")
    with ChunkStoreClient(second.unix) as client:
        assert client.get(entry_key(1)) is None  # refused: a miss, never the changed bytes
        assert holds(client, 0) and holds(client, 2)
        disk_stats = client.stats().disk
        assert disk_stats.counts["errors_read"] == 1 and "changed on disk" in disk_stats.last_error
        assert client.lookup([entry_key(1)]) == [None] and not victim.exists()
        assert client.put(entry_key(1), *content(1), virtual_start=0)  # stored again
        assert holds(client, 1)
    assert "changed on disk" in second.log()


def test_a_full_disk_keeps_memory_puts_working(serve, small_disk: Path) -> None:
    daemon = serve("--disk-dir", str(small_disk), "--disk-size", "64M")  # the tmpfs has 1 MiB
    with ChunkStoreClient(daemon.unix) as client:
        for i in range(20):  # 600 KiB each: the second cannot fit
            assert client.put(entry_key(i), *content(i, 200), virtual_start=0)
        wait_for(lambda: spilled(client), timeout=30)
        assert all(holds(client, i, 200) for i in range(20))
        disk_stats = client.stats().disk
        assert disk_stats.counts["errors_write"] >= 19
        assert "No space left on device" in disk_stats.last_error
        assert disk_stats.entries <= 1
    assert not list(small_disk.glob("*/*.tmp-*"))  # a failed write leaves no file behind
    assert daemon.scrape()['chunkstore_disk_errors_total{op="write"}'] >= 19
    with grpc.insecure_channel(daemon.tcp) as channel:  # still serving, and saying so
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def put_until(address: str, stop: threading.Event, rng: random.Random) -> None:
    """Put random keys of 300 as fast as one client can, until ``stop`` or the daemon dies."""
    try:
        with ChunkStoreClient(address) as writer:
            while not stop.is_set():
                i = rng.randrange(300)
                writer.put(entry_key(i), *content(i, 20), virtual_start=0)
    except (StoreError, OSError, ValueError):
        return  # the daemon died under it


def test_kill_9_during_spills_again_and_again_serves_nothing_wrong(serve, tmp_path) -> None:
    """Five rounds: a writer puts as fast as it can while the daemon is SIGKILLed at a random
    moment (mid-spill, mid-promotion), then a new daemon on the same directory serves every
    key it finds byte-exact, and has swept what the kill tore."""
    disk = str(tmp_path / "disk")
    rng = random.Random(32)
    served = swept = 0
    for round_ in range(5):
        daemon = serve("--disk-dir", disk, "--spill-queue-bytes", "64M", name=f"round{round_}")
        with ChunkStoreClient(daemon.unix) as client:
            present = [
                i for i, n in enumerate(client.lookup([entry_key(i) for i in range(300)])) if n
            ]
            assert all(holds(client, i, 20) for i in present)
            served += len(present)
            swept += client.stats().disk.removed_at_start
        stop = threading.Event()
        writer = threading.Thread(target=put_until, args=(daemon.unix, stop, rng))
        writer.start()
        time.sleep(rng.uniform(0.3, 1.5))
        kill_9(daemon)
        stop.set()
        writer.join(timeout=30)
    final = serve("--disk-dir", disk, name="final")
    with ChunkStoreClient(final.unix) as client:
        present = [i for i, n in enumerate(client.lookup([entry_key(i) for i in range(300)])) if n]
        assert len(present) > 50 and all(holds(client, i, 20) for i in present)
    assert not list(Path(disk).glob("*/*.tmp-*"))
    print(f"kill -9 x5: {served} entries served after the kills, {swept} torn files swept")


def test_a_vanished_disk_directory_leaves_memory_serving(serve, tmp_path) -> None:
    """The tier's directory is deleted under the daemon (an unmounted or wiped disk): puts
    and memory hits go on, spills fail and are counted, and an entry whose file went is a
    miss, never bytes from nowhere."""
    disk = tmp_path / "disk"
    daemon = serve("--disk-dir", str(disk), pool_bytes=4 << 20)
    with ChunkStoreClient(daemon.unix) as client:
        for i in range(3):
            assert client.put(entry_key(i), *content(i, 200), virtual_start=0)
        wait_for(lambda: spilled(client), timeout=30)
        shutil.rmtree(disk)
        for i in range(3, 9):  # 600 KiB each: 0, 1 and 2 leave memory
            assert client.put(entry_key(i), *content(i, 200), virtual_start=0)
        wait_for(lambda: spilled(client), timeout=30)
        assert all(holds(client, i, 200) for i in range(6, 9))
        assert client.lookup([entry_key(0)]) == [200]  # the tier's index still lists it
        assert client.get(entry_key(0)) is None  # its file is gone: a miss
        assert client.lookup([entry_key(0)]) == [None]
        disk_stats = client.stats().disk
        assert disk_stats.counts["errors_write"] >= 6 and disk_stats.counts["errors_read"] == 1
        assert (
            "No such file or directory" in disk_stats.last_error or "gone" in disk_stats.last_error
        )
    with grpc.insecure_channel(daemon.tcp) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_daemon_on_a_shared_directory_leaves_what_it_did_not_write_in_place(
    serve, tmp_path
) -> None:
    """Beside a tier's entries: a README, "ab" a symlink leading outside (where "ab"'s keys
    would go), a symlink named like an entry, a note in one of the tier's subdirectories.
    Refused at start without --disk-dir-allow-foreign; with it, served around and never
    touched: the tier's own entries read back, writes that would go through a link fail
    (counted; the entries stay served from memory), and every file reads as it did."""
    disk, outside = tmp_path / "disk", tmp_path / "outside"
    first = serve("--disk-dir", str(disk), name="first")
    with ChunkStoreClient(first.unix) as client:
        for i in range(3):
            assert client.put(entry_key(i), *content(i), virtual_start=0)
    assert first.stop() == 0
    linked, link_named = 0xAB, 1 + 256  # keys of subdirectories "ab" and "01"
    outside.mkdir()
    planted = {
        disk / "README": b"read me",
        disk / "01" / "notes.txt": b"notes",
        outside / f"{entry_key(linked).hex()}{SUFFIX}": b"not an entry",
        outside / "target": b"a symlink's target",
    }
    for path, data in planted.items():
        path.write_bytes(data)
    (disk / "ab").symlink_to(outside, target_is_directory=True)
    link = disk / "01" / f"{entry_key(link_named).hex()}{SUFFIX}"
    link.symlink_to(outside / "target")

    refused = refuse_start(tmp_path / "refused", disk)
    assert refused.returncode == 2 and "--disk-dir-allow-foreign" in refused.stderr

    second = serve("--disk-dir", str(disk), "--disk-dir-allow-foreign", name="second")
    with ChunkStoreClient(second.unix) as client:
        assert all(holds(client, i) for i in range(3))
        for i in (linked, link_named):
            assert client.put(entry_key(i), *content(i), virtual_start=0)
        wait_for(lambda: spilled(client), timeout=30)
        disk_stats = client.stats().disk
        assert disk_stats.counts["errors_write"] == 2 and disk_stats.entries == 3
        assert "not the tier's own" in disk_stats.last_error
        assert holds(client, linked) and holds(client, link_named)  # from memory
    assert second.stop() == 0
    assert all(path.read_bytes() == data for path, data in planted.items())
    assert (disk / "ab").is_symlink() and link.is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == sorted(
        p.name for p in planted if p.parent == outside
    )
    warned = [line for line in second.log().splitlines() if "did not write" in line]
    assert len(warned) == 1 and "left alone 4 files or folders" in warned[0]


def refuse_start(workdir: Path, disk: Path) -> subprocess.CompletedProcess[str]:
    """``chunkstore serve --disk-dir disk`` where it must refuse to start."""
    workdir.mkdir()
    command = serve_command(workdir, "--disk-dir", str(disk))
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=serve_env())


def test_a_directory_of_someone_elses_is_refused_and_left_as_it_was(tmp_path) -> None:
    """--disk-dir given by mistake (a project's folder, whose docs/ a start used to empty):
    exit 2 naming the flag that would allow it, and nothing in it touched or created."""
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "README").write_text("read me")
    (project / "docs" / "guide.md").write_text("a guide")
    run = refuse_start(tmp_path / "daemon", project)
    assert run.returncode == 2 and "--disk-dir-allow-foreign" in run.stderr
    assert "did not make (2 at its top level" in run.stderr
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == [
        "README",
        "docs",
        "docs/guide.md",
    ]
    assert (project / "docs" / "guide.md").read_text() == "a guide"


def test_the_directories_a_daemon_makes_are_0700_and_its_files_0600(serve, tmp_path) -> None:
    """The tier's KV is its user's alone, whatever the umask (the test's: 022 or so)."""
    disk = tmp_path / "var" / "disk"
    daemon = serve("--disk-dir", str(disk))
    with ChunkStoreClient(daemon.unix) as client:
        for i in range(3):
            assert client.put(entry_key(i), *content(i), virtual_start=0)
        wait_for(lambda: spilled(client), timeout=30)
    made = [tmp_path / "var", disk, *disk.glob("*/")]
    assert len(made) == 5 and {stat.S_IMODE(p.stat().st_mode) for p in made} == {0o700}
    files = [disk / MARKER, *disk.glob("*/*")]
    assert len(files) == 4 and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
