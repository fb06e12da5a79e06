"""The chunk the store benches move (``store``, ``pull``, ``store --tier disk``): seeded KV
in SmolLM2's shape by default, and the arguments that set it."""

from __future__ import annotations

import argparse

import torch


def chunk_kv(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Seeded keys and values of one chunk in the shape ``add_chunk_arguments`` sets, and
    their bytes."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    shape = (args.layers, args.tokens, args.kv_heads, args.head_dim)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    return keys, values, 2 * keys.numel() * keys.element_size()


def add_chunk_arguments(parser: argparse.ArgumentParser, tokens: int = 4096) -> None:
    """The chunk a bench moves: SmolLM2's KV shape by default, and the pool's block size."""
    parser.add_argument(
        "--tokens", type=int, default=tokens, help=f"chunk length (default {tokens})"
    )
    parser.add_argument("--layers", type=int, default=30, help="layers (SmolLM2: 30)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (SmolLM2: 64)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--block-size", type=int, default=1 << 20, help="pool block size")
