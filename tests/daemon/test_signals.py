"""``Signalled``: the stop and reload flags of ``chunkstore serve`` and ``chunkstore up``,
counted by handlers that take no lock (an ``Event.set`` in a handler deadlocked a daemon's
stop in CI when SIGTERM landed while its main thread held that event's lock)."""

from __future__ import annotations

import os
import signal
import threading
import time

from chunkstore.daemon.signals import Signalled


def test_a_signal_is_counted_and_ends_a_wait() -> None:
    kept = signal.getsignal(signal.SIGUSR2)
    try:
        flag = Signalled(signal.SIGUSR2)
        assert not flag.is_set() and flag.last is None
        began = time.monotonic()
        assert flag.wait(0.2) is False  # nothing came: the timeout, then False
        assert time.monotonic() - began >= 0.2
        sender = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2))
        sender.start()
        assert flag.wait(30) is True  # ends at the signal, not at the timeout
        sender.join()
        assert flag.is_set() and flag.count == 1 and flag.last is signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.wait() is True and flag.count == 2  # handled at once, in this thread
    finally:
        signal.signal(signal.SIGUSR2, kept)


def test_signals_that_land_while_the_main_thread_waits_in_short_polls_all_end_it() -> None:
    """Many signals sent while this (main) thread waits in 1 ms polls, the way the daemon's
    loop waits: each wait returns, none hangs, and the count only grows."""
    kept = signal.getsignal(signal.SIGUSR2)
    try:
        flag = Signalled(signal.SIGUSR2)
        done = threading.Event()

        def send() -> None:
            for _ in range(200):
                os.kill(os.getpid(), signal.SIGUSR2)
                time.sleep(0.0005)
            done.set()

        sender = threading.Thread(target=send)
        sender.start()
        seen = 0
        while not done.is_set():
            flag.wait(0.001)
            assert flag.count >= seen
            seen = flag.count
        sender.join()
        assert 1 <= flag.count <= 200  # signals of one kind can merge before a handler runs
    finally:
        signal.signal(signal.SIGUSR2, kept)
