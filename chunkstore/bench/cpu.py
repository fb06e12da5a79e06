"""CPU time a bench's processes spent over its traffic, each with its descendants (vLLM's
API server and its EngineCore), read from /proc: where a way's CPU goes a request, on a host
where they all share the same few cores."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def processes(proc: Path = Path("/proc")) -> dict[int, tuple[int, float]]:
    """Each live process: its parent and its own CPU seconds (user + system)."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
        found[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return found


def tree(root: int, stats: dict[int, tuple[int, float]]) -> list[int]:
    """``root`` and its live descendants in ``stats`` (``processes``), root first."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(child for child, (parent, _) in stats.items() if parent == pid)
    return found


def tree_seconds(pids: dict[str, int], proc: Path = Path("/proc")) -> dict[str, float]:
    """CPU seconds of each named process and its live descendants."""
    stats = processes(proc)
    return {
        name: sum(stats.get(pid, (0, 0.0))[1] for pid in tree(root, stats))
        for name, root in pids.items()
    }


def _own() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


@contextlib.contextmanager
def cpu_per_request(pids: dict[str, int], requests: int, into: dict[str, object]) -> Iterator[None]:
    """Around the traffic: ``into["cpu_ms_per_request"]``, each named process tree's CPU
    milliseconds over the block a request, and the bench's own client's (``client``)."""
    before, mine = tree_seconds(pids), _own()
    yield
    after = tree_seconds(pids)
    spent = {name: after[name] - before[name] for name in pids} | {"client": _own() - mine}
    into["cpu_ms_per_request"] = {k: round(1000 * v / requests, 1) for k, v in spent.items()}
