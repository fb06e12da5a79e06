"""The device check: one prepared command for a bare, brief GPU (or NPU) machine.

    python3 -m chunkstore.testing.device_check run OUT [--device auto|cuda|npu|cpu]
    python3 -m chunkstore.testing.device_check wheels DIR      (make device-wheels)

``run`` uses the machine's own ``python3`` with the repository on ``PYTHONPATH``. What that
Python lacks of what the device path imports (``NEEDED``) is unpacked from a wheelhouse built
beforehand by ``wheels`` (pure-Python, abi3 or manylinux wheels of pinned versions for Python
3.12, the GPU machine's, and for this host's Python) into a scratch folder put first on the
path; nothing is installed into the machine's Python and nothing is downloaded. Then each part
runs as its own process under its own timeout (``PARTS``: the device suite split by what could
hang, then ``chunkstore bench device``), so the whole ends within ``sum(timeouts)`` whatever
fails. It writes two files to OUT (the device tool returns up to eight): ``device-check.json``,
rewritten after every part, and ``device-check.log``, every part's output. Exit 0 only when
every part passed.

No vLLM, transformers or Redis is imported on this path (``imports`` checks chunkstore's
side, the ``connector`` part the connector's): the GPU machine has none of vLLM and redis-py.
The connector (``connector/``, installed as another name) is laid out on the path as
pyproject.toml's ``package-dir`` installs it: chunkstore names none of its modules.

``--device npu`` on a host without an NPU runs the Ascend twin against the FAKE ``torch_npu``
(chunkstore.testing.fake_torch_npu), the KV math on the CPU, and says so in the report. This
module imports only the standard library at the top: it runs before the wheels are unpacked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ElementTree
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REPORT, LOG = "device-check.json", "device-check.log"

# What the device path imports beyond the standard library: distribution -> (the floor, as in
# pyproject.toml: the generated gRPC and protobuf code refuses older runtimes; the version the
# wheelhouse ships, the one the suite runs with here). torch, numpy and pytest are the
# machine's own.
SHIPPED = {
    "grpcio": ("1.85.1", "1.85.3"),
    "grpcio-health-checking": ("1.85.1", "1.85.1"),
    "protobuf": ("7.35.1", "7.36.2"),
    "xxhash": ("3.4", "4.1.0"),
    "prometheus-client": ("0.20", "0.26.0"),
}
OWN = {"torch": "2.4", "numpy": "1.26", "pytest": "8.0"}
WHEEL_PYTHONS = ("3.12", f"{sys.version_info.major}.{sys.version_info.minor}")
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")

TEST_TIMEOUT_S = 60  # a test, where pytest-timeout is installed (the GPU machine has it)
FORBIDDEN_IMPORTS = ("vllm", "transformers", "redis")
IMPORTS = f"""
import sys
import chunkstore.cli, chunkstore.client, chunkstore.daemon.server, chunkstore.bench.device
from chunkstore.device.device_ipc import accelerators
stray = sorted(m for m in {FORBIDDEN_IMPORTS!r} if m in sys.modules)
assert not stray, f"the device path imported {{stray}}"
print("accelerators:", accelerators())
"""


def renamed_packages() -> dict[str, Path]:
    """The packages pyproject.toml installs from a folder of another name (the connector's
    ``connector/``) -> that folder: what the path needs beside the repository's root."""
    with (ROOT / "pyproject.toml").open("rb") as config:
        folders = tomllib.load(config)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in folders.items() if name != folder}


@dataclass(frozen=True)
class Part:
    name: str
    timeout_s: int
    pytest_args: tuple[str, ...] = ()  # a pytest run; else the command below
    command: tuple[str, ...] = ()


def parts(device: str) -> list[Part]:
    """What runs, in order: what could hang (daemon and IPC processes) apart from the math."""
    bench: tuple[str, ...] = (
        "-m",
        "chunkstore.cli",
        "bench",
        "device",
        "--json",
        "--device",
        device,
    )
    if device == "cpu":  # the CI run: proves the path, not the speed
        bench += ("--mib", "8", "--tokens", "512", "--layers", "4", "--repeats", "3")
    return [
        Part("imports", 45, command=("-c", IMPORTS)),
        # kv compiles the Triton writer's kernels (~25 of them, under a second each); the
        # bench took 21 s of its 120 before the Triton row. The sum stays 8.5 minutes: the
        # connector's 60 s came from imports and npu_ops (15 each: seconds on a GPU) and
        # pool (30: it took 88-117 s of its 180 on the H200s).
        Part("kv", 120, pytest_args=("tests/device/test_kv_on_device.py",)),
        Part("npu_ops", 45, pytest_args=("tests/device/test_npu_ops.py",)),
        Part("pool", 150, pytest_args=("tests/device/test_device_pool.py",)),
        Part("connector", 60, pytest_args=("tests/device/test_connector_on_device.py",)),
        Part("bench", 90, command=bench),
    ]


