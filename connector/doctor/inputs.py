"""What ``chunkstore doctor`` reads before anything runs, checked so that bad input is a
one-line refusal naming the file (exit 2), never a traceback, a hang or a vLLM started on
it: the model folder's files, its config's sizes, and the user's documents and questions."""

from __future__ import annotations

import json
import os
import reprlib
import stat
from pathlib import Path
from typing import Any

from chunkstore.errors import ChunkStoreError

# What the doctor reads itself (config.json, --docs, --questions) it reads whole, so at most
# this: a config is kilobytes, and one run's questions and documents far less than this.
MAX_FILE_BYTES = 64 << 20
# A config's sizes: each an integer from 1 to its cap, checked before transformers or vLLM
# size anything by them. Generous: the largest open models have ~130 layers, 128 heads, a
# hidden size of 16384, ~260k tokens and (MLA) 576 cached dims a token.
SIZE_CAPS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "hidden_size": 1 << 20,
    "head_dim": 1 << 16,
    "vocab_size": 1 << 24,
}
WEIGHTS = (".safetensors", ".bin", ".gguf")  # what vLLM loads (and weights_digest hashes)


class DoctorInputError(ChunkStoreError):
    """A documents or questions file the doctor cannot read: which file, line and why."""


def check_folder(model: Path) -> None:
    """Refuse, before anything opens them, what would block its reader (a FIFO, a device)
    among the files transformers and vLLM open; and a folder without weights."""
    weights = False
    for entry in sorted(model.iterdir()):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue  # a broken link: whatever needs it says so
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise DoctorInputError(f"{entry}: {_kind(mode)}, not a regular file")
        weights |= stat.S_ISREG(mode) and entry.suffix in WEIGHTS
    if not weights:
        raise DoctorInputError(f"{model}: no weights ({', '.join('*' + s for s in WEIGHTS)})")


def check_config(config: Any, where: str) -> None:
    """A model config's sizes (``SIZE_CAPS``) and rotary parameters, before transformers
    reads them: 0 heads divides by zero, 10**18 layers sizes lists, then vLLM's caches."""
    if not isinstance(config, dict):
        raise DoctorInputError(f"{where}: want a JSON object")
    for part in (config, config.get("text_config")):  # a multimodal model's sizes: text_config
        if not isinstance(part, dict):
            continue
        for key, cap in SIZE_CAPS.items():
            value = part.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap
            ):
                raise DoctorInputError(
                    f"{where}: {key} is {reprlib.repr(value)}: want an integer from 1 to {cap}"
                )
        for key in ("rope_parameters", "rope_scaling"):
            value = part.get(key)
            if value is not None and not isinstance(value, dict):
                raise DoctorInputError(f"{where}: {key} is {reprlib.repr(value)}: want an object")


def user_cases(docs_file: Path | None, questions_file: Path) -> list[Any]:
    """The user's questions as QA cases. ``docs_file``: JSON lines ``{"id", "text"}``;
    ``questions_file``: JSON lines ``{"question", "answers" (a list: every one must appear in
    the answer; or "answer", one string), "docs" (ids, in prompt order) or "documents"
    (texts), "relevant" (ids, optional)}``."""
    from chunkstore.bench.qa_cases import Case

    documents: dict[str, str] = {}
    for number, item in _json_lines(docs_file) if docs_file else []:
        if not isinstance(item.get("id"), str) or not isinstance(item.get("text"), str):
            raise DoctorInputError(f'{docs_file}:{number}: want {{"id": str, "text": str}}')
        documents[item["id"]] = item["text"]
    cases = []
    for number, item in _json_lines(questions_file):
        where = f"{questions_file}:{number}"
        answers = _strings(item, "answers", where)
        if answers is None and isinstance(item.get("answer"), str):
            answers = [item["answer"]]
        if not isinstance(item.get("question"), str) or not answers or not all(answers):
            raise DoctorInputError(
                f'{where}: want "question": str and "answers": [str, ...] (or "answer": str), '
                "the answers not empty"
            )
        ids = _strings(item, "docs", where) or []
        texts = _strings(item, "documents", where)
        if texts is None:
            missing = [d for d in ids if d not in documents]
            if missing or not ids:
                raise DoctorInputError(
                    f'{where}: "docs" names {missing or "nothing"} of {docs_file or "no --docs"}'
                )
            texts = [documents[d] for d in ids]
        elif not texts:
            raise DoctorInputError(f'{where}: "documents" is empty')
        relevant = _strings(item, "relevant", where) or []
        cases.append(
            Case(
                "user",
                tuple(texts),
                item["question"],
                tuple(answers),
                tuple(i for i, d in enumerate(ids) if d in relevant),
            )
        )
    if not cases:
        raise DoctorInputError(f"{questions_file}: no questions")
    return cases


def _strings(item: dict[str, Any], key: str, where: str) -> list[str] | None:
    """``item[key]``, a list of strings (None where absent). A string is refused, not taken
    for the list of its characters ("answers": "Paris" would want P, a, r, i and s)."""
    if key not in item:
        return None
    value = item[key]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DoctorInputError(f'{where}: "{key}" is {reprlib.repr(value)}: want a list of strings')
    return value


def _json_lines(path: Path) -> list[tuple[int, dict[str, Any]]]:
    items = []
    # JSON lines end at "\n" alone: str.splitlines would also split at a U+2028 in a string.
    for number, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        item = parse_json(line, f"{path}:{number}")
        if not isinstance(item, dict):
            raise DoctorInputError(f"{path}:{number}: want a JSON object")
        items.append((number, item))
    return items


def read_text(path: Path) -> str:
    """A file the doctor reads itself: a regular file (a FIFO or a device would block it or
    never end), of at most ``MAX_FILE_BYTES``, in UTF-8."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise DoctorInputError(f"{path}: {_kind(mode)}, not a regular file")
        # Non-blocking: were it swapped for a FIFO since, the open does not wait for a writer.
        with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise DoctorInputError(f"{path}: {err.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise DoctorInputError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB")
    try:
        return data.decode()
    except UnicodeDecodeError as err:
        raise DoctorInputError(f"{path}: not UTF-8 (byte {err.start})") from None


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:  # not JSON, or an integer of over 4300 digits
        raise DoctorInputError(f"{where}: not JSON: {getattr(err, 'msg', err)}") from None
    except RecursionError:
        raise DoctorInputError(f"{where}: not JSON: nested too deeply") from None


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")
