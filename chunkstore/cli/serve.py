"""``chunkstore serve``: the daemon."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any


def run(args: argparse.Namespace) -> int:
    from chunkstore.daemon import config as config_module
    from chunkstore.daemon.server import serve
    from chunkstore.errors import ChunkStoreError

    names = {f.name for f in dataclasses.fields(config_module.ServeConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    try:
        config = config_module.load(args.config, flags=flags)
        return serve(config)
    except (ChunkStoreError, OSError, RuntimeError) as err:  # grpc: RuntimeError on bind
        print(f"chunkstore serve: {err}", file=sys.stderr)
        return 2


def add_commands(commands: Any) -> None:
    from chunkstore.daemon.config import add_flags

    serve = commands.add_parser(
        "serve",
        help="run the daemon that owns the chunk pool",
        description="Run the per-node daemon: a shared-memory chunk pool and its content-hash "
        "index behind gRPC on a unix socket and 127.0.0.1 TCP, with Prometheus "
        "metrics. Settings come from defaults < --config (TOML) < CHUNKSTORE_* "
        "environment < these flags; the result is logged on start. Prints one "
        "JSON 'ready' line with the bound addresses. SIGTERM drains and exits 0.",
    )
    serve.add_argument(
        "--config",
        default=None,
        help="TOML file of settings (names as the flags, with underscores)",
    )
    add_flags(serve)
    serve.set_defaults(func=run)
