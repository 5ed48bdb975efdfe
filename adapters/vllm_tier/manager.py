"""``KVStoreSecondaryTier``: kvstore as a ``SecondaryTierManager`` of vLLM's native offloading
(``vllm/v1/kv_offload/tiering/base.py``), under vLLM's CPU primary tier.

Runs in vLLM's scheduler process: vLLM's ``SecondaryTierFactory`` builds it from its dict in
``kv_connector_extra_config["secondary_tiers"]`` (``type: KVStoreSecondaryTier``,
``module_path: adapters.vllm_tier``), and ``TieringOffloadingManager`` calls it each step.
Every method returns at once: lookups, stores and loads run on the store's own event loop
(``adapters.lower.LowerStore``).

* ``lookup`` asks the tiers whether the chunk is there, waits ``LOOKUP_WAIT_S`` for the
  answer and otherwise answers ``RETRY`` (vLLM asks again next step and gets the answer; an
  answer not asked for again within ``STALE_STEPS`` steps is dropped).
* ``submit_store`` writes each chunk's row of the primary region through to every tier as one
  object; ``submit_load`` reads each object back, verified, into its primary slot; a job's
  chunks move concurrently (``adapters.lower.PARALLEL`` at once).  A job's
  ``JobResult`` is queued by the job itself before its future completes, so ``drain_jobs``
  leaves every result ready for ``get_finished_jobs``.
* Keys: vLLM's offload key (block hash and KV group) becomes an object key in the namespace
  of the model, its geometry and ``scope`` (``adapters.vllm_tier.config``).
* ``take_events`` and ``get_stats``: the tier's KV events (when vLLM's KV cache events are on)
  and its metrics (``build_metric_definitions``), kept by ``adapters.vllm_tier.observe``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from adapters.lower import LowerStore
from adapters.vllm_tier.config import LAYOUT_ID, namespace_of, object_key, parse_params
from adapters.vllm_tier.observe import (
    LOAD_MISSED,
    LOADED_BYTES,
    LOOKUPS,
    METRICS,
    STORE_MISSED,
    STORE_SECONDS,
    STORED_BYTES,
    TierEvents,
    TierStats,
)
from kvstore.keys import ObjectKey

LOOKUP_WAIT_S = 0.005
DRAIN_TIMEOUT_S = 60.0
STALE_STEPS = 2


class KVStoreSecondaryTier(SecondaryTierManager):
    """A secondary tier whose storage is kvstore's SSD directory, store process or Redis."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **params: Any,
    ) -> None:
        parsed = parse_params(params)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(parsed.locality) if parsed.locality else None
        self.namespace = namespace_of(offloading_spec.config, self.block_size_bytes, parsed.scope)
        self._lookups: dict[bytes, tuple[concurrent.futures.Future[bool], int]] = {}
        self._step = 0
        self._jobs: dict[int, concurrent.futures.Future[None]] = {}
        self._finished: deque[JobResult] = deque()
        self.store = LowerStore(parsed.store, LAYOUT_ID, "vllm-tier")
        self.stats = TierStats()
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False))
        self.events = TierEvents(events_on, self.medium, self.locality, tier_type)
        self.events.watch(self.store.tiers)
        self._rows = primary_kv_view.cast("B")  # after the last step that can fail: released at shutdown

    def key_of(self, offload_key: bytes) -> ObjectKey:
        """The object key of one of vLLM's offload keys."""
        return object_key(self.namespace, offload_key)

    def _row(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._rows[int(chunk_id) * size : (int(chunk_id) + 1) * size]

    # --- lookups -------------------------------------------------------------------------------

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        future = self._lookups.get(key, (None, 0))[0]
        if future is None:
            future = self.store.submit(self.store.contains(self.key_of(key)))
            self._lookups[key] = (future, self._step)
            concurrent.futures.wait([future], LOOKUP_WAIT_S)
        if not future.done():
            self._lookups[key] = (future, self._step)  # asked again: still wanted
            return LookupResult.RETRY
        del self._lookups[key]
        try:
            answer = LookupResult.HIT if future.result() else LookupResult.MISS
        except Exception:  # noqa: BLE001 - a failed lookup is a miss (counted by the store)
            self.store.counters["lookup:failed"] += 1
            answer = LookupResult.MISS
        self.stats.count(LOOKUPS, 1, ("hit" if answer is LookupResult.HIT else "miss",))
        return answer

    # --- jobs ----------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._start(job_metadata, self._store(job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._start(job_metadata, self._load(job_metadata))

    def _start(self, job: TransferJob, coro: Any) -> None:
        self._jobs[job.job_id] = self.store.submit(coro)

    async def _store(self, job: TransferJob) -> None:
        t0 = time.monotonic()
        okeys = [self.key_of(key) for key in job.keys]
        rows = [self._row(chunk) for chunk in job.chunk_ids]
        results = await self.store.each(range(len(okeys)), lambda i: self.store.write(okeys[i], rows[i]))
        held = []
        for okey, key, tiers in zip(okeys, job.keys, results, strict=True):
            if isinstance(tiers, BaseException):  # a chunk whose write raised: vLLM is told the job failed
                self.store.counters["store:failed"] += 1
            elif tiers:
                held.append((okey, key, tiers))
        ok = len(held) == len(job.keys)
        self.events.job_stored(held)
        self.stats.count(STORED_BYTES, len(held) * self.block_size_bytes)
        self.stats.count(STORE_MISSED, len(job.keys) - len(held))
        self.stats.observe(STORE_SECONDS, time.monotonic() - t0)
        self._finished.append(
            JobResult(
                job.job_id,
                ok,
                transfer_time=time.monotonic() - t0,
                transfer_bytes=len(job.keys) * self.block_size_bytes,
            )
        )

    async def _load(self, job: TransferJob) -> None:
        t0 = time.monotonic()
        keys, chunks = list(job.keys), list(job.chunk_ids)
        got = await self.store.each(
            range(len(keys)), lambda i: self.store.read(self.key_of(keys[i]), self._row(chunks[i]))
        )
        loaded = []
        for key, ok in zip(keys, got, strict=True):
            if isinstance(ok, BaseException):  # what loaded besides it still counts
                self.store.counters["load:failed"] += 1
            elif ok:
                loaded.append(key)
        whole = len(loaded) == len(job.keys)
        self.stats.count(LOADED_BYTES, len(loaded) * self.block_size_bytes)
        self.stats.count(LOAD_MISSED, len(job.keys) - len(loaded))
        self._finished.append(
            JobResult(
                job.job_id,
                whole,
                successful_keys=None if whole else loaded,
                transfer_time=time.monotonic() - t0,
                transfer_bytes=len(loaded) * self.block_size_bytes,
            )
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = []
        while self._finished:
            result = self._finished.popleft()
            self._jobs.pop(result.job_id, None)
            done.append(result)
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._finished)

    def drain_jobs(self) -> None:
        concurrent.futures.wait(list(self._jobs.values()), DRAIN_TIMEOUT_S)

    # --- events and metrics ------------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored and removed events of this tier's keys since the last call (``observe``)."""
        return self.events.take()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The tier's metrics (``adapters.vllm_tier.observe.METRICS``)."""
        return dict(METRICS)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The tier's observations since the last call."""
        return self.stats.take(self.store.counters)

    # --- requests and lifetime -----------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        """Forget answers nobody asked for again within ``STALE_STEPS`` steps (a request
        aborted after a RETRY), so a later lookup asks the tiers afresh."""
        self._step += 1
        stale = [
            key for key, (future, step) in self._lookups.items() if future.done() and self._step - step > STALE_STEPS
        ]
        for key in stale:
            del self._lookups[key]

    def shutdown(self) -> None:
        """Drain, close the tiers, and release this tier's view of the primary region (so
        vLLM can unmap it)."""
        self.drain_jobs()
        self.store.close()
        self._rows.release()


__all__ = ["LOOKUP_WAIT_S", "KVStoreSecondaryTier"]
