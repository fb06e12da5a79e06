"""``chunkstore bench remap``: remap + paged write of one chunk against a plain copy.

A 4096-token chunk in SmolLM2's KV shape (30 layers, 3 KV heads x 64) is written into a paged
cache through a slot mapping twice per round, side by side: once as a plain copy of the same
bytes (one indexed assignment per tensor, torch's fastest scatter) and once with its keys
rotated by ``p - v`` on the way. ``ratio_vs_copy`` is the median over rounds of remap time
over copy time, so both sides see the same machine noise. Every run also checks the written
keys against ``remap_keys``: a fast wrong answer does not count.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from typing import Any

import torch

from chunkstore.bench.timing import timed
from chunkstore.kv.paging import slot_mapping
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.writer import write_chunk, write_torch, writer_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    actual_start = 40 + args.delta  # stored at virtual start 40, reused delta tokens later
    blocks = -(-(actual_start + args.tokens) // args.block_size)
    generator = torch.Generator().manual_seed(0)
    table = torch.randperm(blocks + 8, generator=generator)[:blocks][None]
    positions = torch.arange(actual_start, actual_start + args.tokens)
    slots = slot_mapping(torch.zeros_like(positions), positions, table, args.block_size)
    for dtype_name in args.dtypes:
        yield _measure(args, DTYPES[dtype_name], slots, blocks + 8, generator)


def _measure(
    args: argparse.Namespace,
    dtype: torch.dtype,
    slots: torch.Tensor,
    num_blocks: int,
    generator: torch.Generator,
) -> dict[str, Any]:
    rotary = RotaryConfig(head_dim=args.head_dim, rotary_dim=args.head_dim, theta=100000.0)
    shape = (args.layers, args.tokens, args.kv_heads, args.head_dim)
    keys = torch.randn(shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator).to(dtype)
    cache_shape = (args.layers, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    key_cache = torch.zeros(cache_shape, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    flat_k = key_cache.view(args.layers, -1, args.kv_heads, args.head_dim)
    flat_v = value_cache.view(args.layers, -1, args.kv_heads, args.head_dim)

    def copy() -> None:
        flat_k[:, slots] = keys
        flat_v[:, slots] = values

    def remap(writer: Any = None) -> None:
        write_chunk(keys, values, key_cache, value_cache, slots, args.delta, rotary, writer)

    remap()  # compile / warm up
    # Within one unit in the last place: kernels may round a * c - b * s differently.
    expected = remap_keys(keys[-1], args.delta, rotary)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(flat_k[-1, slots].float(), expected.float(), rtol=ulp, atol=1e-6)
    copy()
    copies, remaps, torch_ops = [], [], []
    for _ in range(args.repeats):
        copies.append(timed(copy))
        remaps.append(timed(remap))
        if args.torch_ops:
            torch_ops.append(timed(lambda: remap(write_torch)))
    nbytes = 2 * keys.numel() * keys.element_size()
    result = {
        "bench": "remap",
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": args.tokens,
        "layers": args.layers,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "delta": args.delta,
        "bytes": nbytes,
        "repeats": args.repeats,
        "writer": "writer" if writer_for("cpu") is write_torch else "writer_cpu",
        "threads": torch.get_num_threads(),
        "copy_ms_p50": round(statistics.median(copies) * 1e3, 3),
        "remap_ms_p50": round(statistics.median(remaps) * 1e3, 3),
        "copy_gb_s": round(nbytes / statistics.median(copies) / 1e9, 2),
        "remap_gb_s": round(nbytes / statistics.median(remaps) / 1e9, 2),
        "ratio_vs_copy": _median_ratio(remaps, copies),
    }
    if torch_ops:
        result["torch_ops_ratio_vs_copy"] = _median_ratio(torch_ops, copies)
    return result


def _median_ratio(measured: list[float], baseline: list[float]) -> float:
    """Median of per-round ratios: each pair ran back to back under the same load."""
    return round(statistics.median(m / b for m, b in zip(measured, baseline, strict=True)), 3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="chunk length (default 4096)")
    parser.add_argument("--layers", type=int, default=30, help="layers (SmolLM2: 30)")
    parser.add_argument("--kv-heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim (SmolLM2: 64)")
    parser.add_argument("--block-size", type=int, default=16, help="paged cache block size")
    parser.add_argument("--delta", type=int, default=1234, help="p - v, positions moved")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per dtype")
    parser.add_argument(
        "--torch-ops",
        action="store_true",
        help="also time the unfused torch-ops writer, for comparison",
    )
