"""The vLLM instances behind the router: where each is, which daemon its node's pool is, its
health and its requests in flight; and the choice of one for a request.

The choice: among healthy instances, the one whose daemon holds the most of the request's
tokens (its stored chunk and prefix pieces), per request in flight there
(``tokens / (1 + in_flight)``); where none holds any, the least loaded, in turn. A daemon
that cannot be asked counts as holding nothing. Health: ``GET /health`` every
``interval`` seconds; a request that cannot connect marks its instance down at once, and
the next check (or a request it answers) brings it back. Where every instance is down, a
request still tries each: a check can time out under load.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import httpx

log = logging.getLogger("chunkstore.router")


class Reason(StrEnum):
    ONLY = "only"  # one healthy instance
    STORED = "stored"  # the most of the request's tokens stored, per request in flight
    LOAD = "load"  # nothing stored anywhere (or nothing to look up): the least loaded


@dataclass
class Instance:
    url: str
    daemon: str  # the address of the daemon whose pool this instance's connector uses
    healthy: bool = True
    in_flight: int = 0
    name: str = "an instance"  # what a client is told it is (not its address): "instance 2"

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")


@dataclass(frozen=True)
class Choice:
    instance: Instance
    reason: Reason
    stored_tokens: int  # of the request's cacheable tokens, held by its daemon


def parse_instance(text: str, default_daemon: str) -> Instance:
    """``URL`` or ``URL=DAEMON_ADDRESS`` (the daemon this instance's connector names)."""
    url, _, daemon = text.partition("=")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"an instance is http(s)://host:port[=daemon address], not {text!r}")
    return Instance(url, daemon or default_daemon)


class Instances:
    def __init__(self, instances: Sequence[Instance], kind: str = "instance") -> None:
        if not instances:
            raise ValueError("the router needs at least one instance")
        self.all = list(instances)
        for number, instance in enumerate(self.all, 1):
            instance.name = f"{kind} {number}"
        self._turn = itertools.count()

    def healthy(self, excluded: Sequence[Instance] = ()) -> list[Instance]:
        return [i for i in self.all if i.healthy and i not in excluded]

    def untried(self, tried: Sequence[Instance]) -> list[Instance]:
        return [i for i in self.all if i not in tried]

    def daemons(self, candidates: Sequence[Instance]) -> list[str]:
        return list(dict.fromkeys(i.daemon for i in candidates))

    def choose(self, candidates: Sequence[Instance], stored: dict[str, int]) -> Choice:
        """``stored``: daemon address -> the request's tokens it holds."""
        if len(candidates) == 1:
            only = candidates[0]
            return Choice(only, Reason.ONLY, stored.get(only.daemon, 0))
        turn = next(self._turn)
        order = {id(c): (k - turn) % len(candidates) for k, c in enumerate(candidates)}

        def worth(i: Instance) -> tuple[float, int, int]:
            return (stored.get(i.daemon, 0) / (1 + i.in_flight), -i.in_flight, -order[id(i)])

        best = max(candidates, key=worth)
        held = stored.get(best.daemon, 0)
        return Choice(best, Reason.STORED if held else Reason.LOAD, held)

    async def check(self, http: httpx.AsyncClient) -> None:
        async def one(instance: Instance) -> None:
            try:
                reply = await http.get(f"{instance.url}/health", timeout=5.0)
                up = reply.status_code == 200
            except httpx.HTTPError:
                up = False
            if up != instance.healthy:
                log.warning(
                    "chunkstore router: instance %s is %s", instance.url, "up" if up else "down"
                )
            instance.healthy = up

        await asyncio.gather(*(one(i) for i in self.all))

    async def watch(self, http: httpx.AsyncClient, interval: float) -> None:
        while True:
            await self.check(http)
            await asyncio.sleep(interval)
