"""A real ``chunkstore router`` process on a free loopback port (tests, benches)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from chunkstore.processes import Cancel, Cancelled
from chunkstore.processes.vllm_server import stop_group


class RunningRouter:
    def __init__(
        self,
        workdir: Path,
        *args: str | Path,
        timeout: float = 120.0,
        command: str = "router",
        port: int = 0,
        cancel: Cancel | None = None,
    ) -> None:
        """``chunkstore COMMAND --port PORT ARGS`` (router, or proxy: the router's
        prefill/decode mode; port 0: any free one); returns once it listens (its first
        line); ``cancel`` set while it starts: stopped, ``Cancelled``."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "router.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "chunkstore.cli", command, "--port", str(port), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        first: list[str] = []
        reader = threading.Thread(
            target=lambda: first.append(self.process.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        try:
            deadline = time.monotonic() + timeout
            while reader.is_alive() and time.monotonic() < deadline:
                reader.join(1.0)
                if cancel is not None and cancel.is_set():
                    raise Cancelled("chunkstore router: its start was cancelled")
            if not first or not first[0].strip():
                raise RuntimeError(f"chunkstore router did not start: {self.log_path.read_text()}")
        except BaseException:
            self.stop()
            raise
        self.url: str = json.loads(first[0])["router"]

    def stop(self) -> int:
        if self.process.poll() is None:
            stop_group(self.process, grace=10.0)
        self.log.close()
        return int(self.process.returncode or 0)
