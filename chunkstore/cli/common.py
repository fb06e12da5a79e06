"""What several commands share: the daemon's address and token flags."""

from __future__ import annotations

import argparse


def add_daemon_address(parser: argparse.ArgumentParser, token: bool = True) -> None:
    from chunkstore.protocol.endpoints import default_address

    parser.add_argument(
        "--address",
        default=default_address(),
        help="the daemon: unix:/path or host:port (default: the default socket)",
    )
    if token:
        parser.add_argument(
            "--token",
            default=None,
            help="bearer token, if the daemon has one (evict, clear, pin, unpin, drain and "
            "undrain need its admin token)",
        )
