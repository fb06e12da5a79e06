"""A completion's text prompt tokenized in the router, not by a round trip to the instance.

The router's keys already come from the model folder the instances serve (its weights and
tokenizer: ``--model``), and vLLM tokenizes a completion's text with that folder's tokenizer
(``tokenizer(prompt, add_special_tokens=...)``), so the router can give the same token IDs
without asking: one ``POST /tokenize`` less a request, the most of what the router added to
a request whose work is done. The instance stays the judge: the first text an instance is
sent is tokenized both ways and compared, and one in ``check_every`` after that is compared
again beside the request (it is not held up). A difference (another tokenizer revision, a
``--tokenizer`` or ``--tokenizer-mode`` of the instance's own) and that instance tokenizes
every prompt from then on, counted in ``chunkstore_router_tokenizer_mismatch_total`` and
logged. IDs only decide keys, lookups, placement and the order the relevant documents are
sent in; the KV served is always the connector's, for the IDs vLLM runs.

A chat request is rendered by the instance's chat template, so it is always tokenized there.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("chunkstore.router")

TOKENIZE = ("router", "instance")  # where texts are tokenized: `chunkstore router --tokenize`
CHECK_EVERY = 64  # texts tokenized here per comparison with the instance, once it agreed


class Tokenizer:
    """The model folder's tokenizer, and what each instance said of it (by URL)."""

    def __init__(self, tokenizer: Any, check_every: int = CHECK_EVERY) -> None:
        self.tokenizer = tokenizer
        self.check_every = check_every
        self._agrees: dict[str, bool] = {}  # absent: not yet compared
        self._since: dict[str, int] = {}

    @classmethod
    def for_model(cls, model: Any) -> Tokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model))

    @staticmethod
    def reads(body: dict[str, Any]) -> bool:
        """Whether ``body`` (a ``/tokenize`` body) is a text this tokenizer gives IDs for."""
        return isinstance(body.get("prompt"), str) and "messages" not in body

    def ids(self, body: dict[str, Any]) -> list[int]:
        special = body.get("add_special_tokens", True)
        found = self.tokenizer(body["prompt"], add_special_tokens=bool(special))["input_ids"]
        return [int(t) for t in found]

    def agrees(self, instance: str) -> bool | None:
        """True: ``instance`` gave the same IDs; False: it did not once; None: not asked."""
        return self._agrees.get(instance)

    def due(self, instance: str) -> bool:
        """Whether this text, tokenized here for ``instance``, is one to compare again."""
        count = self._since.get(instance, 0) + 1
        self._since[instance] = 0 if count >= self.check_every else count
        return count >= self.check_every

    def compared(self, instance: str, ours: list[int], theirs: list[int]) -> bool:
        """Record the instance's IDs for a text beside ours; whether they are the same."""
        if ours == theirs:
            self._agrees.setdefault(instance, True)
            return True
        if self._agrees.get(instance) is not False:
            log.warning(
                "chunkstore router: %s tokenizes a text otherwise than the router's --model "
                "tokenizer (%d IDs against the router's %d): it tokenizes every prompt from "
                "now on",
                instance,
                len(theirs),
                len(ours),
            )
        self._agrees[instance] = False
        return False