# The wheelhouse ------------------------------------------------------------------------------


def build_wheels(directory: Path) -> int:
    """Download the pinned wheels for every Python in ``WHEEL_PYTHONS`` (needs PyPI)."""
    directory.mkdir(parents=True, exist_ok=True)
    for python in sorted(set(WHEEL_PYTHONS)):
        platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
        pins = [f"{name}=={version}" for name, (_, version) in SHIPPED.items()]
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--no-deps", "--only-binary=:all:", "--implementation", "cp",
            "--python-version", python, *platforms, "-d", str(directory), *pins,
        ]  # fmt: skip
        subprocess.run(command, check=True)
    wheels = sorted(directory.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {directory}")
    return 0


def version_tuple(text: str) -> tuple[int, ...]:
    """ "2.11.0+cu130" -> (2, 11, 0); "1.85.0rc1" -> (1, 85, 0); "" -> ()."""
    leading = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(n) for n in leading.group().split(".")) if leading else ()


def usable(name: str, have: str | None) -> bool:
    """Whether the installed version of a ``SHIPPED`` distribution will do: at least the
    floor, and protobuf of the floor's major (its generated code refuses another major)."""
    if have is None:
        return False
    floor = version_tuple(SHIPPED[name][0])
    mine = version_tuple(have)
    return mine >= floor and (name != "protobuf" or mine[:1] == floor[:1])


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def wheel_fits(filename: str) -> bool:
    """Whether a wheel installs on this Python and machine (py3 / cpXY / abi3, any or
    manylinux for this architecture)."""
    python_tags, abi, platform_tag = filename.removesuffix(".whl").split("-")[-3:]
    minor = sys.version_info.minor
    here = f"cp3{minor}"
    python_ok = any(
        tag in ("py3", here) or (abi == "abi3" and tag.startswith("cp3") and int(tag[3:]) <= minor)
        for tag in python_tags.split(".")
    )
    machine = platform.machine()
    platform_ok = platform_tag == "any" or (
        "linux" in platform_tag and platform_tag.endswith(machine)
    )
    return python_ok and platform_ok


def unpack_missing(wheels: Path, site: Path) -> dict[str, str]:
    """Unpack into ``site`` the shipped wheel of each ``SHIPPED`` distribution this Python
    lacks or has unusable (``usable``). Returns {name: version} unpacked; raises with what is
    missing from the wheelhouse."""
    unpacked = {}
    for name, (floor, version) in SHIPPED.items():
        have = installed(name)
        if usable(name, have):
            continue
        stem = name.replace("-", "_").lower()
        found = [
            w
            for w in sorted(wheels.glob("*.whl"))
            if w.name.lower().startswith(f"{stem}-{version}-") and wheel_fits(w.name)
        ]
        if not found:
            raise SystemExit(
                f"device check: this Python has {name} {have or 'not at all'}, needs {floor}+, "
                f"and {wheels} holds no wheel of it for Python "
                f"{sys.version_info.major}.{sys.version_info.minor} on {platform.machine()}: "
                "run `make device-wheels` and send the folder with the tree"
            )
        with zipfile.ZipFile(found[0]) as wheel:
            wheel.extractall(site)
        unpacked[name] = version
    return unpacked


# Running the parts ----------------------------------------------------------------------------


