"""Chunked prompts as RAG apps send them: text to ``/v1/completions`` or chat messages to
``/v1/chat/completions``, tokenized exactly as vLLM tokenizes them.

A text prompt is ``sys SEP doc SEP doc ... SEP question``; vLLM tokenizes it whole (special
tokens added as its completions API does). A chat request is a system message and a user
message ``SEP doc SEP doc ... SEP question``; vLLM renders the model's chat template to text
and tokenizes that (no special tokens added). Either way the connector splits the token IDs at
the separator's tokens, so the sys segment of a chat request is everything the template
renders before the first separator.

``RagPrompts`` builds both shapes, the ingest prompt of a document in the same shape (so what
ingest stores is keyed as a request will look it up), the keys of documents, and the
hits-first order of a request's documents. ``check`` tells whether a document's tokens change
beside the separator: a text separator can merge with the text around it (SmolLM2's ``##``
after a document ending in ``#``); a special token of the vocabulary is split off before BPE
and never merges, which is why ``"auto"`` picks one where the vocabulary has a free one
(``chunkstore.kv.separator``). The keys are the connector's (``chunkstore.kv.keyspace``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chunkstore.kv.fingerprint import ModelFingerprint, fingerprint_of_folder
from chunkstore.kv.keys import Isolation
from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.segments import Segment, SegmentKind, find_separators, split_prompt
from chunkstore.kv.separator import (
    AUTO,
    SPECIAL_SEPARATORS,
    TEXT_SEPARATOR,
    default_separator,
    is_special,
    resolve_separator,
    separator_ids,
)
from chunkstore.kv.separator import encode as _encode

# The separator's choice lives with the keys (``chunkstore.kv.separator``); apps find it here.
__all__ = [
    "AUTO",
    "SPECIAL_SEPARATORS",
    "TEXT_SEPARATOR",
    "RagPrompts",
    "default_separator",
    "is_special",
    "resolve_separator",
    "separator_ids",
]


@dataclass
class RagPrompts:
    """Chunked prompts for one model, sys prompt and shape (``chat`` or text).

    ``sys_text`` None in a chat: no system message (the template's default one, if any, is
    the sys segment). ``chat_template``: the template vLLM was started with
    (``--chat-template``), if not the model's own. ``fingerprint``, ``isolation`` and
    ``virtual_gap`` are the connector's, ``cache_salt`` the requests' (vLLM's): they key the
    entries (needed for ``keys`` and ``hits_first`` only).
    """

    tokenizer: Any
    sys_text: str | None
    chat: bool = False
    separator: str | list[int] = AUTO  # text, "auto", or token IDs
    fingerprint: ModelFingerprint | None = None
    isolation: Isolation = Isolation.SYS
    virtual_gap: int = 0
    chat_template: str | None = None  # as vLLM's --chat-template; None: the tokenizer's own
    cache_salt: str = ""  # the requests' cache_salt: part of every key ("" = shared)
    sep_text: str = field(init=False)  # the separator as text goes in a prompt
    sep_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.separator, list):
            self.sep_ids = [int(t) for t in self.separator]
            self.sep_text = str(self.tokenizer.decode(self.sep_ids))
        else:
            self.sep_text = resolve_separator(self.tokenizer, self.separator)
            self.sep_ids = separator_ids(self.tokenizer, self.sep_text)
        if not self.chat and self.sys_text is None:
            raise ValueError("a text prompt needs a sys text ('' for none)")
        if not find_separators(self.sys_prompt(), self.sep_ids):
            raise ValueError(
                f"the separator {self.sep_text!r} is not found where sys ends: the sys text's "
                "end merges with it, or the chat template does not render the user message"
            )

    @classmethod
    def for_model(
        cls, model: str | Path, sys_text: str | None, dtype: str = "float32", **kwargs: Any
    ) -> RagPrompts:
        """From a model folder: its tokenizer, and its fingerprint for the keys."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        return cls(tokenizer, sys_text, fingerprint=fingerprint_of_folder(model, dtype), **kwargs)

    # -- the request, as an app sends it --------------------------------------------------

    def user_content(self, docs: Sequence[str], question: str | None) -> str:
        """A chat request's user message: ``SEP doc SEP doc ... SEP question``."""
        return "".join(self.sep_text + d for d in docs) + self.sep_text + (question or "")

    def messages(self, docs: Sequence[str], question: str | None) -> list[dict[str, str]]:
        system = [] if self.sys_text is None else [{"role": "system", "content": self.sys_text}]
        return [*system, {"role": "user", "content": self.user_content(docs, question)}]

    def text(self, docs: Sequence[str], question: str | None) -> str:
        """A completions prompt: ``sys SEP doc SEP doc ... SEP question``."""
        return (self.sys_text or "") + self.user_content(docs, question)

    def token_ids(self, docs: Sequence[str], question: str | None) -> list[int]:
        """The prompt's token IDs as vLLM computes them from ``messages`` (chat) or ``text``."""
        if self.chat:
            rendered = self.tokenizer.apply_chat_template(
                self.messages(docs, question),
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )
            return _encode(self.tokenizer, rendered)
        return _encode(self.tokenizer, self.text(docs, question), special=True)

    def segments(self, docs: Sequence[str], question: str | None) -> list[Segment]:
        return split_prompt(self.token_ids(docs, question), self.sep_ids)

    # -- ingest and keys -----------------------------------------------------------------

    def ingest_prompt(self, doc: str) -> tuple[list[int], Segment, bytes] | None:
        """The prompt that stores ``doc`` (``sys SEP doc SEP`` in this shape; ``doc SEP`` in
        isolation none, where a chunk sees nothing but itself), the doc's segment in it and
        its key; None if the doc does not come out as one segment (it holds or merges with
        the separator: ``check`` says which)."""
        if self.isolation is Isolation.NONE:
            ids, index = _encode(self.tokenizer, doc) + self.sep_ids, 0
        else:
            ids, index = self.token_ids([doc], None), 1
        segments = split_prompt(ids, self.sep_ids)
        kinds = [s.kind for s in segments if s.kind is not SegmentKind.QUESTION]
        if kinds != [SegmentKind.SYS, SegmentKind.CHUNK][: index + 1]:
            return None
        key = self.keys(segments)[index]
        assert key is not None
        return ids, segments[index], key

    def sys_prompt(self) -> list[int]:
        """A prompt that holds sys and nothing to cache after it."""
        return self.token_ids([], None)

    def keys(self, segments: Sequence[Segment]) -> list[bytes | None]:
        """The entry keys of one of these prompts' segments (None for the question)."""
        return self.key_space.segment_keys(segments, self.cache_salt)

    @property
    def key_space(self) -> KeySpace:
        """The connector's key space for these prompts' model, separator and settings."""
        if self.fingerprint is None:
            raise ValueError("keys need the model's fingerprint (RagPrompts.for_model)")
        return KeySpace(self.fingerprint, tuple(self.sep_ids), self.isolation, self.virtual_gap)

    def doc_keys(self, docs: Sequence[str]) -> list[bytes | None]:
        """Each document's entry key as a request holds it (None: it does not segment)."""
        return [found[2] if (found := self.ingest_prompt(d)) else None for d in docs]

    def hits_first(self, client: Any, docs: Sequence[str]) -> list[str]:
        """``docs`` reordered: those the daemon holds first, then the rest, each group in its
        given order. The connector loads the run of stored chunks from the start of a prompt,
        so a stored document after a new one is computed again; hits-first loads them all.
        It moves documents, hence their positions: the answer can change slightly."""
        keys = self.doc_keys(docs)
        known = [k for k in keys if k is not None]
        found = iter(client.lookup(known) if known else [])
        stored = [k is not None and next(found) is not None for k in keys]
        return [d for d, s in zip(docs, stored, strict=True) if s] + [
            d for d, s in zip(docs, stored, strict=True) if not s
        ]

    # -- separator check -------------------------------------------------------------------

    def check(self, doc: str, question: str = "Which one?") -> str | None:
        """Why ``doc``'s tokens differ beside the separator from its tokens alone (so keys
        built from either do not meet, and a split can go wrong), or None."""
        alone = _encode(self.tokenizer, doc)
        if find_separators(alone, self.sep_ids):
            return f"it holds the separator {self.sep_text!r}: it would be split in two"
        chunks = [s for s in self.segments([doc], question) if s.kind is SegmentKind.CHUNK]
        if len(chunks) != 1:
            return f"its start or end merges with the separator {self.sep_text!r}"
        in_context = list(chunks[0].token_ids[: -len(self.sep_ids)])
        if in_context != alone:
            return (
                f"its tokens differ beside the separator {self.sep_text!r} "
                f"({len(in_context)} tokens in context, {len(alone)} alone)"
            )
        return None
