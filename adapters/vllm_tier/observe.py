"""What ``KVStoreSecondaryTier`` reports to vLLM: its KV events (``take_events``) and its
metrics (``build_metric_definitions`` / ``get_stats``).

Runs in vLLM's scheduler process.  Observations arrive on the store's event loop thread (a
job's result, a tier's residency callback) and are taken on the scheduler thread, so both
classes guard their state with a lock.

* ``TierEvents``: a stored event for the keys of a store job that some kvstore tier holds, and
  a removed event for a key once every tier that held it has dropped it (evicted, expired,
  deleted, or removed as forged), learned from the tiers' residency listeners
  (``tiers.base.listen``).  It tracks the keys this process stored, at most ``MAX_TRACKED``
  (the oldest forgotten first: their removal is then not reported).
* ``TierStats``: the counters and histogram of ``METRICS``, as vLLM's
  ``OffloadingConnectorStats``.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)

from kvstore.keys import ObjectKey
from tiers.base import Removal, Tier, listen

MAX_TRACKED = 1 << 20

STORED_BYTES = "kvstore:vllm_tier_stored_bytes"
LOADED_BYTES = "kvstore:vllm_tier_loaded_bytes"
STORE_MISSED = "kvstore:vllm_tier_store_missed_chunks"
LOAD_MISSED = "kvstore:vllm_tier_load_missed_chunks"
LOOKUPS = "kvstore:vllm_tier_lookups"
REFUSED = "kvstore:vllm_tier_refused_objects"
TIER_ERRORS = "kvstore:vllm_tier_backend_errors"
STORE_SECONDS = "kvstore:vllm_tier_store_job_seconds"
REFUSALS = ("forged", "encrypted", "wrong_size")

METRICS: dict[str, OffloadingMetricMetadata] = {
    STORED_BYTES: OffloadingCounterMetadata("Bytes of chunks a store job got into at least one kvstore tier."),
    LOADED_BYTES: OffloadingCounterMetadata("Bytes of verified chunks loaded from kvstore into the primary tier."),
    STORE_MISSED: OffloadingCounterMetadata("Chunks of store jobs that no kvstore tier took."),
    LOAD_MISSED: OffloadingCounterMetadata("Chunks of load jobs that no kvstore tier could supply."),
    LOOKUPS: OffloadingCounterMetadata("Answered lookups, by result (hit, miss).", labelnames=("result",)),
    REFUSED: OffloadingCounterMetadata(
        "Objects read from a kvstore tier and refused (forged, encrypted without a key, wrong size).",
        labelnames=("backend", "reason"),
    ),
    TIER_ERRORS: OffloadingCounterMetadata(
        "Failed operations of a kvstore tier (counted as misses), by backend and operation.",
        labelnames=("backend", "op"),
    ),
    STORE_SECONDS: OffloadingHistogramMetadata(
        "Duration of the tier's store jobs, in seconds.", buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)
    ),
}


class TierEvents:
    """The tier's KV events (module docstring); ``enabled`` false keeps nothing."""

    def __init__(self, enabled: bool, medium: Medium, locality: Locality | None, ownership: str) -> None:
        self.enabled = enabled
        self._medium, self._locality, self._ownership = medium, locality, ownership
        self._lock = threading.Lock()
        self._events: list[OffloadingEvent] = []
        self._held: OrderedDict[ObjectKey, tuple[bytes, set[str]]] = OrderedDict()

    def watch(self, tiers: Iterable[Tier]) -> None:
        """Listen to what ``tiers`` drop."""
        if self.enabled:
            for tier in tiers:
                listen(tier, self)

    def _event(self, keys: list[bytes], removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys, self._medium, removed, self._locality, self._ownership)

    def job_stored(self, held: Sequence[tuple[ObjectKey, bytes, list[str]]]) -> None:
        """A store job's keys (object key, offload key, the tiers holding it) that some tier holds."""
        if not self.enabled or not held:
            return
        with self._lock:
            for key, offload_key, tiers in held:
                self._held[key] = (offload_key, set(tiers))
                self._held.move_to_end(key)
            while len(self._held) > MAX_TRACKED:
                self._held.popitem(last=False)
            self._events.append(self._event([offload_key for _, offload_key, _ in held], False))

    def stored(self, tier: str, key: ObjectKey) -> None:
        """Residency callback: stores are reported per job (``job_stored``)."""

    def removed(self, tier: str, key: ObjectKey, reason: Removal) -> None:
        """Residency callback: ``key`` left ``tier``; reported once no tier holds it."""
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            entry[1].discard(tier)
            if not entry[1]:
                del self._held[key]
                self._events.append(self._event([entry[0]], True))

    def take(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


class TierStats:
    """The observations of ``METRICS`` since the last ``take`` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = OffloadingConnectorStats()
        self._seen: Counter[str] = Counter()

    def count(self, name: str, value: float = 1, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            self._stats.increase_counter(name, value, labels)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._stats.observe_histogram(name, value)

    def _store_counters(self, counters: Counter[str]) -> None:
        """The refusals and tier errors ``LowerStore`` counted since the last call."""
        for name, total in list(counters.items()):
            delta = total - self._seen[name]
            if delta <= 0:
                continue
            self._seen[name] = total
            parts = name.split(":")
            if len(parts) == 2 and parts[1] in REFUSALS:
                self._stats.increase_counter(REFUSED, delta, (parts[0], parts[1]))
            elif len(parts) == 3 and parts[2][:1].isupper():
                self._stats.increase_counter(TIER_ERRORS, delta, (parts[0], parts[1]))

    def take(self, counters: Counter[str]) -> OffloadingConnectorStats | None:
        """Everything observed since the last call (None: nothing), then start afresh."""
        with self._lock:
            self._store_counters(counters)
            stats, self._stats = self._stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats


__all__ = ["MAX_TRACKED", "METRICS", "TierEvents", "TierStats"]
