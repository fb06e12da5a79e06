"""``chunkstore proxy``: prefill/decode disaggregation in front of vLLM instances."""

from __future__ import annotations

import argparse
import json
from typing import Any


def run(args: argparse.Namespace) -> int:
    from chunkstore.proxy import Proxy, serve

    server = serve(args.host, args.port, Proxy(args.prefill, args.decode, args.timeout))
    port = server.server_address[1]
    print(json.dumps({"proxy": f"http://{args.host}:{port}"}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def add_commands(commands: Any) -> None:
    proxy = commands.add_parser(
        "proxy",
        help="prefill/decode disaggregation in front of vLLM instances sharing chunkstore",
        description="Send each OpenAI request (completions or chat, one prompt, not streamed) "
        "to a prefill instance (kv_role kv_producer) for its first token, then to a decode "
        "instance (kv_role kv_consumer) for the rest: the decode instance loads the whole "
        "prompt's KV from chunkstore and computes none of it. Instances are used in turn. "
        "See docs/connector.md, 'Prefill/decode disaggregation'.",
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
