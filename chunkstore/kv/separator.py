"""The separator that splits a chunked prompt, as token IDs of the served model's tokenizer.

``"auto"`` picks a special token of the vocabulary where it has a free one: a special token
is split off before BPE and never merges with the text around it, where a text separator can
(SmolLM2's ``##`` after a document ending in ``#``). The tokenizer is handed in: nothing here
loads one.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"
TEXT_SEPARATOR = "##"  # where the vocabulary has no free special token
# Special tokens that mean "a new document/file" in their models' training and that no chat
# template uses, by tokenizer family: SmolLM / StarCoder, Qwen2.5 / Qwen3, Llama 3.
SPECIAL_SEPARATORS = ("<file_sep>", "<|file_sep|>", "<|reserved_special_token_0|>")


def default_separator(tokenizer: Any) -> str:
    """The separator ``"auto"`` stands for with this tokenizer: the first of
    SPECIAL_SEPARATORS that is a special token of its vocabulary (one ID) and absent from its
    chat template, else ``##``."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    for name in SPECIAL_SEPARATORS:
        usable = is_special(tokenizer, name) and name not in template
        if usable and len(encode(tokenizer, name)) == 1:
            return name
    return TEXT_SEPARATOR


def resolve_separator(tokenizer: Any, separator: str) -> str:
    return default_separator(tokenizer) if separator == AUTO else separator


def separator_ids(tokenizer: Any, separator: str) -> list[int]:
    """The separator's token IDs (``"auto"`` resolved first)."""
    ids = encode(tokenizer, resolve_separator(tokenizer, separator))
    if not ids:
        raise ValueError(f"the separator {separator!r} tokenizes to nothing")
    return ids


def is_special(tokenizer: Any, separator: str) -> bool:
    """A special token of the vocabulary: split off before BPE, so it never merges."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    return any(t.content == separator and getattr(t, "special", False) for t in decoder.values())


def encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    """``text``'s token IDs (``special``: with the tokenizer's special tokens added, as
    vLLM's completions API adds them)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])
