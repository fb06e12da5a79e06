"""Whether each instance's tokenizer is the router's, proven before the router sends its own
token IDs there (``tokens``).

One text that tokenizes alike proves little: a tokenizer revision with one more special
token gives the same IDs for every text but those holding it. The proof asks the instance
for what identity means, on a probe set (``Tokenizer.probes``): the text of every ID of the
vocabulary and of none past it (``/detokenize``: the same vocabulary, added and special
tokens included, and nothing more), and the IDs of texts that exercise each added and
special token, the normalizer, the pre-tokenizer, unicode and whitespace runs, and the
vocabulary's own strings (``/tokenize``, with special tokens and without). Every answer must
be exactly the router's. vLLM serves both endpoints without an API key.

Proven at start-up and again whenever the instance was down (it may come back on another
tokenizer), or after a sampled text differed (that text is then one of the probes); an
instance that does not answer is asked again every ``interval`` seconds. Counted in
``chunkstore_router_tokenizer_proofs_total{result}``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from .instances import Instance, Instances
from .metrics import RouterMetrics
from .tokens import Tokenizer

log = logging.getLogger("chunkstore.router")

IDENTICAL, DIFFERS, UNANSWERED = "identical", "differs", "unanswered"


class Prover:
    def __init__(self, http: httpx.AsyncClient, tokenizer: Tokenizer, metrics: RouterMetrics):
        self.http = http
        self.tokenizer = tokenizer
        self.metrics = metrics

    async def keep(self, instances: Instances, interval: float) -> None:
        """Prove each instance that is up and unproven, every ``interval`` seconds."""
        while True:
            for instance in instances.all:
                if not instance.healthy:
                    self.tokenizer.forget(instance.url)
                elif self.tokenizer.agrees(instance.url) is None:
                    await self.prove(instance)
            await asyncio.sleep(interval)

    async def prove(self, instance: Instance) -> str:
        """Ask ``instance`` the probe set: IDENTICAL (the router may send its own IDs there),
        DIFFERS (never), UNANSWERED (not yet: asked again)."""
        probes = await asyncio.to_thread(self.tokenizer.probes, instance.url)
        result = IDENTICAL
        for path, body, answer in probes:
            found = await self._ask(instance, path, body)
            if found is None and path == "/detokenize" and answer == "":
                continue  # an ID past the vocabulary refused: no token there
            if found is None:
                result = UNANSWERED
                break
            if found != answer:
                log.warning(
                    "chunkstore router: %s's tokenizer is not the router's --model tokenizer "
                    "(%s of %.80r): it tokenizes every prompt the router sends it",
                    instance.url,
                    path,
                    body.get("prompt", body.get("tokens")),
                )
                result = DIFFERS
                break
        if result != UNANSWERED:
            self.tokenizer.proved(instance.url, result == IDENTICAL)
        self.metrics.tokenizer_proofs.labels(result).inc()
        return result

    async def _ask(self, instance: Instance, path: str, body: dict[str, Any]) -> Any:
        """The instance's answer (its IDs, or its text); None where it gives none."""
        try:
            reply = await self.http.post(f"{instance.url}{path}", json=body, timeout=60.0)
            if reply.status_code != 200:
                return None
            found = reply.json()
            return [int(t) for t in found["tokens"]] if path == "/tokenize" else found["prompt"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
