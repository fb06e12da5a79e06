"""Real local processes started on free loopback ports and stopped by their caller: a
``chunkstore serve`` daemon (``daemon``), a redis-server (``redis``), and a vLLM run over
prompts in a process of its own (``vllm_probe``). ``chunkstore bench`` runs them, and the tests
start theirs through them. It imports only the layers below the daemon (the client for a
vLLM probe that empties a store); it starts the daemon as a command, never imports it."""

from typing import Protocol


class Cancelled(RuntimeError):
    """A start given up because its caller asked (``cancel`` set while it waited)."""


class Cancel(Protocol):
    """What a start reads of its ``cancel``: a ``threading.Event``, or the flag a signal
    handler counts in (``chunkstore.daemon.signals.Signalled``)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...
