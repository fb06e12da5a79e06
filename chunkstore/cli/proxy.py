"""``chunkstore proxy``: prefill/decode disaggregation in front of vLLM instances; the
router's prefill/decode mode without a model (chunkstore/router/disagg.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def run(args: argparse.Namespace) -> int:
    from chunkstore.protocol.endpoints import default_address
    from chunkstore.router.app import RouterSettings
    from chunkstore.router.instances import parse_instance

    try:
        prefill = [parse_instance(t, default_address()) for t in args.prefill]
        decode = [parse_instance(t, default_address()) for t in args.decode]
    except ValueError as err:
        print(f"chunkstore proxy: {err}", file=sys.stderr)
        return 2
    settings = RouterSettings(None, prefill, decode, cold_chunks=False, timeout=args.timeout)
    from .router import serve

    return serve(settings, args.host, args.port, "warning")


def add_commands(commands: Any) -> None:
    proxy = commands.add_parser(
        "proxy",
        help="prefill/decode disaggregation in front of vLLM instances sharing chunkstore",
        description="Send each OpenAI request (completions or chat, one prompt, streamed or "
        "not) to a prefill instance (kv_role kv_producer) for its first token, then to a "
        "decode instance (kv_role kv_consumer) for the rest: the decode instance loads the "
        "whole prompt's KV from chunkstore and computes none of it. Prefill instances are "
        "used in turn, decode instances least loaded first. This is `chunkstore router "
        "--prefill URL --decode URL` without --model; the router with --model also stores "
        "cold chunks and routes to them. See docs/prefix-sharing.md#prefilldecode-disaggregation.",
    )
    proxy.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="repeatable"
    )
    proxy.add_argument("--decode", action="append", required=True, metavar="URL", help="repeatable")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on (8000; 0: any)")
    proxy.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per instance request (600)"
    )
    proxy.set_defaults(func=run)
