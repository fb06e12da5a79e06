"""``chunkstore bench hook``: the isolation hook's chunk rows, one call of vLLM's kernel for all
of a step's chunks against one partial attention per chunk and part merged by log-sum-exp.

One layer of one step as the hook sees it: a request of ``--sys-tokens`` sys tokens and
``--chunks`` chunks of ``--chunk-tokens`` tokens each (a list: one row each; the chunks a
few tokens apart in length, as documents are), its KV in vLLM's CPU paged cache (the "vec"
layout, blocks in a shuffled order), every chunk token a query row. Timed side by side, in
alternating rounds, from that cache to the rows' outputs:
- ``merged``: per chunk, its sys keys read and rotated to the distance it stands from its
  virtual start, its own keys read, and ``attention_after_context`` (the sys part and the own
  causal part through torch's fused CPU attention, merged by their log-sum-exp): the path
  the hook took for every chunk row before this bench, and still takes for question rows;
- ``kernel``: ``StepAttention.attend_chunks``: every chunk's rotated sys and own keys copied
  to a cache of the hook's own, and one call of vLLM's ``cpu_attention_with_kv_cache``,
  causal, each chunk a sub-request.
``speedup`` is the median over rounds of merged time over kernel time; ``max_abs_diff`` is
the largest difference between the two outputs (both fp32): a fast wrong answer does not
count. Heads and head size are the model's (``--model``, its config.json), the layer
settings vLLM's CPU back end would give it ("vec" kernels, fp32, no KV scaling).

It drives the hook's own classes, so it lives with them; ``chunkstore bench`` finds it through
its ``chunkstore.benches`` entry point (pyproject.toml).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from chunkstore.bench.timing import timed
from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.rope import RotaryConfig
from chunkstore.models import resolve

from ..cpu_layout import CpuKVLayout
from .isolation import IsolationHook
from .step_split import HookRows, StepSplit
from .vllm_attention import LayerCall

LAYER = "model.layers.0.self_attn.attn"


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    path = resolve(args.model)
    config = json.loads((path / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_size = int(config.get("head_dim") or config["hidden_size"] // heads)
    for tokens in [int(t) for t in args.chunk_tokens.split(",")]:
        lengths = [max(1, tokens - 7 * i) for i in range(args.chunks)]
        step = HookStep(heads, kv_heads, head_size, args.sys_tokens, lengths, args.block_size)
        diff = step.max_abs_diff()  # and each side run once before it is timed
        merged, kernel = [], []
        for _ in range(args.rounds):
            merged.append(timed(step.merged))
            kernel.append(timed(step.kernel))
        yield {
            "bench": "hook",
            "model": args.model,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_size": head_size,
            "sys_tokens": args.sys_tokens,
            "chunks": args.chunks,
            "chunk_tokens": tokens,
            "rows": sum(lengths),
            "threads": torch.get_num_threads(),
            "merged_ms": round(statistics.median(merged) * 1e3, 3),
            "kernel_ms": round(statistics.median(kernel) * 1e3, 3),
            "speedup": round(
                statistics.median(m / k for m, k in zip(merged, kernel, strict=True)), 2
            ),
            "max_abs_diff": float(f"{diff:.3g}"),
        }


class HookStep:
    """One layer of one step of a chunked request, as the isolation hook computes it: a
    random paged cache, the chunk rows' queries, and the hook with the settings vLLM's CPU
    back end gives a layer (its objects stated here: no vLLM engine runs)."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_size: int,
        sys_tokens: int,
        lengths: list[int],
        block_size: int,
        seed: int = 0,
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        total = sys_tokens + sum(lengths)
        blocks = -(-total // block_size) + 4
        order = torch.randperm(blocks, generator=generator)[: -(-total // block_size)]
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(dtype=torch.float32),
            compilation_config=SimpleNamespace(static_forward_context={}),
        )
        layout = CpuKVLayout(vllm_config, block_size)
        rotary = RotaryConfig(head_dim=head_size, rotary_dim=head_size, theta=10000.0)
        self.hook = IsolationHook(layout, rotary, ConnectorConfig(), on_miss=lambda _: None)
        self.impl = SimpleNamespace(
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=head_size,
            scale=head_size**-0.5,
            kv_cache_dtype="auto",
            sliding_window=None,
        )
        self.layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
        self.call = LayerCall(0, LAYER, self.impl, self.layer, torch.float32)
        self.cache = torch.zeros(blocks, kv_heads, block_size, 2 * head_size)
        slots = layout.slots(order, 0, total)
        keys = torch.randn(total, kv_heads, head_size, generator=generator)
        values = torch.randn(total, kv_heads, head_size, generator=generator)
        layout.write(LAYER, self.cache, keys, values, slots)
        self.rows, start = [], sys_tokens
        for length in lengths:  # every chunk token a query row, in prompt order
            shift = start - sys_tokens
            row = start - sys_tokens
            self.rows.append(HookRows(row, length, order, start, start + length, sys_tokens, shift))
            start += length
        self.query = torch.randn(sum(lengths), heads, head_size, generator=generator)
        self.chunks = self.hook.splitter.chunk_batch(self.rows, self.call)
        self.split = StepSplit([], None, chunks=self.chunks)

    def merged(self) -> torch.Tensor:
        split = StepSplit([], None)
        out = torch.empty_like(self.query)
        self.hook.attention.attend_rows(split, self.rows, self.call, self.query, self.cache, out)
        return out

    def kernel(self) -> torch.Tensor:
        """One layer's chunk rows; the hook's cache made at the first call and reused, as
        every layer of a step after the first reuses it."""
        assert self.chunks is not None
        out = torch.empty_like(self.query)
        self.hook.attention.attend_chunks(self.split, self.call, self.query, self.cache, out)
        return out

    def max_abs_diff(self) -> float:
        return float((self.merged() - self.kernel()).abs().max())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="model name or folder: its heads and head size"
    )
    parser.add_argument(
        "--chunk-tokens",
        default="50,100,200,300,500",
        help="tokens a chunk has, one row each (50,100,200,300,500)",
    )
    parser.add_argument("--chunks", type=int, default=6, help="chunks in the step (6)")
    parser.add_argument("--sys-tokens", type=int, default=24, help="sys tokens (24)")
    parser.add_argument(
        "--block-size", type=int, default=128, help="vLLM's cache block size (128, its CPU default)"
    )
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds a row (30)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
