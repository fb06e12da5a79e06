"""Signals a long-running command waits for, noted by handlers that take no lock.

A handler runs in the main thread between two of its bytecodes, wherever it stands: one that
calls ``threading.Event.set`` deadlocks when the signal lands while the main thread holds that
event's lock (inside its own ``Event.wait``, the usual place to wait for a stop). A daemon did,
in CI: "got SIGTERM: draining" logged, then nothing until the SIGKILL. ``Signalled`` only
counts in its handler, and its waits poll.
"""

from __future__ import annotations

import signal
import time

POLL_S = 0.05


class Signalled:
    """How many of ``signals`` arrived since installed; ``is_set`` / ``wait`` as an
    ``Event``'s (it can stand for one where a caller only reads it, e.g. a ``cancel``)."""

    def __init__(self, *signals: signal.Signals) -> None:
        self.count = 0
        self.last: signal.Signals | None = None
        for sig in signals:
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.last = signal.Signals(signum)
        self.count += 1  # the main thread's only writer: the handler runs in it

    def is_set(self) -> bool:
        return self.count > 0

    def wait(self, timeout: float | None = None) -> bool:
        """Whether any arrived, waiting up to ``timeout`` s (None: until one does)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.count:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True
