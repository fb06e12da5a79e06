"""The device check (chunkstore.testing.device_check, docs/device-check.md) proven before any
GPU is at hand: run as on the GPU machine, with a Python that holds only what that machine
has (``make device-venv``: torch, numpy, numba, pytest) and what it lacks unpacked from the
wheelhouse (``make device-wheels``), on the CPU and as the Ascend twin against the FAKE
torch_npu. A stray vLLM, transformers or Redis import, a missing wheel or a part that fails
fails here, not on the scarce GPU minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkstore.testing.device_check import (
    ROOT,
    SHIPPED,
    parts,
    usable,
    version_tuple,
    wheel_fits,
)

VENV_PYTHON = ROOT / ".venv-device" / "bin" / "python"
WHEELS = ROOT / ".device-wheels"


def run_check(out: Path, device: str, only: tuple[str, ...] = ()) -> dict:
    assert VENV_PYTHON.exists() and WHEELS.exists(), (
        "the device check needs `make device-venv device-wheels` (make test makes them)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run(
        [str(VENV_PYTHON), "-m", "chunkstore.testing.device_check", "run", str(out)]
        + ["--device", device, "--wheels", str(WHEELS)]
        + (["--parts", ",".join(only)] if only else []),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads((out / "device-check.json").read_text())
    assert run.returncode == 0, (run.stdout, run.stderr, (out / "device-check.log").read_text())
    return report


# The Ascend twin runs the parts whose code differs on an NPU (the FAKE torch_npu's ops and
# the KV math on its device); the daemon's pool and the bench run as on the CPU (~50 s).
TWIN_PARTS = ("imports", "kv", "npu_ops")


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_the_device_check_runs_with_only_the_gpu_machines_packages(
    tmp_path: Path, device: str
) -> None:
    only = TWIN_PARTS if device == "npu" else ()
    report = run_check(tmp_path, device, only)
    expected = [p.name for p in parts("cpu") if not only or p.name in only]
    assert report["ok"] and list(report["parts"]) == expected
    facts = report["environment"]
    assert facts["device"] == "cpu"
    # The venv has none of them: every one came from the wheelhouse.
    assert set(facts["unpacked_from_wheels"]) == set(SHIPPED)
    for name, least in (("kv", 10), ("npu_ops", 10), ("pool", 10), ("connector", 1)):
        if name not in report["parts"]:
            continue
        part = report["parts"][name]
        assert part["status"] == "passed" and part["failed"] == [], part
        assert part["skipped"] == [] and part["passed"] >= least, part  # nothing skipped
    if device == "npu":
        assert facts["npu_runtime"].startswith("FAKE")
    else:
        figures = {row["part"]: row for row in report["parts"]["bench"]["figures"]}
        assert set(figures) == {
            "remap_write",
            "ipc_get",
            "ipc_get_triton",
            "host_pool",
            "remap_write_triton",
        }
        # No Triton writer and no fused get for the CPU's (fake) pools: the rows say so
        # instead of measuring.
        assert figures.pop("remap_write_triton")["triton"].startswith("unavailable")
        assert figures.pop("ipc_get_triton")["triton"].startswith("unavailable")
        assert figures["ipc_get"]["gather"] == "torch"
        assert all(row["ratio_vs_baseline"] > 0 for row in figures.values())
    assert (tmp_path / "device-check.log").stat().st_size > 0


def test_which_wheels_and_versions_the_check_takes() -> None:
    here = f"cp3{sys.version_info.minor}"
    assert wheel_fits("grpcio_health_checking-1.85.1-py3-none-any.whl")
    assert wheel_fits(f"grpcio-1.85.3-{here}-{here}-manylinux2014_x86_64.whl")
    assert wheel_fits("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl")
    assert not wheel_fits("grpcio-1.85.3-cp39-cp39-manylinux2014_x86_64.whl")
    assert not wheel_fits(f"grpcio-1.85.3-{here}-{here}-manylinux2014_aarch64.whl")
    assert not wheel_fits(f"grpcio-1.85.3-{here}-{here}-win_amd64.whl")
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert version_tuple("1.85.0rc1") == (1, 85, 0)
    # What the first GPU machine had: grpcio 1.84.0 (too old for the generated stubs).
    assert not usable("grpcio", "1.84.0") and usable("grpcio", "1.85.1")
    assert not usable("protobuf", "8.0.0") and not usable("protobuf", "6.33.0")
    assert usable("xxhash", "4.0.1") and not usable("prometheus-client", None)
