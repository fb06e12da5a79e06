"""Where a node's daemon listens unless told otherwise: the one address both the daemon and
its clients must agree on without configuration."""

from __future__ import annotations

import os
from pathlib import Path


def default_socket() -> str:
    """``$XDG_RUNTIME_DIR/chunkstore.sock``, else ``/tmp/chunkstore-$UID/chunkstore.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime else Path("/tmp") / f"chunkstore-{os.getuid()}"
    return str(base / "chunkstore.sock")


def default_address() -> str:
    """The node's daemon when no address is configured: its default unix socket."""
    return f"unix:{default_socket()}"
