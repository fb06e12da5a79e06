"""The scores of ``chunkstore bench quality``: a method's answers scored, its row (accuracy
with its Wilson interval, against full prefill and isolated chunks), and what a row names
of the run (the model's weights, the CPU)."""

from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path
from typing import Any

from chunkstore.bench import qa_cases
from chunkstore.bench.quality_methods import FULL, ISOLATED, ROUTER
from chunkstore.kv.fingerprint import weights_digest


def wilson(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion."""
    if total == 0:
        return (0.0, 1.0)
    p = correct / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
    return (max(0.0, centre - half), min(1.0, centre + half))


@functools.cache
def model_digest(model: Path) -> str:
    return weights_digest(model)[:16]


# The instruction sets vLLM's CPU kernels choose among: a greedy answer at a near tie can
# differ between machines that run different ones.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model and which of ``ISA_FLAGS`` it has, e.g. "AMD EPYC: avx2
    avx512f avx512_bf16" (the model alone where /proc/cpuinfo says no flags)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name", "unknown")
    return f"{model}: {' '.join(f for f in ISA_FLAGS if f in flags)}".rstrip(": ")


def method_row(
    spec: str,
    settings: dict[str, Any] | None,
    results: dict[str, dict[str, Any]],
    cases: int,
    labels: dict[str, Any],
    doc_tokens: float,
) -> dict[str, Any]:
    """A method's row: its scores (``_scored``), interval, and against full prefill and
    isolated chunks where they ran."""
    res = results[spec]
    low, high = wilson(res["correct"], cases)
    row: dict[str, Any] = {
        "bench": "quality",
        "method": spec,
        "settings": settings,
        "cases": cases,
        **labels,
        "doc_tokens": round(doc_tokens, 1),
        "correct": res["correct"],
        "accuracy": round(res["correct"] / cases, 4),
        "ci95": [round(low, 4), round(high, 4)],
        "by_kind": res["by_kind"],
        "per_case": res["per_case"],
        "ttft_s": round(res["ttft_s"], 4),
        "loaded_tokens": res["loaded_tokens"],
        **{k: res[k] for k in ("warm_correct", "warm_per_case", "cold_equals_warm") if k in res},
    }
    full, isolated = results.get(FULL), results.get(ISOLATED)
    if full is not None and spec != ROUTER:  # the router's: a reply's latency through HTTP
        row["ttft_vs_full"] = round(full["ttft_s"] / res["ttft_s"], 2)
    if full is not None and isolated is not None and full["correct"] != isolated["correct"]:
        lost = full["correct"] - isolated["correct"]
        row["gap_closed"] = round((res["correct"] - isolated["correct"]) / lost, 3)
    return row


def scored(
    cases: list[qa_cases.Case], answers: list[str], timed: list[dict[str, Any]]
) -> dict[str, Any]:
    """A method's answers scored (in all and by kind), and its TTFT from the ``timed``
    prompts' results (the median; the fewest tokens any of them loaded)."""
    right = [case.correct(answer) for case, answer in zip(cases, answers, strict=True)]
    loaded = [r["cached_tokens"] for r in timed]
    by_kind: dict[str, list[int]] = {}
    for case, ok in zip(cases, right, strict=True):
        by_kind.setdefault(case.kind, [0, 0])
        by_kind[case.kind][0] += ok
        by_kind[case.kind][1] += 1
    return {
        "correct": sum(right),
        "per_case": "".join("1" if ok else "0" for ok in right),
        "by_kind": {k: f"{v[0]}/{v[1]}" for k, v in by_kind.items()},
        "ttft_s": statistics.median(r["seconds"] for r in timed),
        "loaded_tokens": None if None in loaded else min(loaded),
    }
