"""What an entry holds and how its bytes are laid out: keys [layers, tokens, kv_heads,
head_dim] then values, each C-contiguous in the stored dtype (MLA: one latent tensor).

An entry may instead hold a serving engine's own cache blocks, copied as they are
(``packing`` names the engine's block layout; see ``connector/cpu_layout.py``): an exact
prefix block then loads into that engine's cache as plain copies. Only a reader whose cache
has that same packing can use such an entry; every other reader refuses it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from chunkstore.errors import InvalidRequest

if TYPE_CHECKING:
    import torch

# The stored dtypes by name, with their item sizes. Names, not torch dtypes: the daemon checks
# layouts without importing torch (it starts in a fraction of the time).
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
KINDS = ("kv", "mla")


class EntryKind(StrEnum):
    """What an entry is, for the metrics by kind and the eviction's worth."""

    CHUNK = "chunk"  # a position-independent sys or chunk segment
    PREFIX = "prefix"  # an exact prefix block of a plain prompt
    SUMMARY = "summary"  # a long chunk's block summary (kv.sparse; key: kv.keys.summary_key)


ENTRY_KINDS = tuple(kind.value for kind in EntryKind)
MAX_PACKING = 64  # characters in a packing name


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class EntryLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kind: str
    num_tokens: int
    virtual_start: int
    entry_kind: str = EntryKind.CHUNK
    packing: str = ""  # "": the token-major layout above; else an engine's cache blocks

    def validate(self) -> None:
        if self.dtype not in ITEMSIZES:
            raise InvalidRequest(f"dtype {self.dtype!r} is not one of {', '.join(ITEMSIZES)}")
        if self.kind not in KINDS:
            raise InvalidRequest(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        dims = (self.num_layers, self.num_kv_heads, self.head_dim, self.num_tokens)
        if min(dims) <= 0:
            raise InvalidRequest(f"layout dimensions must be positive: {self}")
        if self.virtual_start < 0:
            raise InvalidRequest("virtual_start must be >= 0")
        check_entry_kind(self.entry_kind)
        if len(self.packing) > MAX_PACKING or not self.packing.isascii():
            raise InvalidRequest(f"packing must be at most {MAX_PACKING} ASCII characters")
        if self.packing and self.kind != "kv":
            raise InvalidRequest("only kv entries may be packed as cache blocks")

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes the layout needs: K and V (or one latent for MLA)."""
        count = self.num_layers * self.num_tokens * self.num_kv_heads * self.head_dim
        return count * ITEMSIZES[self.dtype] * (2 if self.kind == "kv" else 1)


def check_entry_kind(entry_kind: str) -> None:
    if entry_kind not in ENTRY_KINDS:
        raise InvalidRequest(f"entry_kind {entry_kind!r} is not one of {', '.join(ENTRY_KINDS)}")


def layout_of(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    virtual_start: int,
    entry_kind: str = EntryKind.CHUNK,
) -> EntryLayout:
    """The layout of a KV pair [layers, tokens, kv_heads, head_dim] (values None for MLA)."""
    if keys.dim() != 4 or (values is not None and values.shape != keys.shape):
        raise InvalidRequest(
            "keys and values must both be [layers, tokens, kv_heads, head_dim], "
            f"got {tuple(keys.shape)} and {None if values is None else tuple(values.shape)}"
        )
    names = {torch_dtype(name): name for name in ITEMSIZES}
    if keys.dtype not in names or (values is not None and values.dtype != keys.dtype):
        raise InvalidRequest(f"unsupported or mixed dtypes {keys.dtype}")
    layers, tokens, heads, dim = keys.shape
    kind = "kv" if values is not None else "mla"
    return EntryLayout(
        layers, heads, dim, names[keys.dtype], kind, tokens, virtual_start, entry_kind
    )


def tensors_of(
    buffer: torch.Tensor, layout: EntryLayout
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Views of an entry's bytes (uint8) as its keys and values, no copy."""
    typed = buffer.view(torch_dtype(layout.dtype))
    if layout.kind == "mla":
        return typed.view(layout.tensor_shape), None
    half = typed.shape[0] // 2
    return typed[:half].view(layout.tensor_shape), typed[half:].view(layout.tensor_shape)
