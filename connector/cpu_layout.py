"""vLLM's CPU attention cache, as the connector reads and writes it (worker process).

One tensor per layer, [blocks, kv_heads, block_size, 2 * head_size]: viewed as [blocks,
kv_heads, 2 * block_size, head_size], the first block_size rows are K and the rest V
(vllm/v1/attention/backends/cpu_attn.py). Writes go through vLLM's own
``cpu_attn_reshape_and_cache``, whatever its kernel's internal layout. Reads decode the layout
of its "vec" kernels (per block and head, K dim-major [head_size, block_size], then V
token-major [block_size, head_size]), and are trusted only after ``probe`` showed the kernel
writes exactly that; loads then write that layout directly, keys rotated on the way
(``write_rotated``, one pass instead of remap, copy and vLLM's op).

Exact prefix blocks need none of that: no rotation, and whole cache blocks. They are stored
as the cache's own blocks (``packing``), read out as plain block copies and loaded straight
from the pool into the blocks, whatever the kernel's internal layout; only a cache of the
same packing loads them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.entry import MAX_PACKING
from chunkstore.kv.paging import request_slots
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig

log = logging.getLogger("chunkstore.connector")


class CpuKVLayout:
    def __init__(self, vllm_config: Any, block_size: int) -> None:
        self.vllm_config = vllm_config
        self.block_size = block_size
        self.plain = False  # the probe showed the "vec" layout ``read`` decodes

    @staticmethod
    def local_heads(cache: torch.Tensor) -> int:
        return int(cache.shape[1])

    @staticmethod
    def head_dim(cache: torch.Tensor) -> int:
        return int(cache.shape[3] // 2)

    def write_rotated(
        self,
        layer_name: str,
        cache: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        slots: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None,
        rotary: RotaryConfig,
    ) -> None:
        """K, rotated by ``rotation`` (cos, sin: see ``rope.rotation_table``; None: as they
        are), and V [tokens, heads, head_size] into the cache at ``slots``. In one pass (the
        fused kernel) where the probe showed the "vec" layout and the kernel takes the dtype;
        else remap, then vLLM's own write op."""
        if values is None:
            raise LayoutError("vLLM's CPU attention cache holds values: an MLA latent came")
        if self.plain and self.isa(layer_name) == "vec":
            # Imported here, not with the module: vLLM (0.32) scans every loaded module when
            # a worker starts and fails on an object numba's llvmlite defines, which would
            # break an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0).
            from chunkstore.kv.writer_cpu import write_vec_layer

            key_part, value_part = self._parts(cache)
            if write_vec_layer(keys, values, key_part, value_part, slots, rotation, rotary):
                return
        if rotation is not None:
            keys = rotate_keys(keys, *rotation, rotary, out=torch.empty_like(keys))
        self.write(layer_name, cache, keys, values, slots)

    def isa(self, layer_name: str) -> str:
        """The kernel variant vLLM picked for a layer (set on the layer by its builder)."""
        layer = self.vllm_config.compilation_config.static_forward_context.get(layer_name)
        return str(getattr(layer, "isa", "vec"))

    def write(
        self,
        layer_name: str,
        cache: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """K and V [tokens, heads, head_size] into the cache at ``slots``, as vLLM writes."""
        from vllm import _custom_ops as ops

        blocks, heads, block_size, _ = cache.shape
        view = cache.view(blocks, heads, 2 * block_size, -1)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            keys.contiguous(),
            values.contiguous(),
            key_cache,
            value_cache,
            slots,
            self.isa(layer_name),
        )

    @staticmethod
    def read(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens at ``slots``, [tokens, heads, head_size] each (copies)."""
        key_part, value_part = CpuKVLayout._parts(cache)
        block_size = cache.shape[2]
        block, offset = slots // block_size, slots % block_size
        return key_part[block, :, :, offset], value_part[block, :, offset, :]

    @staticmethod
    def _parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the "vec" layout: K [blocks, heads, head_size, block_size] (dim-major)
        and V [blocks, heads, block_size, head_size]."""
        blocks, heads, block_size, width = cache.shape
        dim = width // 2
        region = cache.view(blocks, heads, 2 * block_size * dim)
        key_part = region[:, :, : block_size * dim].view(blocks, heads, dim, block_size)
        value_part = region[:, :, block_size * dim :].view(blocks, heads, block_size, dim)
        return key_part, value_part

    def probe(self, layer_name: str, cache: torch.Tensor) -> bool:
        """Write two tokens into block 0 (vLLM's null block, never handed to a request)
        through the kernel's op and read them back with ``read``; restore the block after."""
        heads, dim = cache.shape[1], cache.shape[3] // 2
        saved = cache[0].clone()
        try:
            keys = torch.randn(2, heads, dim).to(cache.dtype)
            values = torch.randn(2, heads, dim).to(cache.dtype)
            slots = torch.tensor([0, 1], dtype=torch.int64)
            self.write(layer_name, cache, keys, values, slots)
            got_k, got_v = self.read(cache, slots)
            self.plain = bool(torch.equal(got_k, keys) and torch.equal(got_v, values))
            return self.plain
        except Exception as err:  # noqa: BLE001 - any failure means: do not trust reads
            log.warning("chunkstore: cache layout probe failed: %s", err)
            return False
        finally:
            cache[0].copy_(saved)

    def warm_up(self, layer_name: str, cache: torch.Tensor, rotary: RotaryConfig) -> None:
        """Load the fused write kernel and the pool's streaming copy now, at start-up, not
        in the first requests: numba's import and the write kernel's cached machine code
        took ~1 s there, which was the first requests' whole TTFT gap to vLLM alone (``bench
        workload --ttfts``), and the copy's first save compiles it where no cache is yet
        (~0.4 s of a core; a fresh install's first requests). Two tokens rotated into block
        0 (vLLM's null block), restored after, with arrays of the kinds requests pass (so
        numba has the specialization they call), and a copy of 8 bytes. Only in a worker
        process of its own: vLLM's start-up scan of loaded modules trips on numba's
        objects, so an in-process engine started after this one would fail. A failure here
        is logged, and the first request that needs a kernel loads it, as before."""
        import vllm.envs as envs

        if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            return  # (``write_rotated`` takes the kernel only where the probe allows it)
        from chunkstore.client import load_copy_kernel
        from chunkstore.kv.rope import rotation_table

        saved = cache[0].clone()
        try:
            slots = torch.tensor([0, 1], dtype=torch.int64)
            keys, values = self.read(cache, slots)
            rotation = rotation_table(rotary, 1, 2, cache.device)
            self.write_rotated(layer_name, cache, keys, values, slots, rotation, rotary)
            load_copy_kernel()
        except Exception as err:  # noqa: BLE001 - start-up goes on; requests load them lazily
            log.warning("chunkstore: numba's kernels did not load at start-up: %s", err)
        finally:
            cache[0].copy_(saved)

    def packing(self, layers: list[tuple[str, torch.Tensor]], kv_dtype: str) -> str:
        """The name of this cache's block layout, for entries stored as its raw blocks
        (``EntryLayout.packing``): vLLM's version, the kernel variant and the block size fix
        what a block's bytes mean; heads, head size and dtype are the entry's own fields.
        "" where the layers differ or a block is not contiguous (then entries stay plain)."""
        import vllm

        isas = {self.isa(name) for name, _ in layers}
        caches = [cache for _, cache in layers]
        if len(isas) != 1 or not all(cache.is_contiguous() for cache in caches):
            return ""
        if any(str(cache.dtype).removeprefix("torch.") != kv_dtype for cache in caches):
            return ""
        name = f"vllm-cpu/{vllm.__version__}/{isas.pop()}/{self.block_size}"
        return name if len(name) <= MAX_PACKING else ""

    @staticmethod
    def read_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Copies of whole cache blocks, as they are."""
        return cache.index_select(0, block_ids)

    def slots(self, block_ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Slots of positions [start, start + count) of a request with this block table."""
        return request_slots(block_ids, start, count, self.block_size)
