"""The test helper that stops servers: a group whose leader has exited is gone at once."""

from __future__ import annotations

import subprocess
import sys
import threading

from chunkstore.processes.vllm_server import stop_group


def test_stop_group_does_not_wait_out_the_grace_for_an_exited_leader() -> None:
    """The leader exits on SIGTERM; unreaped, its zombie kept the group alive and every
    stop sat out the whole grace (60 s for a vllm serve)."""
    leader = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    stopping = threading.Thread(target=stop_group, args=(leader, 3600.0), daemon=True)
    stopping.start()
    stopping.join(timeout=120)  # a liveness bound, far from the hour of grace
    assert not stopping.is_alive(), "stop_group waited for a group whose leader had exited"
    assert leader.returncode is not None
