"""``chunkstore doctor``: is chunk reuse supported, exact and worth it for a model. The
``chunkstore`` command finds it through its ``chunkstore.commands`` entry point
(pyproject.toml): chunkstore imports nothing of the connector."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

# The help's paragraphs, each filled to the terminal's usual width.
DESCRIPTION = (
    "Four stages: (1) support: the model's files and sizes, the rotary variant, KV "
    "layout, separator, vLLM version and back end (no vLLM run, the weights not read; a "
    "refusal says exactly why); (2) exactness: a "
    "daemon and a real vLLM with the connector's defaults: a chunked prompt computed cold "
    "and loaded warm gives the same tokens (logprobs within 1e-4), and cold and reordered "
    "answers equal the HF transformers fp32 reference (1e-3); (3) answers: full prefill, "
    "isolated chunks and the defaults (and --methods) on your documents and questions, or "
    "on bench quality's built-in needle QA, accuracy with 95% intervals and the TTFT "
    "ratio; (4) a verdict line and the --kv-transfer-config to use.",
    "Exit status: 0 use it, 1 not exact (or a stage failed), 2 refused (unsupported "
    "model or bad input), 3 exact but no method tried keeps 90% of full prefill's "
    "answers.",
    'Files (JSON lines, at most 64 MiB): --docs {"id": ..., "text": ...}; --questions '
    '{"question": ..., "answers": [every string that must appear] (or "answer": one '
    'string), "docs": [ids in prompt order] (or "documents": [texts]), "relevant": [ids '
    "holding the answer, optional]}; a string where a list belongs is refused.",
)


def run(args: argparse.Namespace) -> int:
    from . import stages

    try:
        return stages.run(args)
    except stages.DoctorInputError as err:
        print(f"chunkstore doctor: {err}", file=sys.stderr)
        return 2
    except (TimeoutError, subprocess.TimeoutExpired):
        print(f"chunkstore doctor: ran past --max-minutes {args.max_minutes}", file=sys.stderr)
        return 1


def _methods(text: str) -> Any:
    from chunkstore.bench import quality_methods

    return quality_methods.parse_methods(text)


def add_commands(commands: Any) -> None:
    parser = commands.add_parser(
        "doctor",
        help="whether chunk reuse is supported, exact and worth it for a model, with the "
        "setting to use",
        description="\n\n".join(textwrap.fill(p, 80) for p in DESCRIPTION),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model", help="the model folder vLLM serves, or a model of `chunkstore models`"
    )
    parser.add_argument("--docs", dest="docs_file", type=Path, help="your documents (JSON lines)")
    parser.add_argument("--questions", type=Path, help="your questions (JSON lines)")
    parser.add_argument(
        "--methods",
        type=_methods,
        default="full,isolated,default",
        help="what stage 3 compares, as bench quality's --methods (default "
        "full,isolated,default); e.g. add relevant_recompute_share=0.25 (more recompute)",
    )
    parser.add_argument(
        "--cases", type=int, default=12, help="built-in questions, a third of each kind (12)"
    )
    parser.add_argument(
        "--doc-tokens", type=int, default=200, help="built-in documents' length in tokens (200)"
    )
    parser.add_argument(
        "--docs-per-case", dest="docs", type=int, default=8, help="built-in documents a prompt (8)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the built-in cases' seed (0)")
    parser.add_argument(
        "--split",
        choices=("tune", "heldout"),
        default="heldout",
        help="the built-in cases: heldout (never tuned on; default) or tune",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="answer tokens (16)")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=30.0,
        help="stop (exit 1) past this, building a model of `chunkstore models` included; "
        "stage 3 takes one vLLM run a method (30)",
    )
    parser.add_argument(
        "--no-answers",
        dest="answers",
        action="store_false",
        help="stop after stage 2 (support and exactness only)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object: every stage")
    parser.set_defaults(func=run, prose=True, filler=16)