def run_part(part: Part, env: dict[str, str], log: Any, scratch: Path) -> dict[str, Any]:
    junit = scratch / f"{part.name}.xml"
    if part.pytest_args:
        command = [
            sys.executable, "-m", "pytest", *part.pytest_args, "-p", "no:cacheprovider",
            "-q", "-rfEs", f"--junitxml={junit}",
        ]  # fmt: skip
        if installed("pytest-timeout"):  # one hung test does not take its part's others
            command += ["--timeout", str(TEST_TIMEOUT_S)]
    else:
        command = [sys.executable, *part.command]
    log.write(f"\n===== {part.name}: {' '.join(command)} (timeout {part.timeout_s} s)\n")
    log.flush()
    began = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its daemons and workers are killed with it
    )
    try:
        output, _ = process.communicate(timeout=part.timeout_s)
        status = "passed" if process.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = "timeout"
    log.write(output)
    log.flush()
    result: dict[str, Any] = {
        "status": status,
        "seconds": round(time.monotonic() - began, 1),
        "exit_code": process.returncode,
    }
    if part.pytest_args and junit.exists():
        result.update(junit_summary(junit))
    elif part.name == "bench":
        result["figures"] = [json.loads(line) for line in output.splitlines() if line[:1] == "{"]
    if status != "passed":
        result["tail"] = output[-3000:]
    return result


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and the failed tests' ids and first message line, from pytest's JUnit XML."""
    root = ElementTree.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed, skipped = [], []
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append({"test": name, "message": (problem.get("message") or "")[:400]})
        elif case.find("skipped") is not None:
            skipped.append({"test": name, "why": case.find("skipped").get("message", "")})  # type: ignore[union-attr]
    return {
        "tests": len(cases),
        "failed": failed,
        "skipped": skipped,
        "passed": len(cases) - len(failed) - len(skipped),
    }


def environment(device: str, npu_runtime: str, unpacked: dict[str, str]) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "host": platform.node(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "npu_runtime": npu_runtime,
        "unpacked_from_wheels": unpacked,
        "packages": {n: installed(n) for n in [*OWN, *SHIPPED, "numba", "triton", "cupy"]},
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts.update(
            cuda=torch.version.cuda,
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpus=torch.cuda.device_count(),
        )
    return facts


def choose_device(asked: str) -> tuple[str, str]:
    """(the device the KV math runs on, what torch_npu is) for ``--device``."""
    import torch

    if asked == "auto":
        asked = "cuda" if torch.cuda.is_available() else "cpu"
    if asked == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device check: --device cuda, but torch sees no CUDA device")
    if asked == "npu":
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu", f"torch_npu {installed('torch-npu')}"
        except ImportError:
            pass
        return "cpu", "FAKE (chunkstore.testing.fake_torch_npu: no NPU on this host)"
    return asked, "not used"


def run(out: Path, asked: str, wheels: Path, only: list[str] | None = None) -> int:
    """The check: every part, or the parts named in ``only``."""
    began = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    missing = [
        n for n, floor in OWN.items() if version_tuple(installed(n) or "0") < version_tuple(floor)
    ]
    if missing:
        raise SystemExit(
            f"device check: this Python lacks {missing} (the machine's own; not shipped)"
        )
    scratch = Path(tempfile.mkdtemp(prefix="chunkstore-device-check-"))
    site = scratch / "site"
    site.mkdir()
    unpacked = unpack_missing(wheels, site)
    for name, folder in renamed_packages().items():
        (site / name).symlink_to(folder)  # as pyproject installs it
    sys.path[:0] = [str(site), str(ROOT)]
    device, npu_runtime = choose_device(asked)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSTORE_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        PYTHONDONTWRITEBYTECODE="1",
        CHUNKSTORE_TEST_DEVICE=device,
    )
    report: dict[str, Any] = {
        "check": "chunkstore device check",
        "asked": asked,
        "environment": environment(device, npu_runtime, unpacked),
        "parts": {},
    }
    with (out / LOG).open("w") as log:
        for part in parts(device):
            if only and part.name not in only:
                continue
            report["parts"][part.name] = run_part(part, env, log, scratch)
            report["ok"] = all(p["status"] == "passed" for p in report["parts"].values())
            report["wall_s"] = round(time.monotonic() - began, 1)
            (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
            print(f"{part.name}: {report['parts'][part.name]['status']}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    verdict = "ok" if report["ok"] else "FAILED"
    print(f"device check: {verdict} in {report['wall_s']} s -> {out / REPORT}")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m chunkstore.testing.device_check")
    verbs = parser.add_subparsers(dest="verb", required=True)
    check = verbs.add_parser("run", help="run the device check, report to OUT")
    check.add_argument("out", type=Path, help="folder for device-check.json and .log")
    check.add_argument("--device", default="auto", choices=["auto", "cuda", "npu", "cpu"])
    check.add_argument("--wheels", type=Path, default=ROOT / ".device-wheels")
    check.add_argument(
        "--parts",
        type=lambda text: text.split(","),
        default=None,
        help=f"comma-separated parts to run, of {', '.join(p.name for p in parts('cpu'))} "
        "(default: all)",
    )
    wheels = verbs.add_parser("wheels", help="download the wheelhouse (needs PyPI)")
    wheels.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "wheels":
        return build_wheels(args.directory)
    known = {p.name for p in parts("cpu")}
    if args.parts and not set(args.parts) <= known:
        parser.error(f"unknown parts {sorted(set(args.parts) - known)}: use {sorted(known)}")
    return run(args.out, args.device, args.wheels, args.parts)


if __name__ == "__main__":
    sys.exit(main())
