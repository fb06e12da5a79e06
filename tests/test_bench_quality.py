"""``chunkstore bench quality``: its cases, its interval, its methods, and one real run."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from chunkstore.bench import qa_cases
from chunkstore.bench.qa_cases import generate
from chunkstore.bench.quality_methods import hook_limits_of, parse_method
from chunkstore.bench.quality_methods import treatment as treat_as_the_bench
from chunkstore.bench.quality_prompts import (
    CHATML,
    COMPLETION,
    Prompts,
    build_prompts,
    cases_digest,
    prompt_format,
)
from chunkstore.bench.quality_scores import cpu_kind, wilson
from chunkstore.kv.segments import split_prompt
from chunkstore.models import model_dir


def test_cases_are_seeded_and_every_answer_is_in_the_documents() -> None:
    cases = generate(60, seed=3)
    assert cases == generate(60, seed=3) and cases != generate(60, seed=4)
    assert [c.kind for c in cases[:3]] == ["one", "two", "distracted"]
    for case in cases:
        text = " ".join(case.documents)
        assert len(case.documents) == 5 and len(set(case.documents)) == 5
        for answer in case.answers:
            assert answer in text
        assert len(case.answers) == (2 if case.kind == "two" else 1)
        assert len(case.relevant) == len(set(case.relevant)) == len(case.answers)
        assert case.correct(" and ".join(case.answers).upper())
        assert not case.correct("I do not know")
    # Documents recur across cases, so a store warmed by earlier cases serves later ones.
    seen = [d for c in cases for d in c.documents]
    assert len(set(seen)) < len(seen)


class _Bytes:
    """A tokenizer that reads text as its UTF-8 bytes: enough for what a digest hashes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def test_the_cases_digest_tells_whether_two_runs_asked_the_same_prompts() -> None:
    # Runs on two machines compare case by case only where their cases are the same: the
    # prose comes from the machine's license texts.
    tok = _Bytes()
    cases = generate(6, seed=3, prose=True)
    assert cases_digest(tok, cases) == cases_digest(tok, generate(6, seed=3, prose=True))
    assert cases_digest(tok, cases) != cases_digest(tok, generate(6, seed=4, prose=True))
    moved = [dataclasses.replace(cases[0], question=cases[0].question + " ")]
    assert cases_digest(tok, moved) != cases_digest(tok, cases[:1])


def test_rows_name_the_cpu_and_the_instruction_sets_its_kernels_choose_among(
    tmp_path: Path,
) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f sse4_2\n")
    assert cpu_kind(info) == "AMD EPYC: avx2 avx512f"
    info.write_text("model name\t: Some ARM core\n")
    assert cpu_kind(info) == "Some ARM core"
    assert cpu_kind(tmp_path / "missing") == "unknown"


def test_filler_lengthens_documents_and_keeps_their_facts() -> None:
    short, long = generate(30, seed=1), generate(30, seed=1, filler=48)
    assert long == generate(30, seed=1, filler=48)
    for case in long:
        assert all(len(d.split(". ")) >= 48 for d in case.documents)
        for answer in case.answers:
            assert answer in " ".join(case.documents)
    words = sum(len(d.split()) for c in long for d in c.documents)
    assert words > 10 * sum(len(d.split()) for c in short for d in c.documents)


@pytest.mark.parametrize("prose", [False, True], ids=["templated", "prose"])
def test_the_held_out_split_shares_no_person_filler_or_document_with_the_tuning_one(
    prose: bool,
) -> None:
    tune = generate(60, seed=0, filler=4, prose=prose)
    held = generate(60, seed=0, filler=4, prose=prose, split=qa_cases.HELDOUT)
    assert held == generate(60, seed=0, filler=4, prose=prose, split=qa_cases.HELDOUT)
    assert tune == generate(60, seed=0, filler=4, prose=prose, split=qa_cases.TUNE)
    tune_text = " ".join(d for c in tune for d in c.documents)
    held_text = " ".join(d for c in held for d in c.documents)
    assert not {d for c in tune for d in c.documents} & {d for c in held for d in c.documents}
    for first in qa_cases.FIRST:
        assert first not in held_text
    for first in qa_cases.HELDOUT_FIRST:
        assert first not in tune_text
    if not prose:
        assert all(f not in held_text for f in qa_cases.FILLER)
        assert all(f not in tune_text for f in qa_cases.HELDOUT_FILLER)
    for case in held:
        for slot, answer in zip(case.relevant, case.answers, strict=True):
            assert answer in case.documents[slot]
    with pytest.raises(ValueError, match="split"):
        generate(3, split="test")


