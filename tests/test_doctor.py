"""``chunkstore doctor``: a refusal says why without running vLLM; bad files are named with
their line; on the tiny model and SmolLM2 the exactness stage runs a real vLLM against the HF
reference, and the answers stage is bench quality's own evaluation of the same cases."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from chunkstore.cli import main
from chunkstore.doctor import BELOW_BAR, REFERENCE_TOLERANCE, REFUSED, USE, WARM_TOLERANCE


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
