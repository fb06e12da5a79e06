"""``chunkstore models``: build the test models once and print their folders."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from chunkstore.models import DEFAULT_MODELS, MODELS, SUMMARIES, ModelBuildError, model_dir


def run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.names) - set(MODELS))
    if unknown:
        print(
            f"chunkstore models: unknown model {', '.join(unknown)}; known: {', '.join(MODELS)}",
            file=sys.stderr,
        )
        return 2
    # Interruptible whatever the caller left it (a background job's SIGINT is ignored):
    # a SIGINT stops a build, and model_dir removes what it had half built.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in args.names or DEFAULT_MODELS:
        try:
            built = model_dir(name, args.cache_dir)
        except ModelBuildError as error:
            print(f"chunkstore models: {name}: {error}", file=sys.stderr)
            return 1
        print(built, flush=True)
    return 0


def add_commands(commands: Any) -> None:
    models = commands.add_parser(
        "models",
        help="build the test models (tiny random Llama, SmolLM2, Qwen2.5) once and cache them",
        description="Build the models tests and benches use, each printed as its folder.\n"
        "A present model is never rebuilt. Default location: $CHUNKSTORE_MODEL_CACHE or\n"
        "~/.cache/chunkstore/models.\n\nmodels (fp32; size on disk, build time on 2 cores):\n"
        + "\n".join(f"  {name:14}{summary}" for name, summary in SUMMARIES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models.add_argument(
        "names",
        nargs="*",
        help=f"any of {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    models.add_argument("--cache-dir", type=Path, default=None)
    models.set_defaults(func=run)