def test_filler_for_a_length() -> None:
    # Qwen2.5's tokenizer, measured: prose 1 -> ~49 tokens, 6 -> ~194, 16 -> ~493.
    assert [qa_cases.filler_for(n, prose=True) for n in (50, 200, 500)] == [1, 6, 16]
    assert qa_cases.filler_for(40, prose=False) == 2
    assert qa_cases.filler_for(1, prose=True) == 1  # at least one sentence


def test_a_distracted_case_holds_a_look_alike_of_its_fact() -> None:
    for case in generate(30, seed=0):
        if case.kind != "distracted":
            continue
        # The asked fact's sentence shape ("lives in", "works as", "costs") appears in a
        # document other than the one holding the answer.
        shape = re.search(r"(live|job|cost)", case.question)
        assert shape is not None
        word = {"live": "lives in", "job": "works as", "cost": "costs"}[shape.group(1)]
        holders = [d for d in case.documents if word in d]
        assert len(holders) >= 2


@pytest.mark.parametrize("prose", [False, True], ids=["templated", "prose"])
def test_the_answer_stands_at_any_slot_and_relevant_names_it(prose: bool) -> None:
    cases = generate(300, seed=5, docs_per_case=5, filler=4, prose=prose)
    # 300 cases ask 400 facts: 80 a slot if the slot is uniform.
    slots = Counter(slot for case in cases for slot in case.relevant)
    assert sorted(slots) == [0, 1, 2, 3, 4] and min(slots.values()) >= 55
    for case in cases:
        for slot, answer in zip(case.relevant, case.answers, strict=True):
            assert answer in case.documents[slot]
        if case.kind != "two":
            # Only the relevant document names the one asked about.
            subject = re.search(r"[A-Z][a-z]+ [A-Z][a-z]+|the \w+ \w+", case.question)
            assert subject is not None
            holders = [i for i, d in enumerate(case.documents) if subject[0].lower() in d.lower()]
            assert holders == list(case.relevant)


SENTENCE_BREAK = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')])) (?=[A-Z\"(])")


def test_prose_documents_are_license_sentences_around_their_two_facts() -> None:
    cases = generate(30, seed=2, filler=16, prose=True)
    assert cases == generate(30, seed=2, filler=16, prose=True)
    texts = [" ".join((qa_cases.PROSE_DIR / f).read_text().split()) for f in qa_cases.PROSE_FILES]
    corpus = " ".join(texts)
    fact = re.compile(r"[A-Z][\w ]+ (lives in|works as a|costs) \w+( dollars)?\. ?")
    confusing = re.compile(
        r"\b(" + "|".join(qa_cases.CITIES + qa_cases.JOBS) + r"|1[1-9]|[2-9]\d|dollars?)\b", re.I
    )
    for document in {d for case in cases for d in case.documents}:
        assert len(fact.findall(document)) == 2
        rest = fact.sub("", document)
        assert not confusing.search(rest)
        sentences = [s for line in rest.splitlines() for s in SENTENCE_BREAK.split(line)]
        # filler counts sentences (of 6 to 50 words), as for templated documents
        assert len(re.findall(r"[.!?][\"')]?(?: |\n|$)", rest)) >= 16
        assert 16 * 6 <= len(rest.split()) <= 16 * 50
        for sentence in sentences:
            assert sentence.strip() in corpus


def test_prose_without_its_files_names_the_file_and_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(qa_cases, "PROSE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/GPL-3.*base-files"):
        generate(3, prose=True)
    assert len(generate(3)) == 3  # the templated filler needs no file


