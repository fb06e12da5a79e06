"""A real ``chunkstore serve`` that fails on purpose once armed, for tests of what the
daemon's neighbours do then. Test-only: it swaps one method before serving; everything else
is the daemon as shipped.

    python -m chunkstore.testing.dying_daemon --armed-by FILE FAULT serve [flags...]

FAULT is one of:
  --die-on RPC      SIGKILL itself when that RPC (Read, Release, ...) arrives;
  --bad-acquire dtype|count
                    answer every Acquire malformed, as a broken peer could: leases whose
                    layout names an unknown dtype, or one lease too many;
  --reaper-raises RuntimeError|SystemExit
                    raise that in every step of its reaper thread, as a bug would (a
                    SystemExit ends the thread).

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
from chunkstore.daemon.index import Index
from chunkstore.daemon.service import ChunkStoreService


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--die-on", help="RPC method name, e.g. Read, Release")
    fault.add_argument("--bad-acquire", choices=("dtype", "count"))
    fault.add_argument("--reaper-raises", choices=("RuntimeError", "SystemExit"))
    parser.add_argument("--armed-by", required=True, type=Path)
    args, serve = parser.parse_known_args()
    armed: Path = args.armed_by

    if args.die_on:
        served = getattr(ChunkStoreService, args.die_on)

        def die_when_armed(self: ChunkStoreService, request: Any, context: Any) -> Any:
            if armed.exists():
                print(f"dying_daemon: SIGKILL on {args.die_on}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return served(self, request, context)

        setattr(ChunkStoreService, args.die_on, die_when_armed)
    elif args.bad_acquire:
        acquire = ChunkStoreService.Acquire

        def malformed(self: ChunkStoreService, request: Any, context: Any) -> Any:
            reply = acquire(self, request, context)
            if armed.exists() and args.bad_acquire == "dtype":
                for lease in reply.leases:
                    lease.layout.dtype = "float12"
            elif armed.exists():
                reply.leases.add().CopyFrom(reply.leases[0])
            return reply

        ChunkStoreService.Acquire = malformed  # type: ignore[method-assign]
    else:
        expire = Index.expire

        error = {"RuntimeError": RuntimeError, "SystemExit": SystemExit}[args.reaper_raises]

        def raises(self: Index) -> int:
            if armed.exists():
                raise error("dying_daemon: the reaper fails")
            return expire(self)

        Index.expire = raises  # type: ignore[method-assign]
    return cli.main(serve)


if __name__ == "__main__":
    sys.exit(main())
