"""``chunkstore doctor``: a refusal says why without running vLLM; bad files are named with
their line; on the tiny model and SmolLM2 the exactness stage runs a real vLLM against the HF
reference, and the answers stage is bench quality's own evaluation of the same cases."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from chunkstore.cli import main
from chunkstore.models import MODELS, model_dir
from chunkstore.testing.cli import chunkstore
from chunkstore_vllm.doctor.stages import (
    BELOW_BAR,
    REFERENCE_TOLERANCE,
    REFUSED,
    USE,
    WARM_TOLERANCE,
)


def doctor(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chunkstore.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("rope", "why"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "longrope"),
    ],
)
def test_doctor_refuses_an_unsupported_rotary_variant_with_the_reason(
    tiny_model_dir, tmp_path, rope, why
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["rope_scaling"] = rope
    (model / "config.json").write_text(json.dumps(config))
    run = doctor(str(model), "--json")
    assert run.returncode == REFUSED, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["verdict"]["line"].startswith("REFUSED: rotary: UnsupportedRotaryError")
    assert why in report["verdict"]["line"]
    assert "exactness" not in report and "vllm_probe" not in run.stderr  # nothing ran


def test_doctor_names_the_file_and_line_of_bad_input(tmp_path, tiny_model_dir, capsys) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"id": "a", "text": "Paris is in France."}\n')
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"question": "Where is Paris?", "answers": ["France"], "docs": ["a"]}\n')
    questions.write_text(questions.read_text() + '{"question": "?", "docs": ["b"]}\n')
    code = main(["doctor", str(tiny_model_dir), "--docs", str(docs), "--questions", str(questions)])
    assert code == 2
    assert f"{questions}:2: want" in capsys.readouterr().err
    questions.write_text('{"question": "Where?", "answer": "France", "docs": ["a", "zz"]}\n')
    assert main(["doctor", str(tiny_model_dir), "--docs", str(docs), "--questions", str(questions)])
    assert "names ['zz']" in capsys.readouterr().err
    questions.write_text("not json\n")
    assert main(["doctor", str(tiny_model_dir), "--questions", str(questions)]) == 2
    assert f"{questions}:1: not JSON" in capsys.readouterr().err


def model_with(tiny: Path, folder: Path, **changes: Any) -> Path:
    """A copy of the tiny model with ``changes`` made to its config.json."""
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def make_bad(path: Path, fault: str) -> None:
    """``path`` made a FIFO, /dev/zero, over 64 MiB, not UTF-8, or JSON nested too deeply."""
    path.unlink(missing_ok=True)
    if fault == "a FIFO":
        os.mkfifo(path)
    elif fault == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif fault == "65 MiB":
        with path.open("wb") as f:
            f.truncate(65 << 20)  # sparse: no disk taken
    elif fault == "latin-1":
        path.write_bytes('{"question": "Où?", "answer": "là"}\n'.encode("latin-1"))
    elif fault == "nested":
        path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n")


# Config sizes out of bounds (each from 1 to its cap), or not integers; rotary parameters
# not an object.
SIZES = {  # the size, a bad value, its cap
    "num_attention_heads": (0, 1024),
    "num_key_value_heads": (0, 1024),
    "num_hidden_layers": (10**18, 1024),
    "hidden_size": (2**40, 1 << 20),
    "head_dim": (0, 1 << 16),
    "vocab_size": ("661", 1 << 24),
}
ROPES = {"rope_parameters": [{"rope_type": "default"}], "rope_scaling": [2.0]}
FILES = [  # a file of the model's or the user's, how it is bad, what the error says of it
    ("config.json", "a FIFO", "config.json: a FIFO, not a regular file"),
    ("config.json", "/dev/zero", "config.json: a character device, not a regular file"),
    ("config.json", "latin-1", "config.json: not UTF-8 (byte 15)"),
    ("config.json", "nested", "config.json: not JSON: nested too deeply"),
    ("model.safetensors", "a FIFO", "model.safetensors: a FIFO, not a regular file"),
    ("questions.jsonl", "a FIFO", "questions.jsonl: a FIFO, not a regular file"),
    ("questions.jsonl", "/dev/zero", "questions.jsonl: a character device, not a regular file"),
    ("questions.jsonl", "65 MiB", "questions.jsonl: over 64 MiB"),
    ("questions.jsonl", "latin-1", "questions.jsonl: not UTF-8 (byte 15)"),
    ("questions.jsonl", "nested", "questions.jsonl:1: not JSON: nested too deeply"),
    ("docs.jsonl", "latin-1", "docs.jsonl: not UTF-8 (byte 15)"),
]
# A string or a number where a list of strings belongs is refused, not read as one item a
# character ("answers": "Paris" wanted P, a, r, i and s; "answer": "Paris" is the one answer).
FIELDS = [
    ("answers", "Paris"),
    ("answers", 7),
    ("answers", [7]),
    ("docs", "paris"),
    ("docs", 5),
    ("documents", "In France."),
    ("documents", 3),
    ("relevant", "paris"),
]
QUESTIONS = {  # other bad questions, and what the error says of them
    "an empty answer": ({"answers": [""]}, 'want "question": str and "answers": [str, ...]'),
    "answer a list": ({"answers": None, "answer": ["France"]}, 'want "question": str and'),
    "no documents": ({"documents": []}, '"documents" is empty'),
}
NAMES = {  # a model given by a name or folder that is none, and what the error says of it
    "tinyy": f"tinyy: no such folder, nor a model of `chunkstore models` ({', '.join(MODELS)})",
    "{tmp}/modle": "/modle: no such folder, nor a model of `chunkstore models`",
    "/dev/zero": "/dev/zero: not a folder, nor a model of `chunkstore models`",
}
WANT = "want an integer from 1 to"
BAD_INPUTS = [
    *(pytest.param("config", {k: v}, f"{k} is {v!r}: {WANT} {cap}", id=f"{k} {v!r}")
      for k, (v, cap) in SIZES.items()),
    *(pytest.param("config", {k: v}, f"{k} is {v!r}: want an object", id=f"{k} a list")
      for k, v in ROPES.items()),
    *(pytest.param(file, fault, error, id=f"{file} {fault}") for file, fault, error in FILES),
    *(pytest.param("question", {k: v}, f'questions.jsonl:1: "{k}" is {v!r}: want a list of '
                   "strings", id=f"{k} {v!r}")
      for k, v in FIELDS),
    *(pytest.param("question", fault, f"questions.jsonl:1: {error}", id=name)
      for name, (fault, error) in QUESTIONS.items()),
    *(pytest.param("model", name, error, id=f"model {name}") for name, error in NAMES.items()),
]  # fmt: skip


@pytest.mark.parametrize(("crafted", "fault", "error"), BAD_INPUTS)
def test_doctor_refuses_bad_input_naming_the_file_and_what_is_wrong(
    crafted, fault, error, tiny_model_dir, tmp_path, capsys
) -> None:
    """Exit 2 and one line naming the file and the fault, before anything starts: no
    traceback, no hang on a FIFO or /dev/zero, no vLLM (past --max-minutes 0.2 it would exit
    1), in seconds. In this process (``chunkstore.cli.main``: 35 cases, a process each cost
    a minute and a half of CI); one case as a process, below."""
    model = model_with(tiny_model_dir, tmp_path / "model", **(fault if crafted == "config" else {}))
    docs, questions = tmp_path / "docs.jsonl", tmp_path / "questions.jsonl"
    docs.write_text('{"id": "paris", "text": "Paris is the capital of France."}\n')
    question = {"question": "Where is Paris?", "answers": ["France"], "docs": ["paris"]}
    if crafted == "question":
        question = {k: v for k, v in {**question, **fault}.items() if v is not None}
    questions.write_text(json.dumps(question) + "\n")
    if crafted in ("config.json", "model.safetensors"):
        make_bad(model / crafted, fault)
    elif crafted in ("questions.jsonl", "docs.jsonl"):
        make_bad(tmp_path / crafted, fault)
    given = fault.format(tmp=tmp_path) if crafted == "model" else model
    argv = ["doctor", given, "--docs", docs, "--questions", questions, "--max-minutes", "0.2"]
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert code == REFUSED, output[-3000:]
    assert error in output, output[-3000:]


def test_doctor_refuses_bad_input_as_a_process_in_one_line(tiny_model_dir, tmp_path) -> None:
    """The command as users run it: exit 2, the one line, no traceback."""
    docs, questions = tmp_path / "docs.jsonl", tmp_path / "questions.jsonl"
    docs.write_text('{"id": "paris", "text": "Paris is the capital of France."}\n')
    questions.write_text('{"question": "Where is Paris?", "answers": "France", "docs": []}\n')
    run = chunkstore(
        "doctor", tiny_model_dir, "--docs", docs, "--questions", questions,
        "--max-minutes", "0.2", timeout=60,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == REFUSED, output[-3000:]
    assert "questions.jsonl:1: \"answers\" is 'France'" in output, output[-3000:]
    assert "Traceback" not in output and len(run.stderr.strip().splitlines()) == 1, output


def test_doctor_does_not_read_the_weights_before_vllm(tiny_model_dir, tmp_path) -> None:
    """Stage 1 reads the config, not the weights (hashing 1 TiB took minutes, past
    --max-minutes): here the time limit stops the run at stage 2, in seconds."""
    model = model_with(tiny_model_dir, tmp_path / "model")
    with (model / "model-00002-of-00002.safetensors").open("wb") as f:
        f.truncate(1 << 40)  # sparse: no disk taken
    began = time.monotonic()
    run = chunkstore("doctor", model, "--max-minutes", "0.2", "--json", timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert json.loads(run.stdout)["verdict"]["line"] == (
        "FAILED: stage 2 did not run through: the doctor ran past --max-minutes"
    )
    assert time.monotonic() - began < 60


def test_doctor_builds_a_named_model_within_max_minutes(tmp_path, monkeypatch) -> None:
    """A model of `chunkstore models` not built yet is built in the time --max-minutes leaves,
    and a build cut short leaves nothing half built behind."""
    monkeypatch.setenv("CHUNKSTORE_MODEL_CACHE", str(tmp_path))
    began = time.monotonic()
    run = chunkstore("doctor", "smollm2", "--max-minutes", "0.05", timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "ran past --max-minutes" in run.stderr
    assert time.monotonic() - began < 60
    assert list(tmp_path.iterdir()) == []  # not built whole (the old code: 0.5 GB, ~30 s)


def test_doctor_on_the_tiny_model_with_a_users_documents(tmp_path, tiny_model_dir, capsys) -> None:
    docs = tmp_path / "docs.jsonl"
    texts = {
        "paris": "Paris is the capital of France. The Seine flows through it.",
        "berlin": "Berlin is the capital of Germany. The Spree flows through it.",
        "rome": "Rome is the capital of Italy. The Tiber flows through it.",
    }
    docs.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        json.dumps({"question": "Which river flows through Rome?", "answer": "Tiber",
                    "docs": ["paris", "rome", "berlin"], "relevant": ["rome"]})
        + "\n"
        + json.dumps({"question": "What is the capital of France?", "answers": ["Paris"],
                      "documents": [texts["berlin"], texts["paris"]]})
        + "\n"
    )  # fmt: skip
    code = main(
        ["doctor", str(tiny_model_dir), "--docs", str(docs), "--questions", str(questions),
         "--max-tokens", "4", "--json"]
    )  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == report["verdict"]["code"] in (USE, BELOW_BAR)
    assert [c["ok"] for c in report["support"]] == [True] * 5
    exact = report["exactness"]
    assert exact["ok"] and exact["exact"] and exact["same_tokens_warm"], exact
    assert exact["worst_logprob_diff"]["warm"] <= WARM_TOLERANCE
    assert max(exact["worst_logprob_diff"].values()) <= REFERENCE_TOLERANCE
    # Warm: sys and all three documents loaded; reordered: loaded again at new positions.
    assert exact["loaded_tokens"]["warm"] >= 3 * 10 and exact["loaded_tokens"]["reordered"] > 0
    assert exact["stored_segments"] >= 4 and exact["load_failures"] == 0
    rows = {r["method"]: r for r in report["answers"]}
    assert list(rows) == ["full", "isolated", "default"]
    for row in rows.values():
        assert row["cases"] == 2 and row["split"] == "user" and 0 <= row["correct"] <= 2
    # Of the cases that name their answer's documents (one), the defaults recompute them.
    assert rows["default"]["answer_chunks_recomputed"] == 1.0
    assert report["reproduce"] is None  # the user's cases: no bench command runs them
    if code == USE:
        extra = report["verdict"]["setting"]["kv_connector_extra_config"]
        assert report["verdict"]["setting"]["kv_connector"] == "ChunkStoreConnector"
        assert isinstance(extra, dict)


@pytest.mark.slow
def test_doctor_on_smollm2_is_exact(smollm2_dir, capsys) -> None:
    code = main(["doctor", str(smollm2_dir), "--no-answers"])
    out = capsys.readouterr().out
    assert code == USE, out
    assert "separator  ok       'auto' is '<file_sep>'" in out
    assert "exactness: ok: warm == cold True" in out
    assert out.splitlines()[-2].startswith("EXACT (answers not measured)")
    assert out.splitlines()[-1].startswith('--kv-transfer-config \'{"kv_connector"')


def test_doctor_on_tiny_gemma3_is_exact(capsys) -> None:
    """Sliding-window layers (window 32, the prompts past it) at two RoPE bases: stage 2's
    served answers equal the HF reference's, each layer's keys moved with its own base and
    its window masked (before, the reference refused the model)."""
    code = main(["doctor", str(model_dir("tiny-gemma3")), "--no-answers", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == USE, report
    exact = report["exactness"]
    assert exact["ok"] and exact["exact"] and exact["load_failures"] == 0, exact
    assert exact["prompt_tokens"] > 2 * 32 and exact["loaded_tokens"]["reordered"] > 0, exact
    assert max(exact["worst_logprob_diff"].values()) <= REFERENCE_TOLERANCE


@pytest.mark.release
def test_doctor_on_gemma3_270m_is_exact_with_its_advice() -> None:
    """The real Gemma 3 (270M base, fp32): chunks loaded at new positions give the HF
    reference's first-token logprobs, and the verdict gives a setting."""
    run = doctor("gemma3-270m", "--cases", "3", "--json", timeout=3600)
    report = json.loads(run.stdout)
    assert report["exactness"]["ok"], report["exactness"]
    assert max(report["exactness"]["worst_logprob_diff"].values()) <= REFERENCE_TOLERANCE
    assert run.returncode == report["verdict"]["code"] in (USE, BELOW_BAR), run.stderr[-3000:]
    print(report["exactness"], report["verdict"]["line"])  # (make test-release shows them)


