"""``chunkstore bench store --tier disk``: the disk tier against the disk's own bandwidth.

One daemon with a disk tier on ``--disk-dir``'s file system and a pool that holds one chunk
(default SmolLM2's 4096 tokens, fp32: 189 MB) but not two. Each round puts chunk A and waits
for its spill, then puts chunk B (which evicts A from memory) and waits for B's spill, then
gets A: a disk hit, read back into the pool, checked, then copied out as any get. Timed:
- the spill of each put: the daemon's seconds writing the file, flushed (``fdatasync``);
- the disk hit: the daemon's seconds reading the file into the pool and checking it, and the
  whole get as the client sees it;
- in the same round, the device's own sequential bandwidth on the same file system, for the
  same size, with direct I/O (no page cache helps): ``fio`` (1 MiB requests, 16 in flight,
  libaio; its own clock, the final fsync left out) where it is installed, else ``dd``
  (4 MiB requests, one at a time, ``oflag=direct conv=fdatasync`` / ``iflag=direct``). The
  page cache is also dropped before each read where this runs as root.
``disk_read_vs_device`` and ``disk_write_vs_device`` are the medians of the per-round ratios
of the tier's bandwidth to the device's (1 = as fast as the device goes sequentially).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkstore.bench.chunk import chunk_kv
from chunkstore.client import ChunkStoreClient
from chunkstore.processes.daemon import start_daemon

DD_BLOCK = 4 << 20


def _drop_page_cache() -> bool:
    """Drop the clean page cache (root only); whether it was."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _device(op: str, path: Path, nbytes: int) -> float:
    """Seconds the device took to ``op`` ("write" or "read") ``nbytes`` at ``path``, by fio
    where it is installed, else dd; direct I/O either way."""
    if shutil.which("fio"):
        size = -(-nbytes // 4096) * 4096
        run = subprocess.run(
            ["fio", f"--name={op}", f"--filename={path}", f"--rw={op}",
             f"--bs={min(size, 1 << 20)}", f"--size={size}", "--direct=1", "--ioengine=libaio",
             "--iodepth=16", "--output-format=json",
             *(["--end_fsync=1"] if op == "write" else [])],
            capture_output=True, text=True,
        )  # fmt: skip
        if run.returncode:
            raise RuntimeError(f"fio failed: {run.stderr.strip() or run.stdout.strip()}")
        job = json.loads(run.stdout[run.stdout.index("{") :])["jobs"][0][op]
        return float(nbytes / job["bw_bytes"])  # the time the chunk takes at that bandwidth
    count = -(-nbytes // DD_BLOCK)
    if op == "write":
        args = ["if=/dev/zero", f"of={path}", f"count={count}", "oflag=direct", "conv=fdatasync"]
    else:
        args = [f"if={path}", "of=/dev/null", "iflag=direct"]
    began = time.perf_counter()
    subprocess.run(["dd", *args, f"bs={DD_BLOCK}", "status=none"], check=True)
    return (time.perf_counter() - began) * nbytes / (count * DD_BLOCK)


def _filesystem(path: Path) -> str:
    """The type of the file system ``path`` is on (from /proc/mounts: the longest match)."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def _spilled(client: ChunkStoreClient, count: int, timeout: float = 120.0) -> float:
    """Wait until the daemon has spilled ``count`` entries in all; its seconds writing."""
    deadline = time.monotonic() + timeout
    while True:
        disk = client.stats().disk
        if disk.counts["spills"] >= count and not disk.spill_queue_bytes + disk.spills_writing:
            return float(disk.seconds["write"])
        if disk.counts.get("errors_write", 0):
            raise RuntimeError(f"the disk tier could not write: {disk.last_error}")
        if disk.counts.get("dropped_queue_full", 0) or disk.counts.get("dropped_evicted", 0):
            raise RuntimeError(f"the daemon dropped a spill: {dict(disk.counts)}")
        if time.monotonic() > deadline:
            raise RuntimeError("the disk tier did not write the entry in time")
        time.sleep(0.005)


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    keys, values, nbytes = chunk_kv(args)
    base = Path(args.disk_dir)
    base.mkdir(parents=True, exist_ok=True)
    rows, dropped = _rounds(args, base, keys, values, nbytes)

    def gb_s(name: str) -> float:
        # Three significant figures: a small entry's rate is not rounded to 0.
        return float(f"{nbytes / statistics.median(rows[name]) / 1e9:.3g}")

    def ratio(tier: str, device: str) -> float:
        pairs = zip(rows[tier], rows[device], strict=True)
        return round(statistics.median(d / t for t, d in pairs), 3)

    yield {
        "bench": "store.disk",
        "entry_mb": round(nbytes / 1e6, 1),
        "filesystem": _filesystem(base),
        "device_tool": "fio" if shutil.which("fio") else "dd",
        "rounds": args.repeats,
        "page_cache_dropped": dropped,
        "spill_write_gb_s": gb_s("write"),
        "device_write_gb_s": gb_s("device_write"),
        "disk_hit_read_gb_s": gb_s("read"),
        "device_read_gb_s": gb_s("device_read"),
        "disk_hit_get_s": round(statistics.median(rows["get"]), 4),
        "disk_read_vs_device": ratio("read", "device_read"),
        "disk_write_vs_device": ratio("write", "device_write"),
    }


def _pool_bytes(nbytes: int, block_size: int) -> int:
    """A pool that holds one chunk at 90% at most (under the 95% watermark), never two."""
    blocks = -(-nbytes // block_size)
    pool_blocks = -(-blocks * 10 // 9)
    if pool_blocks >= 2 * blocks:
        raise ValueError(
            f"a chunk of {blocks} pool block(s) cannot evict another from a pool that holds "
            "it under the watermark: lower --block-size"
        )
    return pool_blocks * block_size


def _rounds(
    args: argparse.Namespace, base: Path, keys: Any, values: Any, nbytes: int
) -> tuple[dict[str, list[float]], bool]:
    """``--repeats`` rounds over a daemon with a disk tier under ``base``: two chunks spilled
    (the second evicts the first from memory), the device written and read as much by
    fio / dd, and the first chunk got back from the disk. The times by name, and whether
    the page cache was dropped before every device read."""
    names = ("write", "device_write", "read", "get", "device_read")
    rows: dict[str, list[float]] = {name: [] for name in names}
    dropped = True
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=base, prefix="cs-bench-")))
        daemon = stack.enter_context(
            start_daemon(
                tmp / "daemon",
                "--disk-dir",
                str(tmp / "tier"),
                pool_bytes=_pool_bytes(nbytes, args.block_size),
                block_size=args.block_size,
            )
        )
        client = stack.enter_context(ChunkStoreClient(daemon.unix, transport="shm"))
        probe = tmp / "device.bin"
        spills = 0
        written = 0.0
        for i in range(args.repeats):
            a, b = (2 * i).to_bytes(16, "big"), (2 * i + 1).to_bytes(16, "big")
            for key in (a, b):  # b only once a is on disk: a spilling entry keeps its blocks
                client.put(key, keys, values, virtual_start=0)
                spills += 1
                seconds = _spilled(client, spills)
            rows["write"].append((seconds - written) / 2)  # the mean of the two spills
            written = seconds
            rows["device_write"].append(_device("write", probe, nbytes))
            dropped = _drop_page_cache() and dropped
            rows["device_read"].append(_device("read", probe, nbytes))
            dropped = _drop_page_cache() and dropped
            read_before = client.stats().disk.seconds["read"]
            began = time.perf_counter()
            got = client.get(a)  # evicted from memory by b: read back from disk
            rows["get"].append(time.perf_counter() - began)
            stats = client.stats()
            if got is None or stats.disk.counts["promotions"] != i + 1:
                raise RuntimeError(f"round {i}: the get was not a disk hit ({stats.disk})")
            rows["read"].append(stats.disk.seconds["read"] - read_before)
            client.clear()  # both tiers: the next round starts empty
        probe.unlink(missing_ok=True)
    return rows, dropped
