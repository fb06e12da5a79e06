"""A completion's text prompt tokenized in the router, not by a round trip to the instance.

The router's keys already come from the model folder the instances serve (its weights and
tokenizer: ``--model``), and vLLM tokenizes a completion's text with that folder's tokenizer
(``tokenizer(prompt, add_special_tokens=...)``), so the router can give the same token IDs
without asking: one ``POST /tokenize`` less a request, the most of what the router added to
a request whose work is done. It does so only for an instance whose tokenizer is proven to
be this one (``proof``: at start-up and after the instance was down, the instance's
``/tokenize`` and ``/detokenize`` on a probe set, ``probes``, must give exactly this
tokenizer's answers); until then, and for an instance whose tokenizer differs, the instance
tokenizes every prompt and the router sends the instance's own IDs, never its own. One
text in ``check_every`` is still compared beside its request; a difference (an instance
restarted with another tokenizer) makes that instance unproven again, counted in
``chunkstore_router_tokenizer_mismatch_total`` and logged, and the text joins the probes of
its next proof: a text that differs fails the proof, a request's odd field cannot (both
sides read its fields as vLLM does: ``fields``). IDs only decide keys, lookups, placement
and the order the relevant documents are sent in; the KV served is always the connector's,
for the IDs vLLM runs.

A chat request is rendered by the instance's chat template, so it is always tokenized there.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("chunkstore.router")

TOKENIZE = ("router", "instance")  # where texts are tokenized: `chunkstore router --tokenize`
CHECK_EVERY = 64  # texts tokenized here per comparison with the instance, once it agreed


# Probe texts of the proof beside each tokenizer's own strings: what a normalizer, a
# pre-tokenizer or an added token's lstrip / rstrip / single_word settings change.
PROBE_TEXTS = (
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ ｱｲｳ ①②③ ﬁﬂ Ⅻ ㎏ ½ ™",  # NFKC
    "cafe\u0301 café Ångström ÅNGSTRÖM İstanbul straße ΣΊΣΥΦΟΣ Ǆ",  # NFC / NFD, case
    "東京都 日本語 한국어 العربية עברית हिन्दी ไทย 👩\u200d💻 🇫🇷 \u200b\ufeff\u00a0x",
    "a  b   c    d\t\te\n\n\nf \r\n g      \u3000 h\n",
    "   leading and trailing spaces   ",
    "Question 12,345.67: don't WON'T y'all -- ... !!! ??? 'quoted' \"double\"",
)
IDS_PER_PROBE = 4096  # vocabulary IDs per /detokenize and per vocabulary text
DIFFERED_KEPT = 8  # texts that differed, kept for an instance's next proof


class Tokenizer:
    """The model folder's tokenizer, and what is known of each instance's (by URL)."""

    def __init__(self, tokenizer: Any, check_every: int = CHECK_EVERY) -> None:
        self.tokenizer = tokenizer
        self.check_every = check_every
        self._proven: dict[str, bool] = {}  # True: identical; False: differs; absent: unproven
        self._since: dict[str, int] = {}
        self._differed: dict[str, list[dict[str, Any]]] = {}  # texts for the next proof

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
        if type(special) is not bool:  # read by ``fields`` as vLLM reads it, never truthiness
            raise TypeError(f"add_special_tokens must be read as vLLM reads it: {special!r}")
        found = self.tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]
        return [int(t) for t in found]

    def agrees(self, instance: str) -> bool | None:
        """True: ``instance``'s tokenizer is proven to be this one; False: it is proven not to
        be; None: not proven (yet, or again)."""
        return self._proven.get(instance)

    def proved(self, instance: str, identical: bool) -> None:
        self._proven[instance] = identical
        if identical:
            self._differed.pop(instance, None)

    def forget(self, instance: str) -> None:
        """``instance`` went down: what it runs when it is back is proven again."""
        self._proven.pop(instance, None)

    def due(self, instance: str) -> bool:
        """Whether this text, tokenized here for ``instance``, is one to compare again."""
        count = self._since.get(instance, 0) + 1
        self._since[instance] = 0 if count >= self.check_every else count
        return count >= self.check_every

    def compared(
        self, instance: str, body: dict[str, Any], ours: list[int], theirs: list[int]
    ) -> bool:
        """Record the instance's IDs for a text beside ours; whether they are the same. A
        difference makes the instance unproven, and the text one of its next proof's."""
        if ours == theirs:
            return True
        log.warning(
            "chunkstore router: %s tokenizes a text otherwise than the router's --model "
            "tokenizer (%d IDs against the router's %d): it tokenizes every prompt until its "
            "tokenizer is proven again",
            instance,
            len(theirs),
            len(ours),
        )
        if self._proven.get(instance) is True:
            del self._proven[instance]
        differed = self._differed.setdefault(instance, [])
        if len(differed) < DIFFERED_KEPT:
            special = body.get("add_special_tokens", True)
            differed.append({"prompt": body["prompt"], "add_special_tokens": special})
        return False

    def probes(self, instance: str) -> list[tuple[str, dict[str, Any], Any]]:
        """The proof's requests to ``instance`` and the answer each must get: ``(path, body,
        answer)``. Every ID's text (``/detokenize``, in parts), none past the last; each
        added and special token in the contexts its settings change, the probe texts and
        the vocabulary's own strings (``/tokenize``, with special tokens and without); and
        the texts that differed since the last proof."""
        tok = self.tokenizer
        size = len(tok)
        asked: list[tuple[str, dict[str, Any], Any]] = []
        for start in range(0, size, IDS_PER_PROBE):
            part = list(range(start, min(start + IDS_PER_PROBE, size)))
            asked.append(("/detokenize", {"tokens": part}, tok.decode(part)))
        asked.append(("/detokenize", {"tokens": [size]}, ""))  # no token past ours
        added = {t.content for t in tok.added_tokens_decoder.values()}
        added |= set(tok.all_special_tokens)
        contexts = "".join(f"{t}x {t} \n{t}\ta{t}b  {t}{t}" for t in sorted(added))
        texts = [contexts, *PROBE_TEXTS]
        for start in range(0, size, IDS_PER_PROBE):
            ids = range(start, min(start + IDS_PER_PROBE, size))
            texts.append(" ".join(tok.batch_decode([[i] for i in ids])))
        bodies = [{"prompt": t, "add_special_tokens": s} for t in texts for s in (True, False)]
        for body in [*bodies, *self._differed.get(instance, [])]:
            asked.append(("/tokenize", body, self.ids(body)))
        return asked
