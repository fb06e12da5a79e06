"""Writing a stored chunk into a paged KV cache, keys re-rotated on the way ("copy + RoPE
remap" through vLLM's slot mapping: docs/design.md#sources).

One interface, a back end per device: a fused single-pass kernel on the CPU
(``writer_cpu``, numba), one fused Triton kernel on CUDA and on Ascend NPUs where triton-ascend
is installed (``writer_triton``; it also writes one layer into a back end's strided cache
views: ``layer_writer_for``), and torch ops on any device (``write_torch``; on an NPU ``rope``
rotates with torch-npu's fused rotary kernel). A fused kernel is used only where it loads and
its self-check passes; any doubt and torch ops write. Adding a back end is adding an entry to
``_WRITER_FACTORIES``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.paging import PAD_SLOT
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table

log = logging.getLogger(__name__)


class Writer(Protocol):
    """A write back end: one chunk's KV into a flat paged cache, keys rotated on the way.

    keys / values: [layers, tokens, kv_heads, head_dim] as stored; flat_k / flat_v: [layers,
    slots, kv_heads, head_dim]; slots: [tokens] (PAD_SLOT: skip); cos / sin: the rotation
    table of each token, or None with ``rotary`` None to copy keys as they are.
    """

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        rotary: RotaryConfig | None,
    ) -> None: ...


# A tile's rotated keys, in bytes: about one core's L2 on a CPU (the per-layer tiles of 512
# tokens this replaced held as much), room for few launches on a device.
TILE_BYTES = {"cpu": 512 << 10, "default": 64 << 20}


def write_torch(
    keys: torch.Tensor,
    values: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    slots: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rotary: RotaryConfig | None,
    tile_tokens: int | None = None,
) -> None:
    """Any device, a tile of tokens at a time: the tile's keys of every layer rotated in one
    call (tokens first, layers as extra heads), then one scatter per tensor. A call per layer
    was 105x slower than a copy of the same bytes on an H200 (kernel launches, not bytes:
    docs/device-check.md). A tile's rotated buffer is ``TILE_BYTES`` of its device's: in
    cache on a CPU, few launches on a GPU."""
    keep = slots != PAD_SLOT
    if not bool(keep.all()):
        index = keep.nonzero().squeeze(1)
        keys, values, slots = keys[:, index], values[:, index], slots[index]
        if cos is not None and sin is not None:
            cos, sin = cos[index], sin[index]
    layers, tokens = keys.shape[:2]
    row = keys.shape[2:]
    if tile_tokens is None:
        budget = TILE_BYTES.get(keys.device.type, TILE_BYTES["default"])
        tile_tokens = max(16, budget // max(1, keys[:, :1].numel() * keys.element_size()))
    for start in range(0, tokens, tile_tokens):
        end = min(start + tile_tokens, tokens)
        tile_slots = slots[start:end]
        src = keys[:, start:end]
        if rotary is not None and cos is not None and sin is not None:
            by_token = src.transpose(0, 1).reshape(end - start, -1, row[-1])
            rotated = torch.empty_like(by_token)  # never in place: by_token may be ``keys``
            rotate_keys(by_token, cos[start:end], sin[start:end], rotary, out=rotated)
            src = rotated.view(end - start, layers, *row).transpose(0, 1)
        flat_k.index_copy_(1, tile_slots, src)
        flat_v.index_copy_(1, tile_slots, values[:, start:end])


def _cpu_writer() -> Writer:
    try:
        from chunkstore.kv.writer_cpu import fused_kernel_fits, write_cpu
    except ImportError as exc:  # numba missing: correct but slower
        log.warning("fused CPU remap kernel unavailable (%s); using torch ops", exc)
        return write_torch
    return _fused_where_it_fits(write_cpu, lambda k, v, fk, fv: fused_kernel_fits(k, fk, fv))


# Whether a fused writer takes these keys, values and caches (else torch ops write them).
Fits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], bool]


def _fused_where_it_fits(fused: Writer, fits: Fits) -> Writer:
    """``fused`` where ``fits`` says it takes the write, ``write_torch`` elsewhere."""

    def write(
        keys: torch.Tensor,
        values: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        rotary: RotaryConfig | None,
    ) -> None:
        writer = fused if fits(keys, values, flat_k, flat_v) else write_torch
        writer(keys, values, flat_k, flat_v, slots, cos, sin, rotary)

    return write


class LayerWriter(Protocol):
    """One layer's K and V ([tokens, kv_heads, head_dim]) into a back end's K and V views
    ([blocks, block_size, kv_heads, head_dim], any strides; ``cache_layouts``) at ``slots``
    (PAD_SLOT: skip), keys rotated by ``rotation`` (cos, sin per token) where given. False:
    nothing written (a dtype it has no kernel for), the caller writes with torch ops."""

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        key_view: torch.Tensor,
        value_view: torch.Tensor | None,
        slots: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None,
        rotary: RotaryConfig | None,
    ) -> bool: ...


def triton_problem(device_type: str) -> str | None:
    """Why the fused Triton kernel does not serve this device type (None: it does): triton
    does not import, or its self-check on the device failed. Checked once per device type."""
    if device_type not in _triton_problems:
        try:
            from chunkstore.kv.writer_triton import self_check
        except ImportError as exc:
            _triton_problems[device_type] = f"triton unavailable ({exc})"
        else:
            _triton_problems[device_type] = self_check(device_type, write_torch)
        if _triton_problems[device_type]:
            log.warning(
                "fused Triton KV writer not used on %s: %s; using torch ops",
                device_type,
                _triton_problems[device_type],
            )
    return _triton_problems[device_type]


def _triton_writer(device_type: str) -> Writer:
    if triton_problem(device_type):
        return write_torch
    from chunkstore.kv.writer_triton import kernel_fits, write_triton

    return _fused_where_it_fits(write_triton, kernel_fits)


def _triton_layer_writer(device_type: str) -> LayerWriter | None:
    if triton_problem(device_type):
        return None
    from chunkstore.kv.writer_triton import write_layer_triton

    return write_layer_triton


_WRITER_FACTORIES: dict[str, Callable[[], Writer]] = {
    "cpu": _cpu_writer,
    "cuda": functools.partial(_triton_writer, "cuda"),
    "npu": functools.partial(_triton_writer, "npu"),
}
_LAYER_WRITER_FACTORIES: dict[str, Callable[[], LayerWriter | None]] = {
    "cuda": functools.partial(_triton_layer_writer, "cuda"),
    "npu": functools.partial(_triton_layer_writer, "npu"),
}
_writers: dict[str, Writer] = {}
_layer_writers: dict[str, LayerWriter | None] = {}
_triton_problems: dict[str, str | None] = {}


def writer_for(device_type: str) -> Writer:
    """The write back end for a device type (torch ops unless a fused one is registered)."""
    if device_type not in _writers:
        factory = _WRITER_FACTORIES.get(device_type)
        _writers[device_type] = factory() if factory else write_torch
    return _writers[device_type]


def layer_writer_for(device_type: str) -> LayerWriter | None:
    """The fused one-layer writer for a device type, or None: ``CacheLayout.write`` then
    writes with torch ops."""
    if device_type not in _layer_writers:
        factory = _LAYER_WRITER_FACTORIES.get(device_type)
        _layer_writers[device_type] = factory() if factory else None
    return _layer_writers[device_type]


def write_chunk(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    delta: int | torch.Tensor,
    rotary: RotaryConfig | None,
    writer: Writer | None = None,
) -> None:
    """Write one chunk's KV for every layer into a paged cache, rotating keys by ``delta``.

    keys / values: [layers, tokens, kv_heads, head_dim] as stored; caches: [layers,
    num_blocks, block_size, kv_heads, head_dim]; slots: [tokens], PAD_SLOT where another
    context-parallel rank owns the token. ``rotary=None`` or a zero delta copies keys as
    they are. Values are never touched but copied.
    """
    layers, tokens = keys.shape[:2]
    row_shape = keys.shape[2:]
    if values.shape[:2] != (layers, tokens) or slots.shape != (tokens,):
        raise LayoutError(
            f"keys {tuple(keys.shape)}, values {tuple(values.shape)} and "
            f"{tokens} slots do not describe one chunk"
        )
    for name, cache, rows in (
        ("key", key_cache, row_shape),
        ("value", value_cache, values.shape[2:]),
    ):
        if cache.shape[0] != layers or cache.shape[3:] != rows or cache.dtype != keys.dtype:
            raise LayoutError(
                f"{name} cache {tuple(cache.shape)} {cache.dtype} does not fit "
                f"the chunk's {tuple(keys.shape)} {keys.dtype}"
            )
    capacity = key_cache.shape[1] * key_cache.shape[2]
    slots = slots.to(keys.device).long()
    if tokens and int(slots.max()) >= capacity:
        raise LayoutError(f"slot {int(slots.max())} beyond the cache's {capacity} slots")
    flat_k = key_cache.view(layers, capacity, *row_shape)
    flat_v = value_cache.view(layers, capacity, *value_cache.shape[3:])
    cos = sin = None
    if rotary is not None and not (isinstance(delta, int) and delta == 0):
        cos, sin = rotation_table(rotary, delta, tokens, keys.device)
    else:
        rotary = None
    (writer or writer_for(keys.device.type))(keys, values, flat_k, flat_v, slots, cos, sin, rotary)
