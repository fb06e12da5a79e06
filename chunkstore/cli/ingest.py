"""``chunkstore ingest`` (pre-warm a corpus through vLLM) and ``chunkstore
check-separator`` (the documents whose tokens change beside the separator): both shape
prompts as the app will."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .common import add_daemon_address


def _prompts(args: argparse.Namespace, sys_text: str | None) -> Any:
    from chunkstore.kv.keys import Isolation
    from chunkstore.prompts import RagPrompts

    return RagPrompts.for_model(
        args.model,
        sys_text,
        args.dtype,
        chat=args.chat,
        separator=args.separator,
        isolation=Isolation(getattr(args, "isolation", "sys")),
        virtual_gap=getattr(args, "virtual_gap", 0),
        cache_salt=getattr(args, "cache_salt", ""),
        chat_template=Path(args.chat_template).read_text() if args.chat_template else None,
    )


def _sys_text(args: argparse.Namespace) -> str | None:
    return Path(args.sys_file).read_text() if args.sys_file else args.sys


def _ingest(args: argparse.Namespace) -> int:
    from chunkstore.client import ChunkStoreClient
    from chunkstore.errors import ChunkStoreError
    from chunkstore.ingest import Refused, ServerBackend, ingest, print_progress, read_corpus

    sys_text = _sys_text(args)
    if sys_text is None and not args.chat:
        print("chunkstore ingest: give --sys TEXT or --sys-file FILE", file=sys.stderr)
        return 2
    try:
        chunks = read_corpus(args.corpus)
        prompts = _prompts(args, sys_text)

        def refused(r: Refused) -> None:
            print(
                f"chunkstore ingest: {args.corpus} chunk {r.index + 1} not stored: {r.why} "
                "(chunkstore check-separator says how to fix it)",
                file=sys.stderr,
            )

        backend = ServerBackend(args.server, args.served_model_name or args.model)
        with ChunkStoreClient(args.address, token=args.token or None) as client:
            summary = ingest(
                backend,
                client,
                prompts,
                chunks,
                args.batch_size,
                None if args.quiet else print_progress,
                refused,
            )
    except (ChunkStoreError, OSError, ValueError) as err:
        print(f"chunkstore ingest: {err}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(summary)))
    return 0 if summary.failed == 0 else 1


def _check_separator(args: argparse.Namespace) -> int:
    """Exit 1 if some document's tokens change beside the separator."""
    from chunkstore.ingest import read_corpus
    from chunkstore.prompts import SPECIAL_SEPARATORS, default_separator, is_special

    try:
        chunks = read_corpus(args.corpus)
        sys_text = _sys_text(args)
        prompts = _prompts(args, sys_text if args.chat else sys_text or "")
    except (OSError, ValueError) as err:
        print(f"chunkstore check-separator: {err}", file=sys.stderr)
        return 2
    problems = [(i, why) for i, c in enumerate(chunks) if (why := prompts.check(c))]
    special = is_special(prompts.tokenizer, prompts.sep_text)
    if special:
        fix = "reword these documents (a special-token separator never merges with text)"
    elif (auto := default_separator(prompts.tokenizer)) != prompts.sep_text:
        fix = (
            f"use the special token {auto!r} as separator (separator 'auto', the default): "
            "it is split off before BPE and never merges"
        )
    else:
        fix = (
            "this vocabulary has none of the special tokens 'auto' picks from "
            f"({', '.join(SPECIAL_SEPARATORS)}): choose a separator text that no document "
            "starts or ends with, or reword these documents"
        )
    for index, why in problems:
        text = chunks[index]
        shown = text if len(text) <= 60 else text[:28] + " ... " + text[-27:]
        print(f"{args.corpus} chunk {index + 1}: {why}: {shown!r}")
    print(
        json.dumps(
            {
                "separator": prompts.sep_text,
                "separator_ids": prompts.sep_ids,
                "special_token": special,
                "chunks": len(chunks),
                "differ": len(problems),
                **({"fix": fix} if problems else {}),
            }
        )
    )
    return 1 if problems else 0


def _add_prompt_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="the model folder vLLM serves (its weights key the entries)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="chat requests (/v1/chat/completions): sys is the system message as the model's "
        "chat template renders it, the documents are in the user message",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="with --chat: the template vLLM serves with, if it was started with "
        "--chat-template (default: the model's own)",
    )
    parser.add_argument(
        "--sys",
        default=None,
        help="the sys prompt (the system message with --chat; none there if left out)",
    )
    parser.add_argument("--sys-file", default=None, help="... or a file holding it")
    parser.add_argument(
        "--separator",
        default="auto",
        help="as the connector's: auto (default: a special token of the vocabulary where it "
        "has a free one, <file_sep> for SmolLM2, else ##), a text, or a special token",
    )
    parser.add_argument(
        "--dtype", default="float32", help="the KV cache dtype vLLM runs with (default float32)"
    )


def add_commands(commands: Any) -> None:
    ingest = commands.add_parser(
        "ingest",
        help="pre-warm a corpus of chunks under a sys prompt through vLLM",
        description="Send each chunk of a corpus through a running vllm serve that has the "
        "connector, as the app will send it (text 'sys SEP chunk SEP', or with --chat a "
        "system message and a user message 'SEP chunk SEP' rendered by the model's chat "
        "template), so later RAG requests load it instead of computing it. Chunks already "
        "stored are skipped; chunks whose tokens change beside the separator are not sent "
        "(see check-separator). Prints a JSON summary: chunks, tokens, stored, "
        "already_present, failed; exits 1 if any failed.",
    )
    ingest.add_argument("corpus", help="one chunk per line: text, or JSON lines with 'text'")
    _add_prompt_shape(ingest)
    ingest.add_argument(
        "--server",
        default="http://127.0.0.1:8000",
        help="vllm serve's base URL (default http://127.0.0.1:8000)",
    )
    ingest.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the server answers to (default: --model)",
    )
    add_daemon_address(ingest)
    ingest.add_argument("--isolation", choices=["sys", "none"], default="sys")
    ingest.add_argument(
        "--virtual-gap",
        type=int,
        default=0,
        help="as the connector's virtual_gap (default 0): it is part of the chunks' keys",
    )
    ingest.add_argument(
        "--cache-salt",
        default="",
        help="vLLM's cache_salt, as the app's requests will carry it: part of every key, so "
        "only requests with the same salt load these chunks (default: none, the shared "
        "namespace)",
    )
    ingest.add_argument("--batch-size", type=int, default=8, help="chunks per request (8)")
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    ingest.set_defaults(func=_ingest)

    check = commands.add_parser(
        "check-separator",
        help="find the documents whose tokens change beside the separator",
        description="A separator written as text can merge with the text around it (with "
        "SmolLM2's '##', a document ending in '#'), which changes the chunk's tokens: it "
        "never hits, or splits in the wrong place. For each document of CORPUS, compare "
        "its tokens in a request (between sys and a question, in the chat or text shape) "
        "with its tokens alone; print each one that differs and why, then a JSON summary "
        "with the fix. Exit 1 if any differs.",
    )
    check.add_argument("corpus", help="one chunk per line: text, or JSON lines with 'text'")
    _add_prompt_shape(check)
    check.set_defaults(func=_check_separator)
