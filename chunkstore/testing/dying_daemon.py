"""A real ``chunkstore serve`` that SIGKILLs itself when one RPC arrives, once armed: for
tests of the daemon dying in the middle of a request. Test-only: it swaps one method of the
service class before serving; everything else is the daemon as shipped.

    python -m chunkstore.testing.dying_daemon --die-on Read --armed-by FILE serve [flags...]

Until FILE exists the daemon serves normally (so a test can warm it first).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from chunkstore import cli
from chunkstore.daemon.server import ChunkStoreService


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--die-on", required=True, help="RPC method name, e.g. Read, Release")
    parser.add_argument("--armed-by", required=True, type=Path)
    args, serve = parser.parse_known_args()
    served = getattr(ChunkStoreService, args.die_on)

    def die_when_armed(self: ChunkStoreService, request: Any, context: Any) -> Any:
        if args.armed_by.exists():
            print(f"dying_daemon: SIGKILL on {args.die_on}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return served(self, request, context)

    setattr(ChunkStoreService, args.die_on, die_when_armed)
    return cli.main(serve)


if __name__ == "__main__":
    sys.exit(main())