def test_wilson_interval_matches_known_values() -> None:
    low, high = wilson(37, 60)
    assert (round(low, 3), round(high, 3)) == (0.49, 0.729)
    assert wilson(0, 6)[0] == 0.0 and round(wilson(0, 6)[1], 3) == 0.39
    assert wilson(10, 10)[1] == 1.0


def test_methods_parse_and_bad_ones_say_what_is_allowed() -> None:
    assert parse_method("full") is None and parse_method("default") == {}
    assert parse_method("isolated") == {"recompute_chunks": 0, "relevant_last": 0}
    assert parse_method("scores=oracle+relevant_last=1") == {"scores": "oracle", "relevant_last": 1}
    with pytest.raises(ValueError, match="scores=oracle"):
        parse_method("scores=bm25")
    assert parse_method("virtual_gap=200+question_temperature=0.8") == {
        "virtual_gap": 200,
        "question_temperature": 0.8,
    }
    assert parse_method("recompute_tokens=16") == {"recompute_tokens": 16}
    for bad in ("gap=3", "virtual_gap", "virtual_gap=", "save=false"):
        with pytest.raises(ValueError, match="KNOB=VALUE"):
            parse_method(bad)


@pytest.mark.release  # a bench mode's plumbing (~90 s): before a release, not in CI's budget
def test_bench_quality_json_on_the_tiny_model() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkstore.cli",
            "bench",
            "quality",
            "--json",
            "--model",
            "tiny",
            "--cases",
            "3",
            "--max-tokens",
            "2",
            "--methods",
            "full,isolated,request=1,scores=oracle",
            "--docs",
            "2",
            "--doc-tokens",
            "40",
            "--split",
            "heldout",
            "--repeats",
            "2",
            "--router",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["method"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert list(rows) == ["full", "isolated", "request=1", "scores=oracle", "router"]
    assert "[4/5] scores=oracle" in run.stderr  # progress, one line per method
    # Through a real router before vllm serve with the hook off, twice: the same answers.
    assert rows["router"]["cold_equals_warm"] is True
    assert rows["router"]["warm_per_case"] == rows["router"]["per_case"]
    for row in rows.values():
        assert row["cases"] == 3 and 0 <= row["correct"] <= 3
        low, high = row["ci95"]
        assert low <= row["accuracy"] <= high
        assert row["ttft_s"] > 0 and row.get("ttft_vs_full", 1) > 0
    assert "ttft_vs_full" not in rows["router"]  # its latency is through HTTP
    assert rows["router"]["loaded_tokens"] > 0
    # TTFT prompts (two cases asked again, their two short documents reversed): full
    # prefill loads nothing; isolated loads sys and both documents; recomputing a chunk
    # loads it all the same, and recomputes one document of the two where the answer's is
    # not first. Where it is first (it follows sys: causal already), the request's choice
    # leaves nothing to recompute and the connector's defaults take over (BM25's picks
    # last, their spans recomputed there, the first tokens of the other).
    assert rows["full"]["loaded_tokens"] == 0
    assert rows["isolated"]["loaded_tokens"] >= 2 * 30
    assert rows["request=1"]["loaded_tokens"] == rows["isolated"]["loaded_tokens"]
    assert 0.4 < rows["request=1"]["recomputed_share"]["ttft"] < 0.9
    # The oracle ranking recomputes the answer's documents, when it may recompute enough.
    assert rows["request=1"]["answer_chunks_recomputed"] == round(2 / 3, 3)  # "two" needs 2
    # The defaults take the chunks the oracle's scores rank first, every answer's document,
    # put them last and recompute their spans there (at least 32 tokens of each ~40, the
    # other chunk's first 4 tokens); isolated recomputes none.
    assert rows["scores=oracle"]["answer_chunks_recomputed"] == 1.0
    assert rows["scores=oracle"]["answer_chunks_last"] == 1.0
    # (a first chunk that moves is recomputed too: it no longer follows sys)
    assert 0.2 < rows["scores=oracle"]["recomputed_share"]["ttft"] < 0.6
    for row in rows.values():
        assert row["split"] == "heldout"
        assert row["doc_tokens"] == rows["full"]["doc_tokens"] > 0  # (one filler: the least)
    assert "answer_chunks_recomputed" not in rows["isolated"]
    assert "warm_correct" not in rows["full"]
    # What two runs must share to compare case by case: every row of one run says the same.
    same = {(r["cases_digest"], r["model_digest"], r["cpu"]) for r in rows.values()}
    assert len(same) == 1 and all(same.pop())


def test_the_bench_reads_which_chunks_a_method_recomputes_or_moves_as_the_connector() -> None:
    sep = [9]
    # sys, four chunks of 3, 4, 5 and 3 tokens and their separators, a question about 42.
    prompt = [1, *sep, 7, 1, 1, *sep, 7, 42, 42, 42, *sep, 7, 2, 2, 2, 2, *sep, 7, 42, 5, *sep, 42]
    ranking = [3, 2, 1, 0]

    def treatment(settings: dict, *_: object) -> tuple[dict[int, range], list[int], int]:
        """The policy's treatment (the connector's) in chunk indices: recomputed, last,
        and the other chunks' first tokens recomputed."""
        treated, chunks = treat_as_the_bench(settings, prompt, sep, ranking)
        of = {segment: c for c, segment in enumerate(chunks)}
        recomputed = {of[i]: r for i, r in treated.recomputed.items()}
        return recomputed, [of[i] for i in treated.last], treated.first_tokens

    # Attended last, chunk 1 (the best) after chunk 3, recomputed there: their spans, at
    # least 32 tokens (here the whole chunks), with every other chunk's first 4 tokens.
    both = {1: range(5), 3: range(4)}
    assert treatment({}, prompt, sep, ranking) == (both, [3, 1], 4)
    # Without the share, whole where short; chunk 1 holds 5 tokens: its span.
    long = {
        "relevant_recompute_share": 0.0,
        "relevant_recompute_tokens": 4,
        "relevant_span_tokens": 2,
    }
    assert treatment(long, prompt, sep, ranking) == ({1: range(1, 3), 3: range(4)}, [3, 1], 4)
    moved = {"relevant_recompute_tokens": 0}  # only attended last
    assert treatment(moved, prompt, sep, ranking) == ({}, [3, 1], 0)
    # The application's scores: its three highest (relevant_last), the best last.
    assert treatment({**moved, "scores": "oracle"}, prompt, sep, ranking) == ({}, [1, 2, 3], 0)
    assert treatment({"recompute_chunks": 1}, prompt, sep, ranking) == ({1: range(5)}, [], 0)
    assert treatment({"request": 2}, prompt, sep, ranking) == ({2: range(6), 3: range(4)}, [], 0)
    no_first = {"relevant_first_tokens": 0}  # no other chunk's tokens
    assert treatment(no_first, prompt, sep, ranking) == (both, [3, 1], 0)
    isolated = {"recompute_chunks": 0, "relevant_last": 0}
    assert treatment(isolated, prompt, sep, ranking) == ({}, [], 0)
    # As behind the router, without the hook: sent with the relevant chunks last (chunk 1
    # after chunk 3), the last of which vLLM computes there (chunk 3 before it loads); the
    # ranking renamed with the prompt.
    router = parse_method("inband_isolation=0+order=relevant")
    assert router == {"inband_isolation": False, "order": "relevant"}
    sent = Prompts([prompt], [ranking], [], []).ordered(router, sep)
    assert sent.qa_rankings == [[2, 1, 3, 0]]  # chunks 0, 2, 3, 1 in their new places
    treated, chunks = treat_as_the_bench(router, sent.qa[0], sep, sent.qa_rankings[0])
    assert {chunks.index(i) for i in treated.recomputed} == {3} and not treated.shifts
    both = router | {"hookless_from": "span"}
    treated, chunks = treat_as_the_bench(both, sent.qa[0], sep, sent.qa_rankings[0])
    assert {chunks.index(i) for i in treated.recomputed} == {2, 3}
    with pytest.raises(ValueError, match="order=relevant"):
        parse_method("order=first")


@pytest.mark.parametrize(
    "args, error",
    [
        (["--doc-tokens", "200,x"], "--doc-tokens wants lengths"),
        (["--doc-tokens", "0"], "--doc-tokens wants lengths"),
        (["--split", "tune,test"], "unknown split"),
    ],
)
def test_bench_quality_refuses_bad_lengths_and_splits(args: list[str], error: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli", "bench", "quality", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and error in run.stderr
    assert "bench quality: [" not in run.stderr


def test_bench_quality_refuses_a_bad_method_before_running_anything() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli", "bench", "quality", "--methods", "full,gap=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "KNOB=VALUE" in run.stderr
    assert "bench quality: [" not in run.stderr


def test_a_model_without_a_chat_template_gets_completion_prompts_its_bos_first() -> None:
    """A chat model (ChatML's template) gets a chat turn; a base model (no template: Gemma 3
    270M) a completion prompt, the tokenizer's <bos> first (Gemma writes nonsense without
    it), its answer the reply's first line; another template is refused, not guessed."""
    from transformers import AutoTokenizer

    chat = prompt_format(AutoTokenizer.from_pretrained(model_dir("smollm2")))
    assert (chat.name, chat.prefix) == (CHATML, ())
    assert chat.answer(" Paris\nQuestion: x") == " Paris\nQuestion: x"  # the whole turn
    base = AutoTokenizer.from_pretrained(model_dir("tiny"), add_bos_token=True)
    assert base.chat_template is None and base.encode("a")[0] == base.bos_token_id
    fmt = prompt_format(base)
    assert (fmt.name, fmt.prefix) == (COMPLETION, (base.bos_token_id,))
    assert fmt.answer(" Paris\nQuestion: Where does Bo live?\nAnswer: Rome") == "Paris"
    cases = generate(2, seed=0, docs_per_case=2, filler=1)
    sep = base.encode("##", add_special_tokens=False)
    for prompt in build_prompts(base, sep, cases, 1, fmt).qa:
        assert prompt[0] == base.bos_token_id and base.bos_token_id not in prompt[1:]
        assert str(base.decode(prompt[1:])).startswith(qa_cases.SYS)
        assert str(base.decode(prompt)).endswith("\nAnswer:")
    # The digest tells a completion run from a chat run of the same cases.
    assert cases_digest(base, cases, fmt) != cases_digest(base, cases)
    other = AutoTokenizer.from_pretrained(model_dir("tiny"))
    other.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="--prompt-format completion"):
        prompt_format(other)
    assert prompt_format(other, COMPLETION).name == COMPLETION


def test_on_a_sliding_window_model_the_bench_reports_what_the_hook_serves() -> None:
    """On Gemma 3 (sliding-window layers) the connector's hook does no relevant_last moves
    or recompute (``for_deployment``): the bench reads a method's treatment as served there,
    and says why it differs from the settings asked for; behind the router (the hook off)
    the relevant chunks are still computed last."""
    from transformers import AutoConfig

    gemma = AutoConfig.from_pretrained(model_dir("tiny-gemma3"))
    llama = AutoConfig.from_pretrained(model_dir("tiny"))
    sep = [9]
    prompt = [1, *sep, 7, 1, 1, *sep, 7, 42, 42, 42, *sep, 7, 2, 2, 2, 2, *sep, 7, 42, 5, *sep, 42]
    ranking = [3, 2, 1, 0]
    default = parse_method("default")
    assert default is not None
    on_llama, _ = treat_as_the_bench(default, prompt, sep, ranking, llama)
    assert on_llama.last and on_llama.recomputed
    on_gemma, _ = treat_as_the_bench(default, prompt, sep, ranking, gemma)
    assert not on_gemma.last and not on_gemma.recomputed and not on_gemma.shifts
    assert hook_limits_of(default, llama) is None
    assert "relevant_last moves, recompute" in (hook_limits_of(default, gemma) or "")
    assert hook_limits_of(parse_method("isolated"), gemma) is None  # asks for none of them
    router = parse_method("inband_isolation=0+order=relevant")
    assert router is not None and hook_limits_of(router, gemma) is None
    behind, chunks = treat_as_the_bench(router, prompt, sep, ranking, gemma)
    assert behind.computed_from(split_prompt(prompt, sep)) is not None
    gap = parse_method("virtual_gap=200")
    assert "hook is off" in (hook_limits_of(gap, gemma) or "")
