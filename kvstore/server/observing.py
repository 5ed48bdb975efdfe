"""What the store process shows beyond its counters: its stage trace (``--trace-path``:
``kvstore.trace``).  Server side; started and closed by ``kvstore.server.main`` (the KV
events are the store's own: ``ServerStore.open`` starts their publisher,
``kvstore.server.kvpublish``).

The trace has, per timed stage (``ServerMetrics.observe``: lookup, get, put_commit,
put_stream, promote, write_through...), lanes of spans (concurrent calls overlap, so each
goes to the first lane where it overlaps nothing), and per tier a track of instants: each
object stored, and each removed with the reason.
"""

from __future__ import annotations

import time

from kvstore.server.config import ServerConfig
from kvstore.server.core import ServerStore
from kvstore.server.metrics import ServerMetrics
from kvstore.trace import Tracer
from kvstore.wire.kv import wire_hash
from tiers.base import listen


def start_trace(cfg: ServerConfig, metrics: ServerMetrics):
    """With ``trace_path``: a Chrome trace of every timed stage (``ServerMetrics.observe``)
    and of what each tier stores and drops."""
    if cfg.trace_path is None:
        return None
    tracer = Tracer(cfg.trace_path, "kvstore serve")
    metrics.trace_to(tracer)
    return tracer


class TierTrace:
    """Residency as instants of the trace: one track per tier (``stored``, ``evicted``...)."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer

    def stored(self, tier: str, key) -> None:
        self.tracer.instant(
            self.tracer.track(f"tier {tier}", 10_000),
            "stored",
            time.monotonic(),
            {"hash": f"{wire_hash(key.chunk_hash):016x}"},
        )

    def removed(self, tier: str, key, reason) -> None:
        self.tracer.instant(
            self.tracer.track(f"tier {tier}", 10_000),
            reason.value,
            time.monotonic(),
            {"hash": f"{wire_hash(key.chunk_hash):016x}"},
        )


def trace_tiers(tracer: Tracer, store: ServerStore) -> None:
    for tier in store.tiers:
        listen(tier, TierTrace(tracer))


__all__ = ["TierTrace", "start_trace", "trace_tiers"]
