"""vLLM's statistics vocabulary for ``connector.vllm``: ``KVStoreStats`` (the interval
counters vLLM sums and logs), ``hit_source`` (our tiers as vLLM's cache hit sources) and
``KVStorePromMetrics`` (those counters as vLLM's Prometheus counters, ``PROM_COUNTERS``).

Runs where vLLM gathers connector statistics: the scheduler process (hits, decisions,
resets), the workers (copies), and vLLM's stat loggers (``KVStorePromMetrics.observe``).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource


class KVStoreStats(KVConnectorStats):
    """Worker-side transfer counters for vLLM's periodic log (hit rates live on the
    scheduler side: ``stats_path`` and the Prometheus counters)."""

    def reset(self) -> None:
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


def hit_source(tier: str, host: str) -> CacheHitSource:
    """vLLM's name for where hits from ``tier`` came from (``host``: our host tier's name)."""
    if tier == host:
        return CacheHitSource.HOST
    return CacheHitSource.DISK if tier == "ssd" else CacheHitSource.EXTERNAL_UNSPECIFIED


# stats key (before the first ":") -> metric name, help, labels of the rest of the key
PROM_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "requests": ("vllm:kvstore_requests", "Requests the connector looked up", ()),
    "requests_hit": ("vllm:kvstore_request_hits", "Requests with tokens loaded by the connector", ()),
    "tokens_looked_up": ("vllm:kvstore_looked_up_tokens", "Prompt tokens the connector looked up", ()),
    "tokens_hit": ("vllm:kvstore_hit_tokens", "Tokens loaded instead of recomputed", ()),
    "tokens_hit_generated": ("vllm:kvstore_hit_tokens_generated", "Hit tokens an engine had generated", ()),
    "chunks_looked_up": ("vllm:kvstore_looked_up_chunks", "Full chunks looked up", ()),
    "chunks_hit": ("vllm:kvstore_chunk_hits", "Full chunks loaded", ()),
    "prefetches": ("vllm:kvstore_prefetches", "Prefetches from a lower tier into host DRAM", ()),
    "saves_committed": ("vllm:kvstore_saves_committed", "Objects saved into host DRAM", ()),
    "tokens_hit_by_tier": ("vllm:kvstore_hit_tokens_by_tier", "Hit tokens by the tier they were found in", ("tier",)),
    "bytes_by_tier": ("vllm:kvstore_tier_bytes", "Bytes moved by tier and direction", ("tier", "direction")),
    "failures": ("vllm:kvstore_failures", "Failures by tier and reason", ("tier", "reason")),
    "not_cached": ("vllm:kvstore_requests_not_cached", "Requests served without the connector, by reason", ("reason",)),
    "decisions": ("vllm:kvstore_load_decisions", "Load-or-recompute decisions by outcome", ("outcome",)),
    "resets": ("vllm:kvstore_cache_resets", "Cache resets and what they dropped or cancelled", ("what",)),
    "loads": ("vllm:kvstore_worker_loads", "Load jobs copied by the workers", ()),
    "load_failures": ("vllm:kvstore_worker_load_failures", "Load jobs that failed (vLLM recomputes)", ()),
    "bytes_loaded": ("vllm:kvstore_worker_bytes_loaded", "Bytes copied into the KV cache", ()),
    "saves": ("vllm:kvstore_worker_saves", "Objects gathered from the KV cache", ()),
    "save_failures": ("vllm:kvstore_worker_save_failures", "Gathers that failed", ()),
    "bytes_saved": ("vllm:kvstore_worker_bytes_saved", "Bytes gathered from the KV cache", ()),
    "sleep_drained": ("vllm:kvstore_worker_sleep_drained", "Gathers finished before a sleep", ()),
    "cancelled_asleep": ("vllm:kvstore_worker_cancelled_asleep", "Copies refused while asleep", ()),
}


class KVStorePromMetrics(KVConnectorPromMetrics):
    """Our counters (``get_kv_connector_stats``' keys, ``PROM_COUNTERS``) as vLLM's
    Prometheus counters, labelled per engine as vLLM labels its own."""

    def __init__(
        self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, *extra])
            for key, (name, doc, extra) in PROM_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, value in transfer_stats_data.items():
            table, _, rest = key.partition(":")
            spec = PROM_COUNTERS.get(table)
            if spec is None or not isinstance(value, (int, float)) or value <= 0:
                continue
            extra = spec[2]
            labels = rest.split(":", len(extra) - 1) if extra else []
            if len(labels) != len(extra):
                continue
            self._counters[table].labels(*engine, *labels).inc(value)