@pytest.mark.release
def test_doctor_on_qwen_agrees_with_bench_quality_on_the_same_cases(tmp_path) -> None:
    """The doctor's answers are bench quality's on the same built-in cases: the command its
    report names gives the same answers, case by case (greedy, fp32: deterministic)."""
    run = doctor("qwen2.5-0.5b", "--cases", "6", "--json", timeout=3600)
    report = json.loads(run.stdout)
    assert report["exactness"]["ok"], report["exactness"]
    assert run.returncode == report["verdict"]["code"] in (USE, BELOW_BAR)
    command = report["reproduce"].split()
    assert command[:3] == ["chunkstore", "bench", "quality"]
    bench = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli", *command[1:]],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = [json.loads(line) for line in bench.stdout.splitlines()]
    for mine, theirs in zip(report["answers"], rows, strict=True):
        print(f"doctor {mine['method']} {mine['per_case']}, bench {theirs['per_case']}")
        assert mine["method"] == theirs["method"]
        assert mine["per_case"] == theirs["per_case"], (mine, theirs)
    print(report["verdict"]["line"])  # (make test-release shows what was measured)


def test_doctor_stops_at_its_time_limit_and_says_so(tiny_model_dir, capsys) -> None:
    code = main(["doctor", str(tiny_model_dir), "--max-minutes", "0.2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["exactness"]["ok"] is False
    assert report["verdict"]["line"] == (
        "FAILED: stage 2 did not run through: the doctor ran past --max-minutes"
    )
