"""A real redis-server (Debian's package) on a free loopback port, for tests and benches."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server is not installed: apt-get install redis-server (.ci/run does)"
            )
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--protected-mode",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    return
                except OSError:
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
        except BaseException:  # that, or a signal's exception while it starts
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
